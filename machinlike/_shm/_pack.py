"""Many medium tensors and arrays of one message, copied into one lent segment.

Why: a replay sample is a list of hundreds of tensors or arrays of 4 KiB to 1 MiB each
(frames, observations), each under the threshold from which one tensor gets a segment of
its own. Through the lane each was an out-of-band buffer: copied into a socket, out again
into fresh memory, a system call or more per buffer (a reply of 200 x 64 KB took 15 ms
against raw torch RPC's 11). Packed, the sender copies each into one segment at its
offset, and the receiver maps the segment (cached) and views it::

    sender: encode's walk                        receiver: unpickling
      medium item ─► Pack.add ─► _Packed ref       ref 1 ─► _Unpacked (pickled once,
      ...                                            memo) ─► _load_pack: every item,
      Pack.commit: items add up to threshold?          views into the mapped segment
        yes, a segment leased: copy each at          ref k ─► operator.getitem(items, k)
          its offset, one table for all of them      every view died ─► segment FREE
        no: refs pickle as the items themselves

The lease ends when the last of the message's items dies, so a receiver that keeps one
frame of a sample keeps the sample's segment. Bounded: past half its own
``shm_cache_bytes`` of such segments, a receiver copies a message's items out (its
segment is FREE at once), however many senders there are.

Small items (under ``PACK_MIN``: a transition's observation) cost more to pickle one by
one than their bytes. From ``SMALL_MIN`` of them in a message, one bytes object in the
message carries them all and the receiver copies each out (so keeping one keeps nothing
else). The walk puts a placeholder for each in at once (one walk, not a second one to
swap them in); with fewer than ``SMALL_MIN`` the placeholders pickle as the items.
"""

from __future__ import annotations

import ctypes
import operator
import os
import threading
import weakref
from typing import Any, List, Optional, Tuple, Union

import numpy as np
import torch

from .._reductions.arrays import array_over, order_of
from .._reductions.copy import dense_order, undo_order
from . import _receive
from ._segments import Segment, cache
from ._small import Stack, stack, unstack

__all__ = ["Pack", "PACK_MIN", "SMALL_MIN", "finish"]

#: Bytes from which a tensor or array under the threshold is packed into a segment; below
#: it, one is bundled with the message's other small ones (at least ``SMALL_MIN``).
PACK_MIN = 4096
SMALL_MIN = 8
_ALIGN = 64  # every item starts on a cache line (and on any dtype's alignment)

Item = Union[torch.Tensor, np.ndarray]


