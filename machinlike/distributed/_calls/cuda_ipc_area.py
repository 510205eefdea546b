"""The sender's cache of the CUDA IPC path: this process's export slabs, lent to messages.

``ExportArea`` (one per process): long-lived ``uint8`` CUDA buffers ("slabs"), exported
once each through torch's ``_share_cuda_``. A slab is lent either to one message at a
time, or, pinned to hold an immutable state (a model server's version, ``pin``), to every
message that sends that state at once, each through a reader row. Leases live in a small
``memfd`` control page that receivers map too::

    control page (memfd, ROWS x 4 int64)          slab (cuda:i, capacity bytes)
    slab row s < SLOTS: [state, taker pid,         exported once: (handle, offset in its
      slab id, UNSETTLED?]                          allocator segment); never freed while
      state = FREE (0), a lease id, or PINNED       the area lives, so torch's limbo never
      slab id = RETIRED (-1) once dropped           holds it (see ``_retire``)
    reader row r >= SLOTS: [state, taker pid,
      slab row, slab id]  (a pinned slab's readers)

    lease(device, nbytes, taker):
      a FREE slab that fits ─► state = lease id, taker = the receiver's pid (which the
        receiver rewrites as its identity, pid and start time, when it loads the message:
        ``machinlike._pids``; a pid reused after it died is not it)
      none: reclaim slabs whose taker died; wait (10 ms at most) for one lent to the
      same taker to come FREE; then allocate (bounded by ``limit``), then evict FREE
      slabs; still none ─► None (the caller stages through the CPU)
    share(pinned slab, taker): a FREE reader row ─► [lease id, taker, slab row, slab id]
    the copies into the slab are queued ─► its IPC event ``ready`` is recorded (no wait)
    the receiver's copies out are done ─► the lease's row: state = FREE (written by the
      receiver's releaser thread, ``cuda_ipc_release``)
    a lease ended before the copies into its slab were seen to run (a receiver that could
      not open or wait for them; this side's ``release``) ─► the slab's next writer orders
      its copies after them first (``UNSETTLED`` in its row, or ``Slab.unsent``): they may
      still be queued, on another thread's stream
    retire (evicted for room, unpinned and read by nobody, or at close): a slab an early-
      ended message or a push may still write waits for those copies, 1 s at most under
      the lock; still written (a stuck device) ─► retired, but its memory kept and counted
      (``settle_timed_out``) until they ran, checked at each reclaim (``cuda_ipc_parked``)
    close(wait) ─► nothing more lent; slabs lent to live receivers (or being written)
      after ``wait`` outlive the area; the rest retire ─► ``sweep`` retires the outlived
      once FREE or their receiver died, then closes the page

Why a control page and not a reply from the receiver: a request's slabs could be freed
when the reply arrives, but a reply's slabs have no later message to free them; the CPU
path (``machinlike._shm``) solves the same with a state word in each segment's header,
written by the receiver. This is that word, for memory the receiver cannot write to
cheaply from the CPU. Why pinned slabs: a model server's pulls would each copy the same
version into a slab of their own, one slab per pull in flight (session 44 on an H200: 23
slabs of 64 MB for 20 pullers); read in place, the server's memory is its versions.

The receiver's half (openings of peers' slabs, cached): ``cuda_ipc_open``.

Limits: a lease whose message is lost while its receiver lives stays lent until the
receiver dies (past the area's ``close`` too: its slab outlives the area until ``sweep``
finds it ended; counted in ``stats`` as ``lent``, then ``outlived``), except a reply's: one
carried by torch RPC, made just before its caller's deadline and arriving after it, is
dropped unread, and is abandoned ``_shm.ABANDON_AFTER_S`` after that deadline when still
untaken, under a claim its receiver takes it by (``cuda_ipc_claim``; counted as
``abandoned``). One made after the deadline is staged (``_shm.overdue``); the lane loads a
late reply and drops it, which ends its leases. Reader rows are ``ROWS - SLOTS``; a state
sent while all are taken is copied into a slab of its own, as any other.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..._pids import pid_alive, pid_of
from .cuda_ipc_claim import Claims
from .cuda_ipc_lease import Lease
from .cuda_ipc_parked import Parked
from .cuda_ipc_slab import GRAIN, Slab, slab_capacity

__all__ = ["FREE", "RETIRED", "PINNED", "UNSETTLED", "SLOTS", "ROWS", "WORDS", "PAGE_BYTES", "Lease",
           "ExportArea"]

FREE = 0
RETIRED = -1
PINNED = -2  # a slab row's state while it holds a state read in place (``ExportArea.pin``)
UNSETTLED = 1  # a slab row's last word: a receiver freed its lease before the copies in were seen to run
SLOTS = 128  # slab rows
ROWS = 1024  # slab rows, then reader rows
WORDS = 4
PAGE_BYTES = ROWS * WORDS * 8
_REUSE_WAIT_S = 0.010  # a sender waits this long at most for its taker's last slab (see ``lease``)
_RETIRE_WAIT_S = 1.0  # (milliseconds as a rule: the copies of one message)


class ExportArea:
    """This process's export slabs and their control page (see the module docstring).

    Args:
        limit: Bytes of slab capacity held at most, all devices together; 0: none.
        outside: Bytes held within ``limit`` by others (closed areas' slabs still lent,
            ``cuda_ipc_outliving``); None: none.
    """

    def __init__(self, limit: int, outside: Optional[Callable[[], int]] = None) -> None:
        self.limit = limit
        self._outside = outside or (lambda: 0)
        self._lock = threading.Lock()
        self._fd = os.memfd_create("machinlike-cuda-ipc", os.MFD_CLOEXEC)
        os.ftruncate(self._fd, PAGE_BYTES)
        self._map = mmap.mmap(self._fd, PAGE_BYTES, flags=mmap.MAP_SHARED)
        self.words = np.frombuffer(self._map, dtype=np.int64).reshape(ROWS, WORDS)
        self._readers = self.words[SLOTS:]  # (a view: reader rows)
        self.inode = os.fstat(self._fd).st_ino
        self._slabs: List[Slab] = []
        self._pinned: Dict[int, Slab] = {}  # by the storage's address: slabs holding states read in place
        self._draining: List[Slab] = []  # unpinned while read: retired once their readers are done
        # Slots of slabs leased and still being written by their sender (``lease`` to
        # ``filled``): never reclaimed meanwhile, even if their taker died. Reclaimed, a
        # slab could be leased again and written by a second message while the first one's
        # copies were still being queued into it, under the second one's live receiver.
        # By slot: the lease id writing it (a late ``filled`` of an earlier lease of the
        # same slot, ended and lent again meanwhile, must not clear its successor's mark).
        self._filling: Dict[int, int] = {}
        self._closed = False  # (``close`` began: nothing more is lent, made or pinned)
        self._held = 0
        self._ids = itertools.count(1)
        self.reuse_wait = _REUSE_WAIT_S
        # Seconds a retire waits at most, under the lock, for copies still queued into the
        # slab; past it the slab is parked (retired, its memory kept until they ran).
        self.retire_wait = _RETIRE_WAIT_S
        # Every counter exists from the start: stats() reads the dict without the lock.
        self.stats: Dict[str, int] = {"slabs_made": 0, "slabs_retired": 0, "reclaimed": 0, "no_room": 0,
                                      "reuse_waits": 0, "unsent_released": 0, "counter_release_failed": 0,
                                      "retire_waits": 0, "pinned": 0, "shared": 0, "no_reader_row": 0,
                                      "settle_failed": 0, "settle_timed_out": 0, "outlived": 0,
                                      "ended_at_close": 0, "abandoned": 0}
        self._parked = Parked(self.stats)  # retired slabs whose memory waits for copies still queued
        self._claims = Claims(self.stats)  # reply leases abandoned once their caller gave up on them

    @property
    def fd(self) -> int:
        return self._fd

    def held_bytes(self) -> int:
        return self._held

    def lent(self) -> int:
        """Leases held now: slabs lent, and reader rows of pinned slabs (a lease whose
        receiver neither freed it nor died: those of dead receivers are taken back first)."""
        with self._lock:
            self._reclaim()
            return sum(1 for slab in self._slabs if self.words[slab.slot, 0] > FREE) + self._reading()

    def lease(self, index: int, nbytes: int, taker: int, give_up: float = 0.0) -> Optional[Lease]:
        """A slab of ``cuda:index`` for ``nbytes``, lent to process ``taker``; None: no room.
        ``give_up``: when the lease is abandoned if still untaken (``time.monotonic()`` s,
        a reply's: ``cuda_ipc_claim``); 0: never.

        With no FREE slab that fits but one lent to ``taker`` itself (its receiver's copies
        out of the last message are ending: the receiver frees each lease once they ran,
        ``cuda_ipc_release``), waits ``reuse_wait`` seconds at most for it before making a
        new slab: a new slab costs the receiver milliseconds to open, and memory.

        Raises:
            RuntimeError: the area is closed (its World stopped), or (from torch) the slab
                could not be allocated or exported.
        """
        capacity = slab_capacity(nbytes)
        deadline = 0.0
        spins = 0
        while True:
            with self._lock:
                self._refuse_closed()
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
                    self._filling[slab.slot] = ident  # (until ``filled``: not reclaimed under its writer)
                    self._claims.note(slab.slot, ident, taker, give_up)
                    return Lease(self, slab, ident, give_up=give_up)
            if not spins:
                deadline = time.monotonic() + self.reuse_wait
                self.stats["reuse_waits"] += 1
            spins += 1
            time.sleep(0 if spins < 32 else 50e-6)  # (outside the lock; the GIL goes to other threads)

    def _lent_to(self, taker: int, index: int, nbytes: int) -> bool:
        return any(slab.index == index and slab.capacity >= nbytes and self.words[slab.slot, 0] > FREE
                   and pid_of(int(self.words[slab.slot, 1])) == taker for slab in self._slabs)

    def _refuse_closed(self) -> None:
        if self._closed:
            raise RuntimeError("this process's CUDA IPC export area is closed (its World stopped): "
                               "nothing more is lent from it")

    def holds(self, lease: Lease) -> bool:
        """Whether ``lease`` is still lent (its receiver neither ended it nor died)."""
        with self._lock:
            self._reclaim()
            return lease.slab.storage is not None and self.words[lease.row, 0] == lease.ident

    def filled(self, lease: Lease) -> None:
        """The sender is done writing ``lease``'s slab (its copies queued, or given up): a
        lease of a dead taker may be reclaimed again. In an area closed meanwhile, the
        lease ends here (its message leaves a World that is stopping: most likely nobody
        reads it, and a lease nobody ends would hold the slab until its receiver died; one
        that does read it is told the lease ended) and the slab retires at the next ``sweep``."""
        with self._lock:
            if self._filling.get(lease.slab.slot) == lease.ident:
                del self._filling[lease.slab.slot]
            if self._closed and self.words[lease.row, 0] == lease.ident:
                lease.slab.unsent = True  # (its copies may be queued: retiring it waits for them)
                self.words[lease.row, 0] = FREE
                self.stats["ended_at_close"] += 1

    def release(self, *leases: Lease) -> None:
        """End ``leases`` from this side (their message never left, or was refused: its
        copies may still be queued, so each slab's next writer waits for them)."""
        with self._lock:
            for lease in leases:
                if self.words[lease.row, 0] == lease.ident:
                    if lease.row < SLOTS:  # (a reader row of a pinned slab: nothing was written into it)
                        lease.slab.unsent = True
                    self.words[lease.row, 0] = FREE

    def unsettled(self, slab: Slab) -> bool:
        """Whether ``slab``, just leased, may still have copies queued into it by an earlier
        message whose lease ended early (see the module docstring); clears the mark."""
        row = self.words[slab.slot]
        if not (slab.unsent or row[3]):
            return False
        slab.unsent = False
        row[3] = 0
        return True

    def release_unsent(self, lease: Lease) -> None:
        """:meth:`release` for a message that was never pickled whole, from a garbage
        collection (``_shm.guard``): takes no lock, as the collection may have interrupted
        this very area under it. Nothing else writes a lent slab its receiver never took
        (``lease`` only picks FREE ones; a closed area lends nothing)."""
        row = self.words[lease.row]
        if row[0] == lease.ident:
            if lease.row < SLOTS:  # (a reader row of a pinned slab: nothing was written into it)
                lease.slab.unsent = True  # (before FREE: whoever leases it next sees it)
            row[0] = FREE
            self.stats["unsent_released"] += 1

    # ------------------------------------------------------------ pinned slabs
    def pin(self, index: int, nbytes: int) -> Optional[Slab]:
        """A slab of ``cuda:index`` of at least ``nbytes``, pinned to hold a state that is
        read in place (``share``) until ``unpin``; None: no room (pinned slabs hold half
        of ``limit`` and half of the slab rows at most). The
        caller writes it, then records its ``ready`` (or synchronises where it has none).

        Raises:
            RuntimeError: the area is closed (its World stopped), or (from torch) the slab
                could not be allocated or exported.
        """
        capacity = -(-max(nbytes, 1) // GRAIN) * GRAIN
        with self._lock:
            self._refuse_closed()
            self._reclaim()
            # Pinned slabs are never evicted: they may take half the area (its bytes and its
            # slab rows), so that messages always find room for slabs of their own.
            pinned = sum(slab.capacity for slab in self._pinned.values()) + sum(s.capacity for s in self._draining)
            room = pinned + capacity <= self.limit // 2 and len(self._pinned) + len(self._draining) < SLOTS // 2
            slab = self._new_slab(index, capacity) if room else None
            if slab is None:
                self.stats["no_room"] += 1
                return None
            self.words[slab.slot, 1] = os.getpid()
            self.words[slab.slot, 0] = PINNED
            self._pinned[slab.storage.data_ptr()] = slab
            self.stats["pinned"] += 1
            return slab

    def share(self, slab: Slab, taker: int, give_up: float = 0.0) -> Optional[Lease]:
        """A lease of pinned ``slab`` for process ``taker``, through a reader row (``give_up``:
        as ``lease``'s); None: the slab is no longer pinned (or the area is closed), or every
        reader row is taken (counted: ``no_reader_row``)."""
        with self._lock:
            if self._closed or slab.storage is None or self._pinned.get(slab.storage.data_ptr()) is not slab:  # (None: retired)
                return None
            free = np.flatnonzero(self._readers[:, 0] == FREE)
            if not len(free):
                self._reclaim()
                free = np.flatnonzero(self._readers[:, 0] == FREE)
                if not len(free):
                    self.stats["no_reader_row"] += 1
                    return None
            r = int(free[0])
            ident = next(self._ids)
            row = self._readers[r]
            row[1], row[2], row[3] = taker, slab.slot, slab.ident
            row[0] = ident  # last: the receiver checks the state, then reads
            self.stats["shared"] += 1
            self._claims.note(SLOTS + r, ident, taker, give_up)
            return Lease(self, slab, ident, SLOTS + r, give_up)

    def in_place(self, tensors: List[torch.Tensor], taker: int,
                 give_up: float = 0.0) -> Optional[Tuple[Lease, List[int]]]:
        """A lease for process ``taker`` of the pinned slab all of ``tensors`` lie in
        (contiguous), and each one's byte offset there; None: they do not, or no reader
        row is free (the caller copies them into a slab of their own)."""
        if not self._pinned:
            return None
        slab = self._pinned.get(tensors[0].untyped_storage().data_ptr())
        if slab is None or any(t.untyped_storage().data_ptr() != slab.storage.data_ptr() or not t.is_contiguous()
                               for t in tensors):
            return None
        lease = self.share(slab, taker, give_up)
        return None if lease is None else (lease, [int(t.storage_offset()) * t.element_size() for t in tensors])

    def pinned_among(self, tensors: List[torch.Tensor]) -> bool:
        """Whether any of ``tensors`` views a slab pinned now or being unpinned."""
        if not (self._pinned or self._draining):
            return False
        with self._lock:
            held = set(self._pinned) | {slab.storage.data_ptr() for slab in self._draining if slab.storage is not None}
        return any(tensor.untyped_storage().data_ptr() in held for tensor in tensors)

    def readers(self, slab: Slab) -> int:
        """Live readers of ``slab`` now (those of dead receivers are taken back first)."""
        with self._lock:
            self._reclaim()
            return self._read(slab)

    def unpin(self, slab: Slab) -> None:
        """End ``pin``: the slab is retired once its readers are done (never lent again:
        tensors may still view it)."""
        with self._lock:
            if slab.storage is None or self._pinned.pop(slab.storage.data_ptr(), None) is not slab:  # (retired)
                return
            self._draining.append(slab)
            self._reclaim()

    def _read(self, slab: Slab) -> int:
        rows = self._readers
        return int(np.count_nonzero((rows[:, 0] != FREE) & (rows[:, 2] == slab.slot) & (rows[:, 3] == slab.ident)))

    def _reading(self) -> int:
        return int(np.count_nonzero(self._readers[:, 0] != FREE))

    def _lent_to_the_living(self) -> bool:
        with self._lock:
            rows = [self.words[slab.slot] for slab in self._slabs]
            rows += [self._readers[r] for r in np.flatnonzero(self._readers[:, 0] != FREE)]
        return any(row[0] > FREE and pid_alive(int(row[1])) for row in rows)

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
            if row[0] > FREE and slab.slot not in self._filling and not pid_alive(int(row[1])):
                slab.unsent = True  # (it may have died before this side's copies in ran: the next writer waits)
                row[0] = FREE  # its receiver died: nobody reads it any more
                self.stats["reclaimed"] += 1
                found = True
        for r in np.flatnonzero(self._readers[:, 0] != FREE):
            row = self._readers[r]
            if row[0] != FREE and not pid_alive(int(row[1])):
                row[0] = FREE
                self.stats["reclaimed"] += 1
        if self._claims and self._fd >= 0:
            found = self._claims.abandon(self.words, self._fd, self._filling, self._slabs) or found
        for slab in list(self._draining):
            if not self._read(slab):
                self._retire(slab)  # unpinned, read by nobody now (its states keep their memory)
                found = True
        if self._parked:
            self._held -= self._parked.let_settled_go()
        return found

    def _new_slab(self, index: int, capacity: int) -> Optional[Slab]:
        if capacity > self.limit:
            return None
        if self._parked:
            self._held -= self._parked.let_settled_go()
        outside = self._outside()
        while self._held + outside + capacity > self.limit:
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
        settled = True
        if slab.unsent or self.words[slab.slot, 3] or any(kept is slab for kept in self._pinned.values()):
            # Copies of a message that ended early may still be queued into it, maybe on
            # another thread's stream: freed now, its memory could go to a new tensor of
            # the stream it was made on, and those copies would overwrite that tensor. So
            # may a still-pinned slab's (a World stopped under a push: ``PinnedStates``
            # settles a slab only when it unpins it, and the area's close may come first).
            try:
                settled = slab.settle_writes(self.retire_wait)
            except Exception:  # (a CUDA error is the process's, and shows there: retiring goes on)
                self.stats["settle_failed"] += 1
            self.stats["retire_waits"] += 1
        self.words[slab.slot, 2] = RETIRED  # receivers drop their opening at their next trim
        self._slabs.remove(slab)
        if self._pinned:
            self._pinned = {address: kept for address, kept in self._pinned.items() if kept is not slab}
        if slab in self._draining:
            self._draining.remove(slab)
        self.stats["slabs_retired"] += 1
        self._held -= self._parked.retire(slab, settled)

    def close(self, wait: float = 0.0) -> bool:
        """Stop lending and retire every slab nobody holds; first wait, ``wait`` seconds at
        most, for slabs lent to live receivers to come FREE and for those being written to
        be filled.

        A slab still lent to a live receiver after the wait (it may be copying out of it,
        or its message was lost) outlives the area: its memory going back to the allocator,
        or its event being destroyed, under those copies would hand the receiver another
        tensor's bytes. It retires at a later ``sweep``, once its row came FREE or its
        receiver died; the control page stays open until then (a receiver that had not
        mapped it yet still reads its message, and ends the lease). Returns whether any
        slab outlives. Raises nothing."""
        with self._lock:
            self._closed = True
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and (self._filling or self._lent_to_the_living()):
            time.sleep(0.001)  # (only at a World's stop: receivers write the page, no wake-up)
        outlive = self.sweep()
        if outlive:
            with self._lock:
                self.stats["outlived"] = len(self._slabs)
        return outlive

    def sweep(self, force: bool = False) -> bool:
        """(A closed area) retire the slabs no live receiver, reader or writer holds any
        more (``force``: every one, the interpreter's exit), and close the control page
        once none is left. Returns whether any remain."""
        with self._lock:
            self._reclaim()
            for slab in list(self._slabs):
                row = self.words[slab.slot]
                if force or not (slab.slot in self._filling or row[0] > FREE or self._read(slab)):
                    self._retire(slab)
            self._held -= self._parked.let_settled_go(force)
            if self._slabs or self._parked:
                return True
            if self._fd >= 0:  # (open until now: a receiver still lent a slab may map the page first)
                os.close(self._fd)
                self._fd = -1
            return False
