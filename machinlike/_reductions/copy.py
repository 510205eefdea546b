"""The copy policy (``copy_tensor=True``) of :mod:`machinlike.pickle`: a plain strided
tensor's elements go into the stream as one in-band pickle-5 buffer and come back as a new
tensor; anything exotic (sparse, quantized, nested, conjugate views) takes torch's own
by-value ``__reduce_ex__``."""

from __future__ import annotations

import pickle
from typing import Any, Tuple

import torch

from .table import DispatchTable, policy_table

__all__ = ["copy_reducers"]


def _is_plain_strided(tensor: torch.Tensor) -> bool:
    return (
        tensor.layout == torch.strided
        and tensor.device.type in ("cpu", "cuda")
        and not tensor.is_quantized
        and not tensor.is_nested
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


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
    device = str(tensor.device)
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.to("cpu")
    if not data.is_contiguous():
        data = data.contiguous()
    return (
        _rebuild_tensor_copy,
        (type(tensor), _byte_view(data), tensor.dtype, tuple(tensor.shape), tensor.requires_grad, device),
    )


def _rebuild_tensor_copy(
    cls: type, data: bytearray, dtype: torch.dtype, shape: Tuple[int, ...], requires_grad: bool, device: str
) -> torch.Tensor:
    if len(data) == 0:
        tensor = torch.empty(shape, dtype=dtype)
    else:
        storage = torch.frombuffer(data, dtype=torch.uint8).untyped_storage()
        tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]  # torch stubs
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
