"""The copy policy (``copy_tensor=True``) of :mod:`machinlike.pickle`: a plain strided
tensor's elements go into the stream as one in-band pickle-5 buffer and come back as a new
tensor; anything exotic (sparse, quantized, nested, conjugate views) takes torch's own
by-value ``__reduce_ex__``."""

from __future__ import annotations

import pickle
from typing import Any, Optional, Tuple

import torch

from .table import DispatchTable, policy_table

__all__ = ["copy_reducers", "cpu_copy_reducers", "dense_order", "undo_order", "expanded", "expand_back"]


def _is_plain_strided(tensor: torch.Tensor) -> bool:
    return (
        tensor.layout == torch.strided
        and tensor.device.type in ("cpu", "cuda")
        and not tensor.is_quantized
        and not tensor.is_nested
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


def dense_order(tensor: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """The order of dimensions in which ``tensor``'s elements lie densely in memory, when
    that is not its own (a channels-last image, a transpose): ``tensor.permute(order)`` is
    contiguous. None: ``tensor`` is contiguous already, or dense in no order (sliced,
    expanded); a copy of it is contiguous.

    Copies keep such a layout, as torch RPC and ``torch.save`` do: a channels-last batch
    that arrived contiguous would make the receiver's convolutions convert it again.
    """
    if tensor.dim() < 2 or tensor.is_contiguous():
        return None
    strides = tensor.stride()
    order = tuple(sorted(range(tensor.dim()), key=lambda dim: -strides[dim]))
    return order if tensor.permute(order).is_contiguous() else None


def expanded(tensor: torch.Tensor) -> Optional[Tuple[torch.Tensor, Tuple[int, ...]]]:
    """``(compact, shape)`` for a tensor that repeats its elements along dimensions of
    stride 0 (``expand``, ``broadcast_to``): ``compact`` has those dimensions of size 1,
    and ``compact.expand(shape)`` is the tensor again. None for any other tensor (and for
    one requiring grad, whose expansion would be a step of its graph).

    Why: copied element by element, ``torch.zeros(1).expand(10**7)`` is 40 MB to send and
    to hold, where pickle and torch RPC send its one element and its strides.
    """
    strides = tensor.stride()
    if 0 not in strides or tensor.requires_grad or not tensor.numel():
        return None
    shape = tuple(tensor.shape)
    index = tuple(slice(0, 1) if stride == 0 and size > 1 else slice(None) for stride, size in zip(strides, shape))
    if all(part == slice(None) for part in index):
        return None
    return tensor[index], shape


def expand_back(compact: torch.Tensor, shape: Tuple[int, ...]) -> torch.Tensor:
    """The tensor :func:`expanded` took apart."""
    return compact.expand(shape)


def undo_order(tensor: torch.Tensor, order: Optional[Tuple[int, ...]]) -> torch.Tensor:
    """``tensor`` (a copy of ``original.permute(order)``) in ``original``'s dimension order."""
    if order is None:
        return tensor
    inverse = [0] * len(order)
    for position, dim in enumerate(order):
        inverse[dim] = position
    return tensor.permute(inverse)


def _byte_view(tensor: torch.Tensor) -> pickle.PickleBuffer:
    # The array views the tensor's memory; PickleBuffer lets the pickler copy it straight
    # into the stream (one copy), and the loader gets a bytearray it can wrap without copy.
    flat = tensor.detach().reshape(-1)
    if flat.numel() and flat.stride(0) != 1:
        # A one-element or expanded tensor can count as contiguous with another stride,
        # and a byte view needs stride 1.
        flat = flat.clone(memory_format=torch.contiguous_format)
    # (Any: numpy's stubs make an ndarray a buffer on Python 3.12 and later only.)
    array: Any = flat.view(torch.uint8).numpy()
    return pickle.PickleBuffer(array)


def _reduce_tensor_copy(tensor: torch.Tensor) -> Tuple[Any, ...]:
    if not _is_plain_strided(tensor):
        return tensor.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    parts = expanded(tensor)
    if parts is not None:  # its distinct elements travel (this reducer again), expanded on arrival
        return expand_back, parts
    device = str(tensor.device)
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.to("cpu")
    order = None
    if not data.is_contiguous():  # (the common tensor asks nothing more)
        order = dense_order(data)  # a channels-last or transposed tensor keeps its layout
        data = data.contiguous() if order is None else data.permute(order)
    return (
        _rebuild_tensor_copy,
        (type(tensor), _byte_view(data), tensor.dtype, tuple(data.shape), tensor.requires_grad, device, order),
    )


def _rebuild_tensor_copy(
    cls: type, data: bytearray, dtype: torch.dtype, shape: Tuple[int, ...], requires_grad: bool, device: str,
    order: Optional[Tuple[int, ...]] = None,
) -> torch.Tensor:
    """The tensor of :func:`_reduce_tensor_copy`; ``shape`` is the copy's, in ``order``
    (None: the tensor's own; a stream from before ``order`` existed has no such field)."""
    if len(data) == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
        tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]  # torch stubs
    tensor = undo_order(tensor, order)
    if device != "cpu":
        tensor = tensor.to(device)
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def _reduce_storage_copy(storage: torch.UntypedStorage) -> Tuple[Any, ...]:
    device = str(storage.device)
    if storage.device.type != "cpu":
        storage = storage.cpu()
    data = torch.empty(0, dtype=torch.uint8).set_(storage)
    return (_rebuild_storage_copy, (_byte_view(data), device))


def _rebuild_storage_copy(data: bytearray, device: str) -> torch.UntypedStorage:
    if len(data) == 0:
        storage = torch.UntypedStorage(0)
    else:
        storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
    if device != "cpu":
        storage = storage.to(device=device)
    return storage


def copy_reducers() -> DispatchTable:
    """The copy policy's table: tensor and storage data by value."""
    return policy_table(_reduce_tensor_copy, _reduce_storage_copy)


def _reduce_tensor_to_cpu(tensor: torch.Tensor) -> Tuple[Any, ...]:
    if tensor.device.type != "cpu" and not _is_plain_strided(tensor):
        tensor = tensor.detach().cpu()  # (exotic: torch's own reduction, of a CPU copy)
    reduced = _reduce_tensor_copy(tensor)
    if reduced[0] is _rebuild_tensor_copy:  # (an expanded tensor's compact part comes back here)
        args = reduced[1]
        reduced = (_rebuild_tensor_copy, args[:5] + ("cpu",) + args[6:])
    return reduced


def _reduce_storage_to_cpu(storage: torch.UntypedStorage) -> Tuple[Any, ...]:
    rebuild, (data, _) = _reduce_storage_copy(storage)
    return rebuild, (data, "cpu")


def cpu_copy_reducers() -> DispatchTable:
    """The copy policy's table with every tensor and storage rebuilt on the CPU: for a
    report (a worker's exception) whose reader may have no GPU, and must not initialise
    CUDA to read it (a CUDA context costs hundreds of MB, and a process that made one can
    no longer fork workers that use CUDA)."""
    return policy_table(_reduce_tensor_to_cpu, _reduce_storage_to_cpu)