def _aligned(nbytes: int) -> int:
    """``nbytes`` rounded up to the next item start."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _as_is(item: Item) -> Item:
    return item


class _Packed:
    """Pickles as its item of the unpacked message, or as the item itself (not packed)."""

    __slots__ = ("item", "reduced")

    def __init__(self, item: Item) -> None:
        self.item = item
        self.reduced: Tuple[Any, ...] = (_as_is, (item,))

    def __reduce__(self) -> Tuple[Any, ...]:
        return self.reduced


class _Unpacked:
    """Pickles as the call that loads every item of the segment at once; pickled once per
    message (pickle's memo), before the first item that names it."""

    __slots__ = ("reduced",)

    def __init__(self, reduced: Tuple[Any, ...]) -> None:
        self.reduced = reduced

    def __reduce__(self) -> Tuple[Any, ...]:
        return self.reduced


class Pack:
    """The medium and small items of one message; :meth:`commit` packs the first into one
    segment and bundles the second (or leaves them be).

    Args:
        threshold: Bytes from which one item gets a segment of its own; items of
            ``PACK_MIN`` up to that are packed, once they add up to ``threshold``.
    """

    def __init__(self, threshold: int) -> None:
        self._threshold = threshold
        self._refs: List[_Packed] = []
        self._total = 0  # bytes of the segment (each item aligned)
        self._bytes = 0  # bytes of the items (one alone is under the threshold: never packed)
        self._small: List[_Packed] = []
        self._seg: Optional[Segment] = None  # the segment lent for this message (loading it frees it)
        self.lent: List[Segment] = []  # every segment lent for this message, its large items' too

    def wants(self, nbytes: int) -> bool:
        return PACK_MIN <= nbytes < self._threshold

    def add_small(self, item: Item) -> _Packed:
        """A placeholder for ``item`` (eligible, under ``PACK_MIN``): :meth:`commit`
        bundles such items when there are many; else it pickles as the item itself."""
        ref = _Packed(item)
        self._small.append(ref)
        return ref

    def add(self, item: Item) -> _Packed:
        """A placeholder for ``item`` (a strided CPU tensor without history, or a numpy
        array without Python objects), filled by :meth:`commit`."""
        ref = _Packed(item)
        self._refs.append(ref)
        self._total += _aligned(item.nbytes)
        self._bytes += item.nbytes
        return ref

    def commit(self) -> None:
        """Copy the medium items into one leased segment when they add up to the threshold
        and a segment is free (else they pickle as themselves); bundle the small ones when
        there are at least ``SMALL_MIN``."""
        self._bundle_small()
        if self._bytes >= self._threshold:
            self._pack_medium()

    @property
    def leased(self) -> bool:
        """Whether a segment was lent for this message (loading the message frees it)."""
        return self._seg is not None

    def release(self) -> None:
        """Hand the segment back: the message was never sent (its pickling failed)."""
        if self._seg is not None:
            cache().release(self._seg)
            self._seg = None

    def _bundle_small(self) -> None:
        # Tiny tensors (a transition's observation) cost more in per-tensor pickling than
        # their bytes: those of one kind are stacked (``_small``), the others copied into
        # one bytes object, and the receiver copies each out (no view: keeping one must
        # not keep the others). (The walk's memo gave an item met twice one placeholder.)
        refs = self._small
        if len(refs) < SMALL_MIN:
            return
        stacks, rest = stack([ref.item for ref in refs])
        blob = torch.empty(sum(_aligned(refs[i].item.nbytes) for i in rest), dtype=torch.uint8)
        table = []
        offset = 0
        for i in rest:
            table.append(_copy_in(blob, offset, refs[i].item))
            offset += _aligned(refs[i].item.nbytes)
        whole = _Unpacked((_load_small, (len(refs), stacks, blob.numpy().tobytes(), table, rest)))
        for index, ref in enumerate(refs):
            ref.reduced = (operator.getitem, (whole, index))
            ref.item = None  # type: ignore[assignment]  # (copied: the message need not keep it)

    def _pack_medium(self) -> None:
        seg = cache().lease(self._total)
        if seg is None:
            return  # (counted by the cache as a fallback)
        try:
            table = []
            offset = 0
            for ref in self._refs:
                table.append(_copy_in(seg.data, offset, ref.item))
                offset += _aligned(ref.item.nbytes)
        except BaseException:
            cache().release(seg)
            raise
        self._seg = seg
        self.lent.append(seg)
        whole = _Unpacked((_load_pack, (os.getpid(), seg.fd, seg.inode, seg.capacity, table, seg.claim())))
        for index, ref in enumerate(self._refs):
            ref.reduced = (operator.getitem, (whole, index))
            ref.item = None  # type: ignore[assignment]  # (the copy is made: the message need not keep it)


def _copy_in(dest: torch.Tensor, offset: int, item: Item) -> Tuple[Any, ...]:
    """Copy ``item`` into ``dest`` (uint8) at ``offset``; its entry of the message's table."""
    nbytes = item.nbytes
    if isinstance(item, np.ndarray):
        order = order_of(item)
        if item.flags.c_contiguous or item.flags.f_contiguous:  # one memmove: no per-item dispatch
            ctypes.memmove(dest.data_ptr() + offset, item.ctypes.data, nbytes)
        else:
            np.copyto(array_over(dest[offset:offset + nbytes].numpy(), item.dtype, item.shape, order), item,
                      casting="no")
        return (_ARRAY, offset, nbytes, item.dtype, item.shape, order)
    source = item
    layout = None
    if source.is_contiguous():  # (torch's copy_ costs more in dispatch than 64 KB take to move)
        ctypes.memmove(dest.data_ptr() + offset, source.data_ptr(), nbytes)
    else:
        source = item.detach()  # (only copy_ needs it: detach costs more than a small item's copy)
        layout = dense_order(source)  # a channels-last or transposed tensor keeps its layout
        if layout is not None:
            source = source.permute(layout)
        dest[offset:offset + nbytes].view(item.dtype).view(source.shape).copy_(source)
    return (_TENSOR, offset, nbytes, item.dtype, tuple(source.shape), item.requires_grad,
            type(item) is torch.nn.Parameter, layout)


_TENSOR, _ARRAY = 0, 1


# ------------------------------------------------------------------------- receiver
# Bytes of peers' packed segments that items received here still view. Past half this
# process's mapping bound (shm_cache_bytes), a message's items are copied out instead,
# which frees its segment at once: a receiver that keeps a few items of every message
# (a filtered replay buffer) pins at most that much, whatever the number of senders, and
# a sender with the same setting keeps half its segments for its next messages.
_pinned = 0
_pinned_lock = threading.Lock()


def _unpin(nbytes: int) -> None:
    global _pinned
    with _pinned_lock:
        _pinned -= nbytes


def _load_pack(pid: int, fd: int, inode: int, capacity: int, table: List[Tuple[Any, ...]],
               claim: int = 0) -> List[Item]:
    """Every item of a packed message: views into the segment (it goes back to its owner
    once they all died), or past the pinning bound copies (it goes back now); ``claim``:
    see ``_receive.lent_array``."""
    global _pinned
    base = _receive.lent_array(pid, fd, inode, capacity, capacity, claim)  # FREE once it dies
    with _pinned_lock:
        view = _pinned + capacity <= _receive.limit() // 2
        if view:
            _pinned += capacity
    if view:
        weakref.finalize(base, _unpin, capacity)
        return [_view(base, entry) for entry in table]
    start = base.ctypes.data
    return [_copy_out(start, entry) for entry in table]


def _load_small(count: int, stacks: List[Stack], data: bytes, table: List[Tuple[Any, ...]],
                rest: List[int]) -> List[Item]:
    """Every item of a message's bundle of small ones, each copied out: the stacked ones
    from their stacks, the rest out of ``data``."""
    out: List[Any] = [None] * count
    unstack(stacks, out)
    if rest:
        start = np.frombuffer(data, dtype=np.uint8).ctypes.data
        for position, entry in zip(rest, table):
            out[position] = _copy_out(start, entry)
    return out


def _view(base: np.ndarray, entry: Tuple[Any, ...]) -> Item:
    kind, offset, nbytes = entry[0], entry[1], entry[2]
    data = base[offset:offset + nbytes]
    if kind == _ARRAY:
        dtype, shape, order = entry[3:]
        return array_over(data, dtype, shape, order)
    dtype, shape, requires_grad, parameter, order = entry[3:]
    return finish(undo_order(torch.from_numpy(data).view(dtype).view(shape), order), requires_grad, parameter)


def _copy_out(start: int, entry: Tuple[Any, ...]) -> Item:
    kind, offset, nbytes = entry[0], entry[1], entry[2]
    if kind == _ARRAY:
        dtype, shape, order = entry[3:]
        array = np.empty(shape, dtype=dtype, order=order)
        ctypes.memmove(array.ctypes.data, start + offset, nbytes)
        return array
    dtype, shape, requires_grad, parameter, order = entry[3:]
    tensor = torch.empty(shape, dtype=dtype)
    ctypes.memmove(tensor.data_ptr(), start + offset, nbytes)
    return finish(undo_order(tensor, order), requires_grad, parameter)


def finish(tensor: torch.Tensor, requires_grad: bool, parameter: bool) -> torch.Tensor:
    """A received tensor as its sender had it: a Parameter, or requiring grad, or plain."""
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(True) if requires_grad else tensor


def _after_fork_in_child() -> None:
    global _pinned, _pinned_lock
    _pinned_lock = threading.Lock()
    _pinned = 0


os.register_at_fork(after_in_child=_after_fork_in_child)
