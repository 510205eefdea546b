"""Roster: this process's view of who is in the world, and the subscribers to its changes.

Owns the live table (member -> :class:`MemberRecord`), the RPC-worker index, who is
gone and why, the callbacks, and one re-entrant lock with its Condition. Nothing else
writes these: events reach it through :meth:`Roster.apply` (a stretch of joins through
:meth:`Roster.apply_joins`, at once), in the world's log order.

    EventLog.catch_up ──► Membership._deliver ──► Roster.apply(entry)   (under the lock)
                                                │    join / leave / lost / move
                                                ├─► Waits.on_gone(...)  (workers now gone)
                                                └─► Roster.publish(event) (callbacks, no lock)
    queries (members, worker_of, wait_until, ...)   read under the lock

Why re-entrant: :meth:`wait_until` evaluates the caller's predicate under the lock, and a
predicate may ask the roster again (``incarnation_of``, ``members``).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import zlib
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ...exception import PeerLostError
from .._store import MemberRecord
from .processes import alive_here, is_here, pid_in
from .member_event import MemberEvent
from .._transport import PipeLedger

__all__ = ["Roster", "GONE_KEPT", "ring_key"]

log = logging.getLogger(__name__)

#: Gone RPC workers, and gone members, a view remembers (the most recent).
GONE_KEPT = 16384


def ring_key(member: str) -> str:
    """Where ``member`` stands in the liveness ring: its name after a stable hash of it.

    Why not the name alone: names come in runs (``actor-00017``, ``actor-00018``; a host's
    members named alike). In name order every joiner of a run stood just before the same
    members, so their watchers changed at every join, each new one timing them from
    scratch: at 10 joins a second, deaths there went unnamed as long as the joins went on.
    A hash scatters a run over the ring; every view computes the same order.
    """
    return f"{zlib.crc32(member.encode('utf-8', 'surrogatepass')):08x}{member}"


_KEY_NAME = 8  # where the name starts in a ring key


class Roster:
    """The world's members as this process has seen them (see the module doc)."""

    def __init__(self, pipes: PipeLedger) -> None:
        #: The current agent's pipes: told of every worker that goes (see _transport.pipes).
        self.pipes = pipes
        self._lock = threading.RLock()
        self._changed = threading.Condition(self._lock)
        # Threads waiting on _changed (under the lock): an event wakes nobody when none
        # waits, which is nearly always (it skips notify_all's cost, per event per member).
        self._waiting = 0
        self._live: Dict[str, MemberRecord] = {}
        # The live members' ring keys, sorted (kept with _live): the liveness ring's
        # successors are found by bisection, not by a pass over every member at each change.
        self._ring: List[str] = []
        self._by_worker: Dict[str, str] = {}  # RPC worker -> member (live and recently gone)
        # RPC worker -> member, read from the store for workers called before this view
        # saw their member join (a failure then named the worker); oldest first, bounded.
        self._named: Dict[str, str] = {}
        # member -> its workers in _by_worker (a worker's name holds its member's, so it
        # never changes member): a loss finds its member's workers without a pass over
        # every worker (N per loss per member before: O(N²) a loss for the world).
        self._workers_of: Dict[str, List[str]] = {}
        # member -> (kind "lost" | "left", incarnation, when this view saw it go: monotonic) of
        # its latest incarnation, oldest first
        self._gone: Dict[str, Tuple[str, int, float]] = {}
        # Gone RPC workers, oldest first (a dict as an ordered set): written under the lock,
        # read without it (one look-up is atomic). The oldest are forgotten past
        # GONE_KEPT, with their index entries: a world that runs for days must not pay
        # for every worker it ever had (a call to a forgotten one fails as refused).
        self._gone_workers: Dict[str, None] = {}
        # worker -> its pid when on this host, else 0 (cached: a call asks every time)
        self._here: Dict[str, int] = {}
        # Retired worker -> the worker its member (same incarnation) moved to; bounded
        # with the gone workers (each entry's key is one of them).
        self._moved_to: Dict[str, str] = {}
        # Replaced, never changed in place: publish reads it without the lock (it runs once
        # per event per member, N² times while a world of N fills).
        self._callbacks: Tuple[Callable[[MemberEvent], None], ...] = ()
        self._static_order: List[str] = []
        # Set once, for good: the store was lost, or the others declared this member lost.
        self._cut_off: Optional[PeerLostError] = None
        self._on_cut_off: List[Callable[[], None]] = []  # (Waits ends the pending calls)
        # Reads the world's log now (Membership.catch_up; see catch_up); False: not read.
        self._refresh: Callable[[float], bool] = lambda within: False
        #: Bumped on every change of the live table (read without the lock: a watcher
        #: recomputes what it derived from the table when this moved; see watch).
        self.version = 0

    # ------------------------------------------------------------------ changes
    def seed_static(self, records: Sequence[MemberRecord]) -> None:
        """Record the members of a static world (``records[i]`` has rank ``i``)."""
        with self._lock:
            for rec in records:
                if rec.member not in self._live:
                    bisect.insort(self._ring, ring_key(rec.member))
                self._live[rec.member] = rec
                self._index(rec.worker, rec.member)
            self._static_order = [rec.member for rec in records]
            self.version += 1

    def apply(self, kind: str, rec: MemberRecord) -> Optional[List[str]]:
        """Apply one event of the log.

        Returns:
            None when subscribers are not told (a ``"move"``, a replayed ``"join"``);
            else, for ``"leave"``/``"lost"``, the departed member's RPC workers that are
            gone (calls pending on them must end), and ``[]`` for a ``"join"``.
        """
        with self._lock:
            try:
                if kind == "move":
                    self._move(rec)
                    return None
                if kind == "join":
                    return [] if self._join(rec) else None
                current = self._live.get(rec.member)
                if current is not None and current.incarnation == rec.incarnation:
                    del self._live[rec.member]
                    del self._ring[bisect.bisect_left(self._ring, ring_key(rec.member))]
                    self._gone.pop(rec.member, None)  # (re-inserted: newest last)
                    self._gone[rec.member] = ("left" if kind == "leave" else "lost", rec.incarnation, time.monotonic())
                    while len(self._gone) > GONE_KEPT:
                        del self._gone[next(iter(self._gone))]
                self._worker_gone(rec.worker, left=kind == "leave")
                # Its worker, and any it had before a renewal (calls on those may be under way).
                return [w for w in self._workers_of.get(rec.member, ()) if w in self._gone_workers]
            finally:
                self.version += 1
                if self._waiting:
                    self._changed.notify_all()

    def apply_joins(self, records: Sequence[MemberRecord]) -> List[bool]:
        """Apply a run of ``"join"`` events of the log at once (one lock, one wake-up);
        for each, whether subscribers are told (False: a replayed join).

        Why a run: a new member reads every member already there, and every member reads
        every join: N² deliveries while a world of N fills. Inserting each name into the
        sorted list moved up to N names each time; a run is merged in one sort.
        """
        with self._lock:
            try:
                added: List[str] = []
                fresh = [self._join(rec, added) for rec in records]
                if len(added) > 4:
                    self._ring.extend(ring_key(name) for name in added)
                    self._ring.sort()  # (a sorted run and k new keys: about N + k log k)
                else:
                    for name in added:
                        bisect.insort(self._ring, ring_key(name))
                return fresh
            finally:
                self.version += 1
                if self._waiting:
                    self._changed.notify_all()

    def _join(self, rec: MemberRecord, added: Optional[List[str]] = None) -> bool:
        """(under the lock) ``rec`` joined; False when it is not news. A new name goes into
        ``added`` (the caller sorts it in), or straight into the sorted names."""
        old = self._live.get(rec.member)
        if old is not None:
            if old.incarnation >= rec.incarnation:
                return False  # a static member's record, or a replayed join
            if old.worker != rec.worker:
                # A newer incarnation joined before this view saw the old one lost (the
                # log may hold them in that order): the old worker is gone now.
                self._worker_gone(old.worker)
        elif added is not None:
            added.append(rec.member)
        else:
            bisect.insort(self._ring, ring_key(rec.member))
        self._live[rec.member] = rec
        self._index(rec.worker, rec.member)
        self._gone.pop(rec.member, None)
        return True

    def _index(self, worker: str, member: str) -> None:
        """(under the lock) ``worker`` is ``member``'s (a worker id that came round may
        have been another member's, whose name maps to the same text)."""
        old = self._by_worker.get(worker)
        if old != member:
            if old is not None:
                self._unindex(worker, old)
            self._workers_of.setdefault(member, []).append(worker)
        self._by_worker[worker] = member

    def _unindex(self, worker: str, member: str) -> None:
        """(under the lock) ``worker`` is no longer ``member``'s, nor in ``_by_worker``."""
        self._by_worker.pop(worker, None)
        workers = self._workers_of[member]
        workers.remove(worker)  # (a member's few workers)
        if not workers:
            del self._workers_of[member]

    def _move(self, rec: MemberRecord) -> None:
        current = self._live.get(rec.member)
        if current is None or current.incarnation != rec.incarnation or current.worker == rec.worker:
            return
        self._live[rec.member] = rec
        self._index(rec.worker, rec.member)
        self._moved_to[current.worker] = rec.worker
        # New calls go to the new worker; calls under way on the old one still complete.
        self._worker_gone(current.worker)

    def _worker_gone(self, worker: str, left: bool = False) -> None:
        """Mark RPC worker ``worker`` gone (under the lock; ``left``: its member left the
        world); forget the oldest past GONE_KEPT."""
        self._gone_workers[worker] = None
        self._here.pop(worker, None)
        self.pipes.gone(worker, left)
        while len(self._gone_workers) > GONE_KEPT:
            oldest = next(iter(self._gone_workers))
            del self._gone_workers[oldest]
            self._moved_to.pop(oldest, None)
            member = self._by_worker.get(oldest)
            if member is not None and (member not in self._live or self._live[member].worker != oldest):
                self._unindex(oldest, member)

    def publish(self, event: MemberEvent) -> None:
        """Run the callbacks on ``event`` (outside the lock; one failing is logged)."""
        for callback in self._callbacks:
            try:
                callback(event)
            except Exception:  # a user callback must not stop the monitor
                log.exception("membership callback %r failed on %s", callback, event)

    def mark_cut_off(self, err: PeerLostError) -> None:
        """This member is cut off from the world (its store is gone, or the others declared it
        lost): every later look-up of a member, and every call, raises ``err``; the
        ``when_cut_off`` callbacks end what is pending."""
        self._cut_off = err
        with self._lock:
            self._changed.notify_all()
        for callback in self._on_cut_off:
            callback()

    def when_cut_off(self, callback: Callable[[], None]) -> None:
        """Run ``callback`` (it must not raise) each time this member is marked cut off."""
        self._on_cut_off.append(callback)

    @property
    def cut_off(self) -> Optional[PeerLostError]:
        return self._cut_off

    # ------------------------------------------------------------------ queries
    def members(self) -> List[str]:
        """Names of the live members, sorted."""
        with self._lock:
            return sorted(self._live)

    def names_by_rank(self) -> List[str]:
        """A static world's member names in rank order (dead ones included)."""
        return list(self._static_order)

    def ranks(self) -> List[int]:
        with self._lock:
            return sorted(r.rank for r in self._live.values())

    def others(self, me: str) -> List[MemberRecord]:
        """The live members' records, but ``me``'s."""
        with self._lock:
            return [r for m, r in self._live.items() if m != me]

    def successors(self, me: str, k: int) -> List[MemberRecord]:
        """The (at most ``k``) live members after ``me`` in ring order (:func:`ring_key`),
        wrapping round; ``me`` is never among them (O(k + log N))."""
        with self._lock:
            ring, n = self._ring, len(self._ring)
            start = bisect.bisect_right(ring, ring_key(me))
            out: List[MemberRecord] = []
            for i in range(start, start + n):
                name = ring[i % n][_KEY_NAME:]
                if name != me:
                    out.append(self._live[name])
                    if len(out) == k:
                        break
            return out

    def incarnation_of(self, member: str) -> Optional[int]:
        """The incarnation of live ``member``; None when it is not live."""
        with self._lock:
            rec = self._live.get(member)
            return None if rec is None else rec.incarnation

    def incarnations(self, members: Iterable[str]) -> Dict[str, int]:
        """The current incarnation of each live member among ``members``."""
        with self._lock:
            return {m: self._live[m].incarnation for m in members if m in self._live}

    def not_current(self, members: Sequence[str], incarnations: Optional[Dict[str, int]]) -> List[str]:
        """The members that are not live (or, given ``incarnations``, live as another one)."""
        with self._lock:
            return [m for m in members if m not in self._live
                    or (incarnations is not None and self._live[m].incarnation != incarnations.get(m))]

    def gone(self, member: str) -> Optional[str]:
        """``"left"`` or ``"lost"`` when ``member``'s latest incarnation is gone, else None."""
        with self._lock:
            gone = self._gone.get(member)
            return None if member in self._live or gone is None else gone[0]

    def may_run(self, member: str, incarnation: int) -> bool:
        """Whether ``member``'s incarnation ``incarnation`` may still run, as told by a call
        that names it: it is live here, or newer than any this view has seen go or run.

        Why: a restarted member calls as soon as it joined, while this view may be a
        liveness tick behind (it still lists the old incarnation, or has seen it lost and
        not yet the join). Incarnations only grow and only a running process names its own,
        so a newer one is no stale caller; the view catches up within the tick.
        """
        with self._lock:
            rec = self._live.get(member)
            if rec is not None:
                return rec.incarnation <= incarnation
            gone = self._gone.get(member)
            return gone is None or gone[1] < incarnation

    def departed(self, member: str) -> Optional[Tuple[str, int, float]]:
        """``(kind, incarnation, when)`` of ``member``'s latest incarnation if it is gone
        (``when``: ``time.monotonic()`` as this view saw it go), else None."""
        with self._lock:
            return None if member in self._live else self._gone.get(member)

    def lost_lately(self, within: float, most: int = 3) -> List[Tuple[str, float]]:
        """``(member, seconds since)`` of the members this view saw lost within the last
        ``within`` s and not back, newest first, at most ``most``."""
        now = time.monotonic()
        with self._lock:
            return [(m, now - g[2]) for m, g in reversed(self._gone.items())
                    if g[0] == "lost" and m not in self._live and now - g[2] <= within][:most]

    def refresh_with(self, read_log: Callable[[float], bool]) -> None:
        """``read_log(within)`` reads the world's log now (delivering it here), after another
        thread's read under way (``within`` seconds at most); False if it could not."""
        self._refresh = read_log

    def catch_up(self, within: float = 0.0) -> bool:
        """Read the world's log now (this view is otherwise up to a liveness tick behind);
        False when it could not be read. For a caller that just read the store and found
        a member this view does not have yet (``wait_paired``); not on every failed
        look-up: a store that died unseen could hold it for the store's timeout.
        ``within``: seconds to wait for another thread's read under way (0: none)."""
        return self._refresh(within) if self._cut_off is None else False

    def worker_of(self, member: str) -> str:
        """The RPC worker name of live ``member``.

        Raises:
            PeerLostError: the member is gone (left or lost) or the store is.
        """
        with self._lock:
            rec = self._live.get(member)
            gone = self._gone.get(member, ("",))[0]
        if self._cut_off is not None:
            raise self._cut_off
        if rec is None:
            raise PeerLostError(member, f"it {gone} the world" if gone == "left" else
                                "it was lost (its process died or went silent)" if gone else
                                "it is not a member of this world")
        return rec.worker

    def identity_of(self, worker: str) -> Optional[str]:
        """The process identity of RPC worker ``worker`` (a live member's), None if unknown."""
        with self._lock:
            member = self._by_worker.get(worker)
            rec = self._live.get(member) if member is not None else None
            return rec.identity if rec is not None and rec.worker == worker else None

    def on_this_host(self, worker: str) -> bool:
        """Whether RPC worker ``worker`` runs where ``/proc`` sees it (its death shows at once)."""
        return self.pid_here(worker) != 0

    def pid_here(self, worker: str) -> int:
        """The pid of RPC worker ``worker``'s process when it runs where ``/proc`` sees it,
        else 0 (also while the worker is unknown)."""
        here = self._here.get(worker)
        if here is None:
            identity = self.identity_of(worker)
            if identity is None:
                return 0
            # fixed for a worker's life
            here = self._here[worker] = pid_in(identity) if is_here(identity) else 0
        return here

    def moved_from(self, worker: str, timeout: float) -> Optional[str]:
        """Wait until the live member of RPC worker ``worker`` answers on another worker.

        A member whose listener closed renews its agent and logs a move; a caller refused
        by the old agent waits here for this view to see it (the log is read every
        liveness tick).

        Args:
            timeout: Seconds at most.

        Returns:
            The member's current worker; None in a static world, when ``worker`` is
            unknown, its member is gone, its process here is dead, or the move did not
            show within ``timeout``.
        """
        if self._static_order:
            return None  # a static world's agents are never renewed
        deadline = time.monotonic() + timeout
        with self._changed:
            member = self._by_worker.get(worker)
            while member is not None and self._cut_off is None:
                rec = self._live.get(member)
                if rec is None:
                    return None  # gone: the caller names it
                if rec.worker != worker:
                    return rec.worker
                if alive_here(rec.identity) is False:
                    return None  # a dead process here refuses too: no move is coming
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                # The monitor's tick notifies; a dead process here is checked again after
                # a short wait because its loss is logged only after its silence.
                self._wait(min(left, 0.25))
        return None

    def member_of(self, worker: str) -> str:
        """The member whose RPC worker ``worker`` is (``worker`` itself if unknown here)."""
        with self._lock:
            member = self._by_worker.get(worker)
            return member if member is not None else self._named.get(worker, worker)

    def knows_worker(self, worker: str) -> bool:
        # No lock: one look-up each is atomic.
        return worker in self._by_worker or worker in self._named

    def name_worker(self, worker: str, member: str) -> None:
        """``worker`` is ``member``'s (read from the store before this view saw it join)."""
        with self._lock:
            self._named[worker] = member
            while len(self._named) > GONE_KEPT:
                del self._named[next(iter(self._named))]

    def worker_gone(self, worker: str) -> bool:
        # No lock: one set look-up is atomic, the set only grows (under the lock), and
        # every call asks this twice.
        return worker in self._gone_workers

    def resolve(self, worker: str) -> Optional[str]:
        """The worker to call for ``worker``: itself while it is current, the worker its
        member moved to when it was retired by a renewal (the same incarnation: a call
        picked from a view or cache of just before the move still reaches it), None when
        its member is gone (a later incarnation is another process: never redirected)."""
        if worker not in self._gone_workers:  # (the hot path: no lock, as worker_gone)
            return worker
        with self._lock:
            for _ in range(len(self._moved_to) + 1):  # a chain of moves, never a cycle
                nxt = self._moved_to.get(worker)
                if nxt is None:
                    break
                worker = nxt
            return None if worker in self._gone_workers else worker

    def _wait(self, timeout: float) -> None:
        """(under the lock) Wait up to ``timeout`` seconds for the next change."""
        self._waiting += 1
        try:
            self._changed.wait(timeout)
        finally:
            self._waiting -= 1

    # ---------------------------------------------------------------- callbacks
    def subscribe(self, callback: Callable[[MemberEvent], None]) -> None:
        """Call ``callback(event)`` on every event applied from now on."""
        with self._lock:
            self._callbacks = self._callbacks + (callback,)

    def unsubscribe(self, callback: Callable[[MemberEvent], None]) -> None:
        """Stop calling ``callback`` (no error if it was not subscribed)."""
        with self._lock:
            if callback in self._callbacks:
                i = self._callbacks.index(callback)
                self._callbacks = self._callbacks[:i] + self._callbacks[i + 1:]

    def wait_until(self, predicate: Callable[[List[str]], bool], timeout: float) -> List[str]:
        """Block until ``predicate(live members)`` holds; return the members then.

        Raises:
            TimeoutError: it did not hold within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                members = sorted(self._live)
                if predicate(members):
                    return members
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"membership condition not met within {timeout:g} s (members: {members})")
                self._wait(left)
