"""The sender's side of same-host transfers: recycled, pre-faulted shared-memory segments.

Why: on this kind of host a fresh 64 MB allocation costs far more than copying into it
(every page is faulted in, and again in each process that maps it), so a copy runs at
memory speed only into memory that is already mapped and faulted. Segments are therefore
made once, kept mapped, and lent out again and again::

    owner (this process)                         receiver (any process, same host)
    --------------------                         ---------------------------------
    lease(nbytes): a FREE segment (or a new one) ─┐
      header.state = lease id, header.taker = 0   │  descriptor: (pid, fd, inode, ...)
      copy the tensor into it                     └─► open /proc/<pid>/fd/<fd>, map it once
      the message was sent and dropped here:          (cached), header.taker = its identity,
        sent_to = (lease id, the receiver)            a tensor over the mapping
    next lease sees state == FREE  ◄───────────────── that tensor dies: header.state = FREE

Segments are ``memfd`` files: they have no name in ``/dev/shm`` and the kernel frees one
when its last descriptor and mapping are gone, so no crash of either end can leak one.
The receiver reaches the descriptor through ``/proc``, which needs the same host, PID
namespace and user (see ``reachable``).

A lease that is never freed (its receiver was SIGKILLed) is reclaimed when the taker's
process is gone; one whose message was never pickled whole comes back when the carrier
drops the message (``_unsent``); one sent to a process that died before taking it (a
caller killed while the service it called ran) when that receiver is gone. The receiver
is noted only once the message was sent and dropped here (``address``), so that a message
still held for a retry is never taken back under it, and with the lease's id, so that a
note that comes late never names the receiver of the segment's next lease. A reply that
came after its call timed out is taken and dropped by the caller's lane; a result made
after its caller's deadline lends nothing (``_terms.overdue``). One made just before it
that torch RPC then drops unread (it arrived just after) is abandoned: a reply's leases
(made under :func:`lending_until`) come back ``ABANDON_AFTER_S`` after the caller's
deadline if still untaken. The receiver of such a lease takes it under a claim that the
owner's abandonment cannot also win (``flock`` on the segment's file, which the two ends
hold through distinct open descriptions)::

    receiver (loading the reply)                owner (a lease or a count of lent ones)
    open /proc/<pid>/fd/<fd>, flock it          past give_up, sent, untaken: flock, non-blocking
      state still this lease? taker = me          (busy: the receiver is taking it; not now)
      else: TimeoutError, the reply is gone       untaken still? state = FREE ("abandoned")
    close (unlocks)                             unlock

So the caller of a reply that did arrive in time but was loaded more than
``ABANDON_AFTER_S`` after its deadline is told (TimeoutError), and a reply nobody will
read no longer stays lent while its caller lives. Bytes held (free and lent) never exceed
``limit``: a lease that would pass it evicts free segments, and fails (None) when that is
not enough; the caller then sends the tensor the ordinary way and ``stats`` counts it.
"""

from __future__ import annotations

import fcntl
import itertools
import logging
import mmap
import os
import threading
import time
from typing import Dict, List, Optional, Set

import numpy as np
import torch

from .._pids import pid_alive, pid_of

__all__ = ["HEADER", "FREE", "RETIRED", "ABANDON_AFTER_S", "Segment", "SegmentCache", "cache", "reachable",
           "lending_until", "lending_give_up"]

log = logging.getLogger(__name__)

#: Bytes before a segment's data: the state word, then the taker's identity (``machinlike._pids``; page aligned).
HEADER = 4096
FREE = 0
RETIRED = -1
_GRAIN = 1 << 20  # capacities are rounded up to whole MiB so that segments recycle well
#: Seconds after its caller's deadline that an untaken reply lease is given up (see the
#: module doc). Generous: a reply that did arrive in time but whose caller loads it later
#: than this fails; one nobody reads is only held this long.
ABANDON_AFTER_S = 10.0

