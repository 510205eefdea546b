"""Many medium tensors and arrays of one message, copied into one lent segment.

Why: a replay sample is a list of hundreds of tensors or arrays of 4 KiB to 1 MiB each
(frames, observations), each under the threshold from which one tensor gets a segment of
its own. Through the lane each was an out-of-band buffer: copied into a socket, out again
into fresh memory, a system call or more per buffer (a reply of 200 x 64 KB took 15 ms
against raw torch RPC's 11). Packed, the sender copies each into one segment at its offset
and the receiver only maps it (cached)::

    sender: encode's walk                         receiver: unpickling
      medium item ─► Pack.add ─► _Packed ref        _load_packed(ref 1) ─► the segment's
      ...                                              array, mapped once (kept weakly)
      Pack.commit: total >= threshold?              _load_packed(ref k) ─► the same array,
        yes, a segment leased: copy each at            a view at ref k's offset
          its offset, refs rebuild as views          every view died ─► the segment is FREE
        no: refs pickle as the items themselves

The lease ends when the last of the message's tensors and arrays dies: a receiver that
keeps one frame of a sample keeps the whole segment, a bounded cost (the sender's
``shm_cache_bytes``; past it, leases fail and items travel as before).
"""

from __future__ import annotations

import ctypes
import os
import threading
import weakref
from typing import Any, List, Optional, Tuple, Union

import numpy as np
import torch

from .._reductions.arrays import Order, array_over, order_of
from .._reductions.copy import dense_order, undo_order
from . import _receive
from ._segments import Segment, cache

__all__ = ["Pack", "PACK_MIN"]

#: Bytes from which a tensor or array under the threshold is packed: below it, pickling
#: it in the message costs less than finding its place.
PACK_MIN = 4096
_ALIGN = 64  # every item starts on a cache line (and on any dtype's alignment)

Item = Union[torch.Tensor, np.ndarray]


def _as_is(item: Item) -> Item:
    return item


class _Packed:
    """Pickles as a view into the message's segment, or as the item itself (not packed)."""

    __slots__ = ("item", "reduced")

    def __init__(self, item: Item) -> None:
        self.item = item
        self.reduced: Tuple[Any, ...] = (_as_is, (item,))

    def __reduce__(self) -> Tuple[Any, ...]:
        return self.reduced


class Pack:
    """The medium items of one message; :meth:`commit` packs them (or leaves them be).

    Args:
        threshold: Bytes from which one item gets a segment of its own; items of
            ``PACK_MIN`` up to that are packed, once they add up to ``threshold``.
    """

    def __init__(self, threshold: int) -> None:
        self._threshold = threshold
        self._refs: List[_Packed] = []
        self._total = 0  # bytes of the segment (each item aligned)
        self._bytes = 0  # bytes of the items (one alone is under the threshold: never packed)

    def wants(self, nbytes: int) -> bool:
        return PACK_MIN <= nbytes < self._threshold

    def add(self, item: Item) -> _Packed:
        """A placeholder for ``item`` (a strided CPU tensor without history, or a numpy
        array without Python objects), filled by :meth:`commit`."""
        ref = _Packed(item)
        self._refs.append(ref)
        self._total += -(-item.nbytes // _ALIGN) * _ALIGN
        self._bytes += item.nbytes
        return ref

    def commit(self) -> None:
        """Copy the items into one leased segment when they add up to the threshold and a
        segment is free; else they pickle as themselves."""
        if self._bytes < self._threshold:
            return
        seg = cache().lease(self._total)
        if seg is None:
            return  # (counted by the cache as a fallback)
        try:
            offset = 0
            for ref in self._refs:
                ref.reduced = _copy_in(seg, offset, ref.item)
                offset += -(-ref.item.nbytes // _ALIGN) * _ALIGN
        except BaseException:
            for ref in self._refs:
                ref.reduced = (_as_is, (ref.item,))
            cache().release(seg)
            raise
        for ref in self._refs:
            ref.item = None  # type: ignore[assignment]  # (the copy is made: the message need not keep it)


def _copy_in(seg: Segment, offset: int, item: Item) -> Tuple[Any, ...]:
    nbytes = item.nbytes
    head = (os.getpid(), seg.fd, seg.inode, seg.capacity, offset, nbytes)
    if isinstance(item, np.ndarray):
        order = order_of(item)
        if item.flags.c_contiguous or item.flags.f_contiguous:  # one memmove: no per-item dispatch
            ctypes.memmove(seg.data.data_ptr() + offset, item.ctypes.data, nbytes)
        else:
            np.copyto(array_over(seg.data[offset:offset + nbytes].numpy(), item.dtype, item.shape, order), item,
                      casting="no")
        return (_load_packed_array, (*head, item.dtype, item.shape, order))
    source = item.detach()
    layout = None
    if source.is_contiguous():  # (torch's copy_ costs more in dispatch than 64 KB take to move)
        ctypes.memmove(seg.data.data_ptr() + offset, source.data_ptr(), nbytes)
    else:
        layout = dense_order(source)  # a channels-last or transposed tensor keeps its layout
        if layout is not None:
            source = source.permute(layout)
        seg.data[offset:offset + nbytes].view(item.dtype).view(source.shape).copy_(source)
    return (_load_packed_tensor, (*head, item.dtype, tuple(source.shape), item.requires_grad,
                                  type(item) is torch.nn.Parameter, layout))


# ------------------------------------------------------------------------- receiver
# The mapped data of each packed segment being loaded, by (owner pid, inode): every item
# of a message views one array, whose death frees the lease. Kept weakly: a key that is
# alive is the same lease (its owner lends the segment again only once it died).
_bases: "weakref.WeakValueDictionary[Tuple[int, int], np.ndarray]" = weakref.WeakValueDictionary()
_bases_lock = threading.Lock()


def _base(pid: int, fd: int, inode: int, capacity: int) -> np.ndarray:
    with _bases_lock:
        base = _bases.get((pid, inode))
        if base is None:
            base = _bases[(pid, inode)] = _receive.lent_array(pid, fd, inode, capacity, capacity)
    return base


def _load_packed_tensor(pid: int, fd: int, inode: int, capacity: int, offset: int, nbytes: int,
                        dtype: torch.dtype, shape: Tuple[int, ...], requires_grad: bool, parameter: bool,
                        order: Optional[Tuple[int, ...]]) -> torch.Tensor:
    data = torch.from_numpy(_base(pid, fd, inode, capacity)[offset:offset + nbytes])
    tensor = undo_order(data.view(dtype).view(shape), order)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad) if requires_grad else tensor


def _load_packed_array(pid: int, fd: int, inode: int, capacity: int, offset: int, nbytes: int,
                       dtype: np.dtype, shape: Tuple[int, ...], order: Order) -> np.ndarray:
    return array_over(_base(pid, fd, inode, capacity)[offset:offset + nbytes], dtype, shape, order)


def _after_fork_in_child() -> None:
    global _bases_lock
    _bases_lock = threading.Lock()
    _bases.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
