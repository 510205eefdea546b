"""Tensors as same-host descriptors: copies through lent segments, shares by reference.

``encode`` replaces, in an object made of lists, tuples, dicts, namedtuples and objects
pickled by their ``__dict__`` (see ``_walk``), every CPU tensor of at
least ``threshold`` bytes by a small placeholder whose pickle rebuilds the tensor on the
receiving side (whatever pickler carries it: TensorPipe's, a pool's)::

    tensor ─┬─ storage shared by reference (share(), or received that way)
            │       └─► _load_by_reference(pid, fd, inode, size, offset, ...)  no copy
            ├─ plain strided CPU tensor, no autograd history
            │       └─► copy into a lent segment ─► _load_copy(pid, fd, inode, ...)  one copy
            └─ anything else (CUDA, sparse, quantized, conj/neg bits, grad_fn; for RPC
               also requires_grad, which distributed autograd tracks; no segment free)
                    └─► left as it is: the carrier's own path
    numpy array (no Python objects in it) ─► copy into a lent segment ─► _load_array  one copy

Why numpy arrays too: RL code moves observations and replay batches as numpy arrays, and
a pickled array goes through the carrier's bytes (0.3-0.7 GB/s here from 16 MB, against
5-10 GB/s for a tensor through a segment).

A copy stays a copy: the receiver's tensor views a segment nobody else uses until that
tensor dies. Only a storage the user shared (:func:`share`) travels by reference, and a
tensor received by reference travels on by reference.
"""

from __future__ import annotations

import collections
import os
import threading
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy as np
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from .._gc import paused as paused_gc
from .._reductions import shm_space
from .._reductions.arrays import Order, array_over, order_of
from .._reductions.copy import dense_order, expand_back, expanded, undo_order
from . import _receive, _recycled
from ._pack import PACK_MIN, Pack, finish as _finish
from ._segments import Segment, cache
from ._unsent import guard
from ._walk import untouched, walk

__all__ = ["pack_items", "encode", "encode_parts", "encode_tensor", "encode_array", "share", "share_and_reduce", "shm_eligible",
           "reduce_copy", "reduce_array", "reduce_by_reference", "is_shared_by_reference"]

_lock = threading.Lock()
# This process's storages shared by reference, by inode and by data address (weakly).
_own: Dict[int, Tuple[StorageWeakRef, int, int, int]] = {}  # inode -> (ref, fd, size, address)
_own_by_address: Dict[int, int] = {}  # data address -> inode
# The last few storages sent by reference stay alive so that a receiver can still open
# them after the sender dropped its tensor right away (a worker returning a fresh share).
_RECENT = 4
_recent: Deque[torch.UntypedStorage] = collections.deque()


class _Placeholder:
    """Pickles as the call that rebuilds a tensor on the receiving side."""

    __slots__ = ("reduced",)

    def __init__(self, reduced: Tuple[Any, ...]) -> None:
        self.reduced = reduced

    def __reduce__(self) -> Tuple[Any, ...]:
        return self.reduced