_lending = threading.local()  # .until: the give-up time of the leases this thread makes now


def lending_until(give_up: float) -> float:
    """Make this thread's next leases come back at ``give_up`` (``time.monotonic()`` s) when
    still untaken; 0: never (the default). Returns the value it replaces, to restore.

    For a reply carried by torch RPC, which drops it unread once the caller timed out."""
    before = getattr(_lending, "until", 0.0)
    _lending.until = give_up
    return before


def lending_give_up() -> float:
    """The give-up time this thread's leases are made with now (:func:`lending_until`); 0:
    never. Read by the CUDA export area, which lends its slabs to replies the same way."""
    return getattr(_lending, "until", 0.0)


def reachable(pid: int) -> bool:
    """Whether this process can open ``pid``'s descriptors through ``/proc`` now.

    Not cached here: a pid names another process once reused, and the callers keep their
    verdicts by process identity (``SameHost``, ``InferenceServer``); one look costs
    microseconds."""
    try:
        os.readlink(f"/proc/{pid}/exe")  # needs the same ptrace-read access as fd/N
        return True
    except OSError:
        return False


class Segment:
    """One memfd, mapped here for its whole life. ``data`` views the bytes after the header."""

    __slots__ = ("fd", "inode", "capacity", "map", "header", "data", "lease", "sent_to", "give_up")

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.fd = os.memfd_create("machinlike-shm", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, HEADER + capacity)
            # MAP_POPULATE faults every page in now, in one go, off the copy's path.
            self.map = mmap.mmap(self.fd, HEADER + capacity, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
        except BaseException:
            os.close(self.fd)
            raise
        self.inode = os.fstat(self.fd).st_ino
        self.header = np.frombuffer(self.map, dtype=np.int64, count=2)
        self.data = torch.from_numpy(np.frombuffer(self.map, dtype=np.uint8, offset=HEADER))
        self.lease = 0
        self.sent_to = (0, 0)  # (lease id, the identity word of the process it was sent to)
        self.give_up = 0.0  # monotonic s at which this lease, sent and untaken, is abandoned; 0: never

    def state(self) -> int:
        return int(self.header[0])

    def claim(self) -> int:
        """What a descriptor of this lease tells its receiver: the lease id, when it must be
        taken under the claim (it may be abandoned); 0 when it is taken plainly."""
        return self.lease if self.give_up else 0

    def close(self) -> None:
        # Receivers that still map it keep the memory; RETIRED tells their caches to let go.
        self.header[0] = RETIRED
        del self.header, self.data
        try:
            self.map.close()
        except BufferError:  # a tensor of this process still views it: unmapped when it dies
            pass
        os.close(self.fd)


class SegmentCache:
    """The segments this process owns, free or lent; at most ``limit`` bytes of them.

    Thread-safe. ``stats`` counts leases, new segments, evictions, reclaims (a dead taker's
    lease), unread leases taken back (their receiver died first) and fallbacks (a lease
    refused because of the limit).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._segments: List[Segment] = []
        self._by_inode: Dict[int, Segment] = {}
        self._ids = itertools.count(1)
        self.stats = {"leases": 0, "created": 0, "evicted": 0, "reclaimed": 0, "unread": 0, "abandoned": 0,
                      "fallbacks": 0}
        self._said: Set[str] = set()  # the kinds of fallback warned about

    def held_bytes(self) -> int:
        """Bytes of segments owned now (free and lent)."""
        return sum(s.capacity for s in self._segments)

    def lent(self) -> int:
        """Segments lent now (a receiver still holds what was copied into them)."""
        with self._lock:
            return sum(not self._is_free(s) for s in self._segments)

    def set_limit(self, limit: int) -> None:
        with self._lock:
            self.limit = limit
            self._evict(0)

    def find(self, inode: int) -> Optional[Segment]:
        """This process's own segment ``inode`` (a payload loaded by its own sender)."""
        return self._by_inode.get(inode)

    def lease(self, nbytes: int) -> Optional[Segment]:
        """A segment of at least ``nbytes`` bytes, marked lent; None when over the limit."""
        capacity = -(-nbytes // _GRAIN) * _GRAIN
        alive: Dict[int, bool] = {}  # takers seen in this lease: one /proc read each, not one per segment
        with self._lock:
            best: Optional[Segment] = None
            for seg in self._segments:
                if seg.capacity >= nbytes and seg.capacity <= 2 * capacity and self._is_free(seg, alive):
                    if best is None or seg.capacity < best.capacity:
                        best = seg
            if best is None:
                if not self._evict(capacity, alive):
                    self.stats["fallbacks"] += 1
                    self._say_fallback(capacity)
                    return None
                best = Segment(capacity)
                self._segments.append(best)
                self._by_inode[best.inode] = best
                self.stats["created"] += 1
            best.lease = next(self._ids)
            best.give_up = getattr(_lending, "until", 0.0)
            best.header[1] = 0
            best.header[0] = best.lease
            self.stats["leases"] += 1
            return best

    def _say_fallback(self, capacity: int) -> None:
        """The first fallback of each kind, once per process: the send is slower, not lost."""
        kind = "large" if capacity > self.limit else "lent"
        if kind in self._said:
            return
        self._said.add(kind)
        if kind == "large":
            log.warning("a message of %d bytes of tensors is larger than shm_cache_bytes (%d): it travels through "
                        "TensorPipe (slower); raise World(shm_cache_bytes=...) to send it through shared memory. "
                        "Said once per process; stats['fallbacks'] counts them.", capacity, self.limit)
            return
        log.warning("this process's same-host shared-memory segments (shm_cache_bytes=%d) are all lent to receivers "
                    "that still hold what was sent through them, so tensors now travel through TensorPipe (slower). "
                    "A receiver that keeps what it receives (a replay buffer, say) should keep clone()s or copy it "
                    "into its own storage; or raise World(shm_cache_bytes=...). Said once per process; "
                    "stats['fallbacks'] counts them.", self.limit)

    def wait_taken(self, timeout: float) -> bool:
        """Wait until every lent segment was taken by its receiver (mapped there: it then
        outlives this process) or freed, for at most ``timeout`` seconds. For a process
        about to exit: its segments' descriptors close with it, and a receiver that had
        not opened one yet could not load what it was sent.

        Returns:
            True when none is left untaken.
        """
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while True:
            with self._lock:
                untaken = [s for s in self._segments if s.state() not in (FREE, RETIRED) and not int(s.header[1])
                           and not self._unread_by_dead(s) and not self._abandon(s)]
            if not untaken:
                return True
            if time.monotonic() >= deadline:
                return False
            # (a word in shared memory has no wake-up to wait on: poll, backing off)
            time.sleep(pause)
            pause = min(pause * 2, 0.01)

    def release(self, seg: Segment, lease: Optional[int] = None) -> None:
        """Hand back a lease that was never sent (encoding or pickling failed).

        ``lease``: only while ``seg`` is still this cache's, lent under that lease and not
        taken (a late hand-back, after the World stopped, does nothing); None: at once.

        Takes no lock: it may run in a garbage collection (``_unsent``) that interrupted
        this very cache under its lock. Nothing else writes a lent, untaken segment's state
        (``lease`` only picks FREE ones), and a segment closed meanwhile has no header."""
        try:
            if lease is not None and (self._by_inode.get(seg.inode) is not seg or seg.state() != lease
                                      or int(seg.header[1])):
                return
            seg.header[0] = FREE
        except AttributeError:  # closed (World stop)
            pass

    def address(self, seg: Segment, lease: int, receiver: int) -> None:
        """Name the process a sent message's lease went to (an identity word of
        ``machinlike._pids``): the lease comes back should it die before taking it. Only
        once the message was sent and dropped here (a retry may still send it elsewhere
        before that). Applies to ``lease`` only: a later lease of ``seg`` ignores it.

        Takes no lock, as :meth:`release` (it runs when the message is collected): one
        attribute is set."""
        seg.sent_to = (lease, receiver)

    def _is_free(self, seg: Segment, alive: Optional[Dict[int, bool]] = None) -> bool:
        state = seg.state()
        if state == FREE:
            return True
        taker = int(seg.header[1])
        if not taker:
            if self._unread_by_dead(seg, alive):
                seg.header[0] = FREE  # sent to a process that died before it took it
                self.stats["unread"] += 1
                return True
            return self._abandon(seg)
        if pid_of(taker) == os.getpid():
            return False
        if not self._alive(taker, alive):
            seg.header[0] = FREE  # its receiver was killed while holding it
            self.stats["reclaimed"] += 1
            return True
        return False

    def _unread_by_dead(self, seg: Segment, alive: Optional[Dict[int, bool]] = None) -> bool:
        """Whether ``seg`` (lent, untaken) went to a receiver that is dead: nobody else can
        take it (the receiver is noted only once its message left for good)."""
        lease, receiver = seg.sent_to
        return (bool(receiver) and lease == seg.state() and pid_of(receiver) != os.getpid()
                and not self._alive(receiver, alive))

    def _abandon(self, seg: Segment) -> bool:
        """Free ``seg`` when its lease (lent, untaken) was sent for a reply whose caller gave
        up on it long ago (``give_up`` passed), under the claim its receiver takes it by
        (see the module doc); whether it did."""
        lease = seg.sent_to[0]
        if not seg.give_up or lease != seg.state() or time.monotonic() < seg.give_up:
            return False
        try:
            fcntl.flock(seg.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # its receiver is taking it this very moment
        try:
            if int(seg.header[1]) or seg.state() != lease:
                return False
            seg.header[0] = FREE
            self.stats["abandoned"] += 1
            return True
        finally:
            fcntl.flock(seg.fd, fcntl.LOCK_UN)

    @staticmethod
    def _alive(word: int, alive: Optional[Dict[int, bool]]) -> bool:
        """``pid_alive(word)``, asked once per ``alive`` (one lease's memo; None: none)."""
        known = None if alive is None else alive.get(word)
        if known is None:
            known = pid_alive(word)
            if alive is not None:
                alive[word] = known
        return known

    def _evict(self, room: int, alive: Optional[Dict[int, bool]] = None) -> bool:
        """Close free segments until ``room`` more bytes fit under the limit."""
        held = self.held_bytes()
        if held + room <= self.limit:
            return True
        for seg in sorted(self._segments, key=lambda s: -s.capacity):
            if held + room <= self.limit:
                break
            if self._is_free(seg, alive):
                self._drop(seg)
                held -= seg.capacity
                self.stats["evicted"] += 1
        return held + room <= self.limit

    def _drop(self, seg: Segment) -> None:
        self._segments.remove(seg)
        self._by_inode.pop(seg.inode, None)
        seg.close()

    def close(self) -> None:
        """Give up every segment (lent ones live on in their receivers until dropped)."""
        with self._lock:
            for seg in list(self._segments):
                self._drop(seg)


_cache: Optional[SegmentCache] = None
_cache_lock = threading.Lock()
DEFAULT_LIMIT = 1 << 30


def cache() -> SegmentCache:
    """This process's segment cache, made on first use (``DEFAULT_LIMIT`` bytes)."""
    global _cache
    if _cache is None:
        with _cache_lock:
            if _cache is None:
                _cache = SegmentCache(DEFAULT_LIMIT)
    return _cache


def _after_fork_in_child() -> None:
    # A forked child must not lend its parent's segments (they are the parent's leases).
    global _cache, _cache_lock
    _cache, _cache_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
