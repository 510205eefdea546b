"""States kept in pinned slabs of this process's export area, read in place by every
same-host receiver (a model server's versions on its GPU).

Why: each pull of a CUDA model from a server on the same host used to copy the version
into a slab of its own, so the server's GPU memory grew with the pulls in flight (an
H200, session 44: 23 slabs of 64 MB for 20 pullers) and every pull cost the server a
copy. Here a pushed state is copied once into a pinned slab; each pull lends that slab
through a reader row (``ExportArea.share``) and the puller copies out of it::

    adopt(key, tensors on cuda:i)  ─► ring (key, i, bytes): a slab nobody holds (no
                                        state, reply or reader row of a live receiver)
                                        ─► rewrite it (and unpin free ones past _SPARE);
                                        none: fewer than MOST ─► pin one
                                        else ─► None: the state stays as it is
      copy each tensor in, record the slab's event ─► the state's tensors view the slab
    a reply carrying them ─► one reader row per receiver, no copy (``cuda_ipc.Batch``)
    the receiver's copies out done ─► its row FREE; a SIGKILLed receiver's row is
      taken back by its pid, as a lease of any slab

A slab is rewritten only when its storage is referenced by the slab alone (the chain
dropped the version, no reply holds it) and no live receiver reads it, so a reader never
sees a torn state. A reply that copies a pinned state instead (every reader row taken)
waits for that copy before it lets the state go: ``record_stream`` does nothing for
exported memory, and the push that rewrites it may run on another thread's stream.

Memory: a ring grows only while each of its slabs is held, and gives back free slabs past
``_SPARE``, so it holds about as many slabs as versions are kept and read at once (the
chain's two, and those slow readers still copy out of), whatever the number of pullers;
at most MOST a ring, and half of ``cuda_ipc_cache_bytes`` in all (the rest stays for
messages' own slabs).
"""

from __future__ import annotations

import threading
from typing import Dict, Hashable, List, Optional, Tuple

import torch

from ..._shm._recycled import use_count
from . import cuda_ipc as _ipc
from . import cuda_ipc_ops as ops
from .cuda_ipc_area import ExportArea
from .cuda_ipc_slab import Slab

__all__ = ["PinnedStates", "MOST"]

MOST = 16  # slabs a ring at most: past it a version stays unpinned, and its pulls copy it
_SPARE = 2  # free slabs a ring keeps besides the one it writes (more go back to the allocator)
_ALIGN = 512
_RINGS_MAX = 1024

Ring = Tuple[Hashable, int, int]


class _Pinned:
    __slots__ = ("area", "slab", "base")

    def __init__(self, area: ExportArea, slab: Slab) -> None:
        self.area = area
        self.slab = slab
        self.base = use_count(slab.storage)  # held by the slab alone

    def free(self) -> bool:
        storage = self.slab.storage  # (read once: a World's stop may retire the slab meanwhile)
        if storage is None:  # retired: never written again
            return False
        return use_count(storage) <= self.base and self.area.readers(self.slab) == 0


class PinnedStates:
    """Rings of pinned slabs holding states (see the module doc); ``close()`` with the
    state's owner. Nothing is pinned while the CUDA IPC path is off in this process."""

    def __init__(self, most: int = MOST) -> None:
        self.most = most
        self._lock = threading.Lock()
        self._rings: Dict[Ring, List[_Pinned]] = {}  # least recently written first
        self._closed = False

    def adopt(self, key: Hashable, tensors: List[torch.Tensor]) -> Optional[List[torch.Tensor]]:
        """``tensors`` (CUDA, one device) copied into a pinned slab, as tensors viewing it
        (contiguous, same dtypes, shapes and ``requires_grad`` False); None: not pinned
        (the path is off, every slab of the ring is held and it has ``most`` or no room is
        left in half of ``cuda_ipc_cache_bytes``, the slab could not be made, or this was
        closed): keep the tensors as they are.

        Raises:
            RuntimeError: (from torch) the copies failed.
        """
        if not _ipc.enabled() or not tensors:
            return None
        index = tensors[0].device.index
        starts, total = [], 0
        for tensor in tensors:
            starts.append(total)
            total += -(-tensor.nbytes // _ALIGN) * _ALIGN
        with self._lock:  # (a slab is chosen and held by its views before another push looks)
            slab = self._take((key, index, total), index, total)
            storage = None if slab is None else slab.storage  # (a World's stop may retire it meanwhile)
            if slab is None or storage is None:
                return None
            views = [torch.empty(0, dtype=t.dtype, device=t.device).set_(  # type: ignore[call-overload]
                storage, start // t.element_size(), t.shape) for start, t in zip(starts, tensors)]
            events = slab.ready is not None
        if events:  # (``ops`` reads the event once: retired meanwhile, it waits on the device)
            # A rewritten slab's last copies in may still be queued on another thread's
            # stream (its event follows them): these must come after, not race them.
            ops.after_writes(slab)
        for view, tensor in zip(views, tensors):
            view.copy_(tensor.detach())
        ops.copied_here(tensors, index)  # (the caller may let them go at once)
        if events:
            ops.mark_ready(slab)  # receivers read once the copies ran (cuda_ipc_release.await_ready)
        else:
            ops.synchronize(ops.device(index))
        return views

    def _take(self, ring: Ring, index: int, nbytes: int) -> Optional[Slab]:
        if self._closed:  # (a push still running as its server closes: a slab pinned now would
            return None   # stay pinned, its memory and its share of the area held, until World stop)
        try:
            area = _ipc.export_area()
        except RuntimeError:  # the path went off since ``adopt`` looked (a World stopping)
            return None
        pinned = [p for p in self._rings.get(ring, []) if p.area is area]  # (a World restarted: a new area)
        if ring not in self._rings and len(self._rings) >= _RINGS_MAX:
            return None
        self._rings[ring] = pinned
        free = [entry for entry in pinned if entry.free()]
        if free:
            chosen = free[0]  # (the least recently written)
            pinned.remove(chosen)
            pinned.append(chosen)
            for entry in free[1 + _SPARE:]:  # what a burst of slow readers left: back to the allocator
                pinned.remove(entry)
                _unpin(entry)
            return chosen.slab
        if len(pinned) >= self.most:
            return None
        try:
            slab = area.pin(index, nbytes)
        except Exception:  # (out of GPU memory, an export refused, the area closed: pulls copy it)
            return None
        if slab is not None:
            pinned.append(_Pinned(area, slab))
        return slab

    def held(self) -> int:
        """Slabs pinned now, all rings together."""
        with self._lock:
            return sum(len(pinned) for pinned in self._rings.values())

    def close(self) -> None:
        """Unpin every slab: each is retired once its last reader is done (never lent
        again); the states viewing them keep their memory as long as they live."""
        with self._lock:
            rings, self._rings, self._closed = self._rings, {}, True
        for pinned in rings.values():
            for entry in pinned:
                _unpin(entry)


def _unpin(entry: _Pinned) -> None:
    """Unpin ``entry``'s slab once its last copies in ran: they may be queued on another
    thread's stream, and memory back with the allocator goes to that of the stream it was
    made on, whose next tensor those copies would overwrite."""
    if entry.slab.storage is not None and not entry.slab.settle_writes():  # (retired already: settled then)
        entry.slab.unsent = True  # still written (a stuck device): its retire waits again, then keeps the memory
    entry.area.unpin(entry.slab)
