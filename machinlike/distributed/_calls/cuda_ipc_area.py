"""The two caches of the CUDA IPC path: the sender's export slabs and the receiver's openings.

Sender (``ExportArea``, one per process): long-lived ``uint8`` CUDA buffers ("slabs"),
exported once each through torch's ``_share_cuda_``, lent to one message at a time. A
lease's state lives in a small ``memfd`` control page that receivers map too::

    control page (memfd, 128 slots x 4 int64)     slab (cuda:i, capacity bytes)
    slot s: [state, taker pid, slab id, 0]        exported once: (handle, offset in its
      state = FREE (0) or the lease id             allocator segment); never freed while
      slab id = RETIRED (-1) once dropped           the area lives, so torch's limbo never
                                                    holds it (see ``_retire``)
    lease(device, nbytes, taker):
      a FREE slab that fits ─► state = lease id, taker = the receiver's pid
      none: reclaim slabs whose taker died; wait (10 ms at most) for one lent to the
      same taker to come FREE; then allocate (bounded by ``limit``), then evict FREE
      slabs; still none ─► None (the caller stages through the CPU)
    the copies into the slab are queued ─► its IPC event ``ready`` is recorded (no wait)
    the receiver's copies out are done ─► state = FREE (written by the receiver's releaser
      thread, ``cuda_ipc_release``)

Why a control page and not a reply from the receiver: a request's slabs could be freed
when the reply arrives, but a reply's slabs have no later message to free them; the CPU
path (``machinlike._shm``) solves the same with a state word in each segment's header,
written by the receiver. This is that word, for memory the receiver cannot write to
cheaply from the CPU.

Receiver (``OpenCache``): opening a handle costs milliseconds, so an opened slab is kept,
keyed by ``(owner pid, handle, offset)``, bounded by ``limit`` bytes of slab capacity
(least recently used goes first). Before each new opening it forgets slabs whose owner
died or retired them (so that a retired slab's handle is closed before new memory behind
the same handle bytes is opened), and so does a member's departure. An opening holds no reference count of torch's (``_NO_COUNTER``): the
owner decides when a slab is gone (it retires it), and a receiver that is SIGKILLed
leaves no count behind that would pin the owner's memory forever.

Limits: a lease whose message is lost while its receiver lives (the caller timed out
before the callee read it) stays lent until the receiver dies or the area closes; the
area counts it in ``stats`` as ``lent``.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..._shm._peer_fd import open_peer_fd
from ..._shm._segments import pid_alive

__all__ = ["FREE", "RETIRED", "SLOTS", "Slab", "Lease", "ExportArea", "Opened", "OpenCache", "slab_capacity"]

FREE = 0
RETIRED = -1
SLOTS = 128
_WORDS = 4
_PAGE = SLOTS * _WORDS * 8
_REUSE_WAIT_S = 0.010  # a sender waits this long at most for its taker's last slab (see ``lease``)
_GRAIN = 2 << 20  # slabs hold whole powers of two from 2 MiB: they recycle well
_NO_COUNTER = b"/machinlike-cuda-ipc-no-counter"  # a torch ref-counter file that never exists
_NO_EVENT = bytes(64)  # CUDA_IPC_HANDLE_SIZE; torch's own event is unused: the slab has its own


def slab_capacity(nbytes: int) -> int:
    """The capacity, in bytes, of a slab for ``nbytes``: a power of two, at least 2 MiB."""
    capacity = _GRAIN
    while capacity < nbytes:
        capacity <<= 1
    return capacity


class Slab:
    """One exported CUDA buffer of the area; ``views``: tensors over it by layout, made
    once (``cuda_ipc_ops.view``: a message's Python work is a few torch calls, not a dozen);
    ``ready``: an interprocess event recorded after each message's copies into it (its
    handle ``ready_handle`` goes with the message; None and b"" where this torch or
    driver has no IPC events: the sender synchronises before sending instead)."""

    __slots__ = ("slot", "ident", "index", "storage", "capacity", "handle", "offset", "counter", "views",
                 "ready", "ready_handle")

    def __init__(self, slot: int, ident: int, index: int, capacity: int) -> None:
        self.slot = slot
        self.ident = ident
        self.index = index
        self.capacity = capacity
        self.storage = torch.empty(capacity, dtype=torch.uint8, device=torch.device("cuda", index)).untyped_storage()
        # Torch internal, absent from its stubs. Called once per slab: each call wraps the
        # storage's memory in one more reference-counted context.
        shared = self.storage._share_cuda_()
        self.handle: bytes = shared[1]
        self.offset: int = shared[3]
        self.counter: Tuple[bytes, int] = (shared[4], shared[5])
        self.views: Dict[Any, torch.Tensor] = {}
        self.ready: Optional[torch.cuda.Event] = None
        self.ready_handle = b""
        try:
            with torch.cuda.device(index):  # (an event not yet recorded takes the current device)
                event = torch.cuda.Event(interprocess=True)
                self.ready_handle = event.ipc_handle()
            self.ready = event
        except Exception:  # no IPC events here (ready stays None): the sender synchronises instead
            pass


class Lease:
    """A slab lent to one message."""

    __slots__ = ("slab", "ident")

    def __init__(self, slab: Slab, ident: int) -> None:
        self.slab = slab
        self.ident = ident


class ExportArea:
    """This process's export slabs and their control page (see the module docstring).

    Args:
        limit: Bytes of slab capacity held at most, all devices together; 0: none.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._fd = os.memfd_create("machinlike-cuda-ipc", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, _PAGE)
        self._map = mmap.mmap(self._fd, _PAGE, flags=mmap.MAP_SHARED)
        self.words = np.frombuffer(self._map, dtype=np.int64).reshape(SLOTS, _WORDS)
        self.inode = os.fstat(self._fd).st_ino
        self._slabs: List[Slab] = []
        self._held = 0
        self._ids = itertools.count(1)
        self.reuse_wait = _REUSE_WAIT_S
        # Every counter exists from the start: stats() reads the dict without the lock.
        self.stats: Dict[str, int] = {"slabs_made": 0, "slabs_retired": 0, "reclaimed": 0, "no_room": 0,
                                      "reuse_waits": 0, "unsent_released": 0, "counter_release_failed": 0}

    @property
    def fd(self) -> int:
        return self._fd

    def held_bytes(self) -> int:
        return self._held

    def lent(self) -> int:
        """Slabs lent now (a lease whose receiver neither freed it nor died: those of
        dead receivers are taken back first)."""
        with self._lock:
            self._reclaim()
            return sum(1 for slab in self._slabs if self.words[slab.slot, 0] != FREE)

    def lease(self, index: int, nbytes: int, taker: int) -> Optional[Lease]:
        """A slab of ``cuda:index`` for ``nbytes``, lent to process ``taker``; None: no room.

        With no FREE slab that fits but one lent to ``taker`` itself (its receiver's copies
        out of the last message are ending: the receiver frees each lease once they ran,
        ``cuda_ipc_release``), waits ``reuse_wait`` seconds at most for it before making a
        new slab: a new slab costs the receiver milliseconds to open, and memory.

        Raises:
            RuntimeError: (from torch) the slab could not be allocated or exported.
        """
        capacity = slab_capacity(nbytes)
        deadline = 0.0
        spins = 0
        while True:
            with self._lock:
                slab = self._free_slab(index, nbytes)
                if slab is None and not spins and self._reclaim():
                    slab = self._free_slab(index, nbytes)
                if slab is None and (spins and time.monotonic() >= deadline or not self._lent_to(taker, index, nbytes)):
                    slab = self._new_slab(index, capacity)
                    if slab is None:
                        self.stats["no_room"] += 1
                        return None
                if slab is not None:
                    ident = next(self._ids)
                    row = self.words[slab.slot]
                    row[1] = taker
                    row[0] = ident  # last: the receiver checks the state, then reads
                    return Lease(slab, ident)
            if not spins:
                deadline = time.monotonic() + self.reuse_wait
                self.stats["reuse_waits"] += 1
            spins += 1
            time.sleep(0 if spins < 32 else 50e-6)  # (outside the lock; the GIL goes to other threads)

    def _lent_to(self, taker: int, index: int, nbytes: int) -> bool:
        return any(slab.index == index and slab.capacity >= nbytes and self.words[slab.slot, 0] != FREE
                   and self.words[slab.slot, 1] == taker for slab in self._slabs)

    def release(self, lease: Lease) -> None:
        """End ``lease`` from this side (its message never left, or was refused)."""
        with self._lock:
            if self.words[lease.slab.slot, 0] == lease.ident:
                self.words[lease.slab.slot, 0] = FREE

    def release_unsent(self, lease: Lease) -> None:
        """:meth:`release` for a message that was never pickled whole, from a garbage
        collection (``_shm.guard``): takes no lock, as the collection may have interrupted
        this very area under it. Nothing else writes a lent slab its receiver never took
        (``lease`` only picks FREE ones; a closed area's slabs are retired)."""
        row = self.words[lease.slab.slot]
        if row[0] == lease.ident:
            row[0] = FREE
            self.stats["unsent_released"] += 1

    def _lent_to_the_living(self) -> bool:
        with self._lock:
            rows = [self.words[slab.slot] for slab in self._slabs]
        return any(row[0] != FREE and pid_alive(int(row[1])) for row in rows)

    def _free_slab(self, index: int, nbytes: int) -> Optional[Slab]:
        best: Optional[Slab] = None
        for slab in self._slabs:
            if slab.index == index and slab.capacity >= nbytes and self.words[slab.slot, 0] == FREE \
                    and (best is None or slab.capacity < best.capacity):
                best = slab
        return best

    def _reclaim(self) -> bool:
        found = False
        for slab in self._slabs:
            row = self.words[slab.slot]
            if row[0] != FREE and not pid_alive(int(row[1])):
                row[0] = FREE  # its receiver died: nobody reads it any more
                self.stats["reclaimed"] += 1
                found = True
        return found

    def _new_slab(self, index: int, capacity: int) -> Optional[Slab]:
        if capacity > self.limit:
            return None
        while self._held + capacity > self.limit:
            free = [slab for slab in self._slabs if self.words[slab.slot, 0] == FREE]
            if not free:
                return None
            self._retire(min(free, key=lambda slab: slab.capacity))
        used = {slab.slot for slab in self._slabs}
        slot = next((s for s in range(SLOTS) if s not in used), None)
        if slot is None:
            free = [slab for slab in self._slabs if self.words[slab.slot, 0] == FREE]
            if not free:
                return None
            victim = min(free, key=lambda slab: slab.capacity)
            slot = victim.slot
            self._retire(victim)
        ident = next(self._ids)
        slab = Slab(slot, ident, index, capacity)
        self.words[slot] = (FREE, 0, ident, 0)
        self._slabs.append(slab)
        self._held += capacity
        self.stats["slabs_made"] += 1
        return slab

    def _retire(self, slab: Slab) -> None:
        self.words[slab.slot, 2] = RETIRED  # receivers drop their opening at their next trim
        self._slabs.remove(slab)
        self._held -= slab.capacity
        self.stats["slabs_retired"] += 1
        # torch counted the one export as one reader (counter 1) and parks freed memory
        # with a count above 0 in its limbo. No receiver counts (they open with
        # _NO_COUNTER), so this one release lets the memory go back to the allocator now.
        try:
            torch.UntypedStorage._release_ipc_counter_cuda(*slab.counter)
        except Exception:  # best effort, as torch's own consumers do
            self.stats["counter_release_failed"] += 1
        slab.storage = None  # type: ignore[assignment]
        slab.views = {}  # (they hold the storage too)
        slab.ready = None  # receivers check the slab's id before they ask its event

    def close(self, wait: float = 0.0) -> None:
        """Retire every slab (receivers drop their openings) and close the control page;
        first wait, ``wait`` seconds at most, for slabs lent to live receivers to come FREE
        (one may still be copying out of it: its memory must not go back to the allocator
        nor its event be destroyed under those copies). Raises nothing."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and self._lent_to_the_living():
            time.sleep(0.001)  # (only at a World's stop: receivers write the page, no wake-up)
        with self._lock:
            for slab in list(self._slabs):
                self._retire(slab)
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = -1


# ------------------------------------------------------------------------ receiver
Key = Tuple[int, bytes, int]


class Opened:
    """A peer's slab opened here; ``views``: tensors over it by layout (as ``Slab.views``);
    ``ready``: the slab's event, opened at the first message that names it; ``done``: this
    process's event recorded after each message's copies out (both None until then)."""

    __slots__ = ("storage", "capacity", "words", "slot", "ident", "views", "ready", "done")

    def __init__(self, storage: Any, capacity: int, words: np.ndarray, slot: int, ident: int) -> None:
        self.storage = storage
        self.capacity = capacity
        self.words = words
        self.slot = slot
        self.ident = ident
        self.views: Dict[Any, torch.Tensor] = {}
        self.ready: Any = None
        self.done: Any = None

    def retired(self) -> bool:
        return int(self.words[self.slot, 2]) != self.ident


Opener = Callable[[], Any]


class OpenCache:
    """Peers' slabs opened here, and their control pages (see the module docstring).

    Args:
        limit: Bytes of opened slab capacity kept between transfers.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._opened: "OrderedDict[Key, Opened]" = OrderedDict()
        self._controls: Dict[Tuple[int, int], Tuple[mmap.mmap, np.ndarray]] = {}
        self._held = 0
        self.stats: Dict[str, int] = {"opened": 0, "evicted": 0, "dropped_dead_or_retired": 0}

    def held_bytes(self) -> int:
        return self._held

    def __len__(self) -> int:
        return len(self._opened)

    def control(self, pid: int, fd: int, inode: int) -> np.ndarray:
        """The control page of process ``pid`` (mapped once).

        Raises:
            RuntimeError: the sender is gone or closed its area (named).
        """
        key = (pid, inode)
        with self._lock:
            found = self._controls.get(key)
            if found is not None:
                return found[1]
        handle = open_peer_fd(pid, fd, inode, "the CUDA export area")
        try:
            mapped = mmap.mmap(handle, _PAGE, flags=mmap.MAP_SHARED)
        finally:
            os.close(handle)
        words = np.frombuffer(mapped, dtype=np.int64).reshape(SLOTS, _WORDS)
        with self._lock:
            self._controls.setdefault(key, (mapped, words))
            return self._controls[key][1]

    def open(self, key: Key, capacity: int, words: np.ndarray, slot: int, ident: int, opener: Opener) -> Opened:
        """The opened slab ``key`` (``opener()`` opens its storage when not cached)."""
        with self._lock:
            found = self._opened.get(key)
            if found is not None and found.ident == ident and not found.retired():
                self._opened.move_to_end(key)
                return found
            # First: a retired slab's handle must be closed before a slab that took its
            # place is opened (torch finds an open handle by its bytes, and the memory
            # behind equal bytes may be new).
            self._drop_gone()
        opened = Opened(opener(), capacity, words, slot, ident)
        with self._lock:
            old = self._opened.pop(key, None)
            if old is not None:
                self._held -= old.capacity
            self._opened[key] = opened
            self._held += capacity
            self.stats["opened"] += 1
            while self._held > self.limit and len(self._opened) > 1:
                self._drop(next(iter(self._opened)))
                self.stats["evicted"] += 1
        return opened

    def _drop_gone(self) -> None:
        for key, opened in list(self._opened.items()):
            if opened.retired() or not pid_alive(key[0]):
                self._drop(key)
                self.stats["dropped_dead_or_retired"] += 1
        live = {opened_key[0] for opened_key in self._opened}
        for control in [k for k in self._controls if k[0] not in live and not pid_alive(k[0])]:
            del self._controls[control]

    def _drop(self, key: Key) -> None:
        opened = self._opened.pop(key)
        self._held -= opened.capacity
        # Dropping the last storage of a handle closes it (torch's IPC handle cache).

    def forget_dead(self) -> int:
        """Drop what dead or retired owners left here; returns how many openings went."""
        with self._lock:
            before = len(self._opened)
            self._drop_gone()
            return before - len(self._opened)

    def forget_all(self) -> None:
        """Drop every opening and control page (World stop)."""
        with self._lock:
            self._opened.clear()
            self._controls.clear()
            self._held = 0