def shm_eligible(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` may travel through shared memory (never a CUDA tensor)."""
    return (
        tensor.is_cpu  # (not device.type: a quarter of this check's time, once per tensor of a message)
        and tensor.layout == torch.strided
        and (type(tensor) is torch.Tensor or type(tensor) is torch.nn.Parameter)
        and tensor.grad_fn is None
        and not tensor.is_quantized
        and not tensor.is_nested  # (strided too, but its storage is a buffer of parts)
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


# ---------------------------------------------------------------------- by reference
def _fd_of(storage: torch.UntypedStorage) -> Optional[int]:
    if not storage.is_shared():
        return None
    try:
        return storage._get_shared_fd()  # type: ignore[attr-defined]  # torch internal, absent from its stubs
    except RuntimeError:  # shared by name (torch's file_system strategy)
        return None


def _register_own(storage: torch.UntypedStorage) -> Tuple[int, int, int]:
    fd = _fd_of(storage)
    if fd is None:
        if not storage.is_shared():
            shm_space.require_room(storage.nbytes(), "sharing a tensor's memory")
        try:
            fd, _ = storage._share_fd_cpu_()  # moves it into fd-backed shared memory, in place
        except RuntimeError as err:
            if shm_space.is_full(err, storage.nbytes()):
                raise shm_space.full_error(storage.nbytes(), "sharing a tensor's memory") from err
            raise
    size = storage.nbytes()
    inode = os.fstat(fd).st_ino
    with _lock:
        _own[inode] = (StorageWeakRef(storage), fd, size, storage.data_ptr())
        _own_by_address[storage.data_ptr()] = inode
        if len(_own) > 64:  # forget storages that died
            for key in [k for k, (ref, _, _, _) in _own.items() if ref.expired()]:
                _own.pop(key, None)
            live = set(_own)
            for address in [a for a, i in _own_by_address.items() if i not in live]:
                del _own_by_address[address]
    return fd, inode, size


def share(tensor: torch.Tensor) -> torch.Tensor:
    """Mark ``tensor``'s memory as shared with same-host receivers (see the public doc)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor must be a torch.Tensor, not {type(tensor).__name__}")
    if not shm_eligible(tensor):
        raise ValueError(
            f"tensor on {tensor.device} with layout {tensor.layout} cannot be shared through shared "
            f"memory: share() takes a strided CPU torch.Tensor without autograd history "
            f"(detach() it first; CUDA tensors travel through TensorPipe)"
        )
    storage = tensor.untyped_storage()
    if storage.nbytes() == 0:
        return tensor
    if storage.is_shared() and _fd_of(storage) is None:
        raise ValueError(
            "tensor's memory is shared by name (torch's file_system sharing strategy); share() needs "
            "memory shared by file descriptor: share a .clone() of it instead"
        )
    _register_own(storage)
    return tensor


def _origin(storage: torch.UntypedStorage) -> Optional[Tuple[int, int, int, int]]:
    address = storage.data_ptr()
    inode = _own_by_address.get(address)
    if inode is not None:
        entry = _own.get(inode)
        # (the address check: an inode may have been reused by a later share)
        if entry is not None and entry[3] == address and not entry[0].expired():
            return (os.getpid(), entry[1], inode, entry[2])
    return _receive.foreign_origin(address)


def is_shared_by_reference(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` travels by reference (its storage was shared or so received)."""
    return _origin(tensor.untyped_storage()) is not None


def reduce_by_reference(tensor: torch.Tensor) -> Optional[Tuple[Any, ...]]:
    """The rebuild call of ``tensor`` by reference; None when it is not shared that way."""
    storage = tensor.untyped_storage()
    origin = _origin(storage)
    if origin is None:
        return None
    seq = _recycled.sequence(storage) if origin[0] == os.getpid() else _recycled.sent_sequence(tensor)
    # (a recycled storage's owner keeps it alive, and reuses it once nothing here holds it)
    if origin[0] == os.getpid() and seq is None and not any(kept.data_ptr() == storage.data_ptr() for kept in _recent):
        if len(_recent) == _RECENT:
            _receive.bury(_recent.popleft())
        _recent.append(storage)
    return (_load_by_reference, (*origin, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
                                 tensor.dtype, tensor.requires_grad, type(tensor) is torch.nn.Parameter)
            + (() if seq is None else (seq,)))


def share_and_reduce(tensor: torch.Tensor) -> Optional[Tuple[Any, ...]]:
    """Share ``tensor``'s storage (moving it into shared memory) and reduce it by reference;
    None when its storage is shared by name (left to torch)."""
    storage = tensor.untyped_storage()
    if _origin(storage) is None:
        if storage.is_shared() and _fd_of(storage) is None:
            return None
        _register_own(storage)
    return reduce_by_reference(tensor)


def _load_by_reference(pid: int, fd: int, inode: int, size: int, offset: int, shape: Tuple[int, ...],
                       stride: Tuple[int, ...], dtype: torch.dtype, requires_grad: bool,
                       parameter: bool, seq: Optional[int] = None) -> torch.Tensor:
    if pid == os.getpid():
        entry = _own.get(inode)
        if entry is None or entry[0].expired():
            raise RuntimeError("a tensor this process shared came back after its memory was freed")
        storage = torch.UntypedStorage._new_with_weak_ptr(entry[0].cdata)
    else:
        storage = _receive.attach(pid, fd, inode, size, lent=False).shared_storage()
    tensor = _finish(torch.empty(0, dtype=dtype).set_(storage, offset, shape, stride), requires_grad, parameter)
    return tensor if seq is None else _recycled.note(tensor, seq)  # (its owner may rewrite it: see _recycled)


# -------------------------------------------------------------------------- by copy
def reduce_copy(tensor: torch.Tensor, lent: Optional[List[Segment]] = None) -> Optional[Tuple[Any, ...]]:
    """Copy ``tensor`` into a lent segment; its rebuild call, or None without a segment.
    ``lent`` learns the segment (the message's record, see ``_unsent``)."""
    nbytes = tensor.nbytes
    seg = cache().lease(nbytes)
    if seg is None:
        return None
    source = tensor.detach()
    order = dense_order(source)  # a channels-last or transposed tensor keeps its layout
    if order is not None:
        source = source.permute(order)
    try:
        seg.data[:nbytes].view(tensor.dtype).view(source.shape).copy_(source)
    except BaseException:
        cache().release(seg)
        raise
    if lent is not None:
        lent.append(seg)
    return (_load_copy, (os.getpid(), seg.fd, seg.inode, seg.capacity, nbytes, tensor.dtype, tuple(source.shape),
                         tensor.requires_grad, type(tensor) is torch.nn.Parameter, order, seg.claim()))


def _load_copy(pid: int, fd: int, inode: int, capacity: int, nbytes: int, dtype: torch.dtype,
               shape: Tuple[int, ...], requires_grad: bool, parameter: bool,
               order: Optional[Tuple[int, ...]] = None, claim: int = 0) -> torch.Tensor:
    tensor = _receive.lent_view(pid, fd, inode, capacity, nbytes, claim).view(dtype).view(shape)
    return _finish(undo_order(tensor, order), requires_grad, parameter)


def reduce_array(array: np.ndarray, lent: Optional[List[Segment]] = None) -> Optional[Tuple[Any, ...]]:
    """Copy ``array`` into a lent segment; its rebuild call, or None without a segment
    (``lent``: as for :func:`reduce_copy`)."""
    nbytes = array.nbytes
    seg = cache().lease(nbytes)
    if seg is None:
        return None
    order = order_of(array)  # a Fortran-ordered array arrives in that order
    try:
        np.copyto(array_over(seg.data[:nbytes].numpy(), array.dtype, array.shape, order), array, casting="no")
    except BaseException:
        cache().release(seg)
        raise
    if lent is not None:
        lent.append(seg)
    return (_load_array, (os.getpid(), seg.fd, seg.inode, seg.capacity, nbytes, array.dtype, array.shape, order,
                          seg.claim()))


def _load_array(pid: int, fd: int, inode: int, capacity: int, nbytes: int, dtype: np.dtype,
                shape: Tuple[int, ...], order: Order, claim: int = 0) -> np.ndarray:
    return array_over(_receive.lent_array(pid, fd, inode, capacity, nbytes, claim), dtype, shape, order)


# ----------------------------------------------------------------------------- walk
def _maybe_shared(tensor: torch.Tensor) -> bool:
    """A quick first test of a small tensor's memory (see ``_origin`` for the whole one)."""
    address = tensor.untyped_storage().data_ptr()
    return address in _own_by_address or (_receive.mapped_any() and _receive.foreign_origin(address) is not None)


def _encode_tensor(tensor: torch.Tensor, threshold: int, pack: Optional[Pack] = None, large: bool = True) -> Any:
    # requires_grad: TensorPipe records distributed autograd's send/recv functions for it
    # (the layout first: a sparse tensor has no nbytes)
    if not shm_eligible(tensor) or tensor.requires_grad:
        return tensor
    nbytes = tensor.nbytes
    if nbytes >= PACK_MIN and 0 in tensor.stride():
        parts = expanded(tensor)
        if parts is not None:  # its distinct elements travel, expanded on arrival (see expanded)
            compact = parts[0]
            if compact.nbytes >= threshold:  # (a large one takes its own segment; a smaller one is
                compact = _encode_tensor(compact, threshold, pack, large)  # left to the carrier)
            return _Placeholder((expand_back, (compact, parts[1])))
    if not large and nbytes >= threshold:
        return tensor
    if nbytes < threshold:
        # Memory share()d (or so received) travels by reference whatever its size: its
        # users edit it in place on both sides. (The maps are empty in most processes.)
        if nbytes and (_own_by_address or _receive.mapped_any()) and _maybe_shared(tensor):
            reduced = reduce_by_reference(tensor)
            if reduced is not None:
                return _Placeholder(reduced)
        if pack is None or not nbytes:
            return tensor
        if pack.wants(nbytes):
            return pack.add(tensor)
        return pack.add_small(tensor)
    reduced = reduce_by_reference(tensor) or reduce_copy(tensor, None if pack is None else pack.lent)
    return tensor if reduced is None else _Placeholder(reduced)


def encode_array(array: np.ndarray, threshold: int, pack: Optional[Pack] = None, large: bool = True) -> Any:
    """A numpy array of :func:`encode`'s walk: a placeholder, or ``array`` itself (small,
    holding Python objects, or no segment free); with ``pack``, a medium one joins it;
    ``large`` False: one of ``threshold`` bytes or more is left as it is."""
    if array.dtype.hasobject or (not large and array.nbytes >= threshold):
        return array
    if array.nbytes < threshold:
        if pack is None or not array.nbytes:
            return array
        if pack.wants(array.nbytes):
            return pack.add(array)
        return pack.add_small(array)
    reduced = reduce_array(array, None if pack is None else pack.lent)
    return array if reduced is None else _Placeholder(reduced)


def encode_tensor(tensor: torch.Tensor, threshold: int, pack: Optional[Pack] = None) -> Any:
    """One tensor of :func:`encode`'s walk: a placeholder, or ``tensor`` itself (for a
    caller that walks an object for other reasons too, see ``distributed._calls.cuda_stage``);
    with ``pack``, a medium one joins it (the caller commits it after the walk)."""
    return _encode_tensor(tensor, threshold, pack)


def encode(obj: Any, threshold: int, receiver: int = 0) -> Any:
    """``obj`` with its large CPU tensors and numpy arrays (where ``_walk`` finds them)
    replaced by placeholders, and its medium ones packed into one segment when they add
    up to ``threshold`` (see ``_pack``).

    Returns ``obj`` itself when nothing was replaced. A tensor that appears twice is
    encoded once, so the receiver gets one tensor twice, as pickle would give. When
    segments were lent, it is wrapped so that they come back should pickling it fail, or
    should ``receiver`` die before taking them (its identity word, ``machinlike._pids``;
    0: unknown) (see ``_unsent``; it unpickles as the encoded object).
    """
    return encode_parts((obj,), threshold, receiver)[0]


def encode_parts(parts: Tuple[Any, ...], threshold: int, receiver: int = 0) -> Tuple[Any, ...]:
    """:func:`encode` for the parts of one message (a call's args and kwargs) in one walk:
    a tensor found in two parts arrives as one, and their segments come back unless every
    part was pickled (or when ``receiver`` died before taking them)."""
    pack = Pack(threshold)
    memo: Dict[int, Any] = {}
    with paused_gc():
        out = [walk(part, lambda tensor: _encode_tensor(tensor, threshold, pack), memo,
                    lambda array: encode_array(array, threshold, pack)) for part in parts]
        pack.commit()
    return guard(out, pack.lent, receiver=receiver)


def pack_items(obj: Any, threshold: int) -> Tuple[Any, Pack]:
    """``obj`` with only its medium and small tensors and arrays packed (see ``_pack``);
    large ones are left to the caller's pickler (a pool's policy). Returns it and its
    pack, whose ``leased`` says a segment was lent (loading the payload frees it; a
    payload never made must ``release`` it)."""
    pack = Pack(threshold)
    if untouched(obj):  # nothing to pack (a pool call of numbers): no pause of the collector, no commit
        return obj, pack
    with paused_gc():
        out = walk(obj, lambda tensor: _encode_tensor(tensor, threshold, pack, large=False), None,
                   lambda array: encode_array(array, threshold, pack, large=False))
        pack.commit()
    return out, pack


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()
    _own.clear()
    _own_by_address.clear()
    _recent.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
