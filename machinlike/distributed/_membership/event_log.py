"""EventLog: the world's membership events, posted to and read from the store in one order.

Owns how far this process has read the log (the next position) and delivers every new
entry once, in log order, to the callable it was built with (``Membership._deliver``), a
run of consecutive entries at a time.

Each event has a position of its own, claimed from a counter; positions are cut into
ranges of ``segment``, each with a snapshot, so that no key grows with the world's age
and nobody reads the whole history::

    m/evn             counter: positions claimed (readers' wake-up; the ring watch
                      reads it with the heartbeats, in one request)
    m/e/<seq>         the entry at position seq: "kind|member|record", or SKIP
    m/snap/<k>        the state at the start of range k (positions k*segment ..):
                      counts, then each member's join and departure (see log_state)
    m/logk            counter: the newest range with a snapshot

    post(entry)       seq = add(m/evn, 1) - 1; compare_set(m/e/<seq>, "", line)
                      found SKIP there (it was too slow, below)? post again
                      seq opens range k+2? seal the ranges up to k
    catch_up()        deliver m/e/<next> .. while written: one check and one
                      multi_get (a single get for one entry); at each liveness tick,
                      and at once when a departure rings the bell (see bell)
    a hole            a position claimed but not written for ``hole_wait``: its poster
                      died between its two requests. Any reader (or the sealer) fills
                      it with compare_set(m/e/<seq>, "", SKIP): the first writer wins,
                      so all readers deliver the same thing and none waits forever
    seal k            wait for range k to be written (filling holes at ``hole_wait``);
                      m/snap/<k+1> = fold(m/snap/<k>, range k) (first writer wins);
                      compare_set(m/logk, k, k+1); the poster that opened range
                      k+2 (one process) then deletes range and snapshot k + 1 - KEEP
    a new reader      starts from m/snap/<m/logk> (the members as they stand)

    Entries and the newest snapshot are read through the process's LogCache (see
    log_cache): the members of one process read and decode each position once, taking
    turns at the store (one reads, the others find what it read).

Why a position per event, and not compare-and-set of a shared segment (the design
before): posters racing on one key retried, each retry re-reading and rewriting a growing
segment, so 1,024 members joining at once never finished (O(N²) bytes, endless CAS
failures). Claiming a position costs one ``add`` whatever the contention, and the entry
one write of its own size. Why snapshots: a member joining after 100,000 events reads one
snapshot and the positions since. A reader more than ``KEEP`` ranges behind (it slept for
thousands of events) finds its positions deleted; it catches up from the newest snapshot,
and says so.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Hashable, List, Mapping, Optional, Sequence, Tuple

import torch.distributed as dist

from .._store import Keys, LogEntry, MemberRecord
from .._store import Registry
from .bell import Bell
from .log_cache import LogCache, shared_cache
from .log_state import (
    GONE_KEPT, NO_EVENTS, SEGMENT, SKIP, EventCounts, History, Numbered, Snapshot, entry_of, read_history,
)

__all__ = ["EventLog", "EventCounts", "History", "read_history", "SEGMENT", "GONE_KEPT", "HOLE_WAIT", "READ_TURN"]

log = logging.getLogger(__name__)

#: Ranges (and snapshots) kept behind the newest snapshot.
KEEP = 4
#: Seconds a claimed position may stay unwritten before a reader fills it with SKIP. A
#: post's two requests take milliseconds; a poster merely starved this long finds SKIP
#: and posts again, so this bounds only how long readers stall behind a dead poster.
HOLE_WAIT = 1.0
#: Seconds a member waits for another member of its process to finish reading the log
#: before it reads the store itself (see EventLog._read_shared).
READ_TURN = 0.25
#: Times a post may find its position skipped before it gives up.
POST_TRIES = 8
#: The kinds of event that ring the bell after they are posted.
DEPARTURES = ("lost", "leave")


class EventLog:
    """The world's event log, as this process reads it.

    Args:
        registry: The world's store tables.
        keys: The world's keys.
        deliver: Called with each run of new entries, as (position, entry) in log order
            (skipped positions left out). If it raises, the run is delivered again at the
            next catch-up.
        segment: Positions per range (tests make it small).
        hole_wait: Seconds before an unwritten position is skipped (see HOLE_WAIT).
        bell: Rung after each departure posted here, so that every member reads it at
            once (see bell); None: read at the liveness ticks only.
        server: The store server (``_store.server_of``): the members of this process on
            the same log share what they read (see log_cache); None: a cache of this
            reader's own.

    Attributes:
        skipped: Positions this process filled with SKIP (their posters died mid-post).
    """

    def __init__(self, registry: Registry, keys: Keys, deliver: Callable[[Sequence[Numbered]], None],
                 segment: int = SEGMENT,
                 hole_wait: float = HOLE_WAIT, bell: Optional[Bell] = None, server: Optional[Hashable] = None) -> None:
        self._registry = registry
        self._server = server
        self._cache = LogCache(segment)  # (the shared one replaces it at the first catch-up)
        self._bell = bell
        self._keys = keys
        self._deliver = deliver
        self._segment = segment
        self._hole_wait = hole_wait
        # Held while reading and delivering: entries are delivered once, in order.
        self._lock = threading.Lock()
        self._holder: Optional[int] = None  # the thread holding it (a delivery's callback may catch up)
        self._started = False
        self._seq = 0  # the next position to deliver
        self._claimed = 0  # positions claimed as of the catch-up before (long written)
        self._hole: Optional[Tuple[int, float]] = None  # (position, when first seen unwritten)
        self.skipped = 0

    # ---------------------------------------------------------------- posting
    def post(self, kind: str, rec: MemberRecord) -> None:
        """Append an event for everyone (this process sees it at its next catch-up).

        Raises:
            TimeoutError: its position was skipped ``POST_TRIES`` times in a row (this
                process was starved past ``hole_wait`` at each try).
        """
        line = LogEntry(kind, rec).encode()
        reg = self._registry
        for _ in range(POST_TRIES):
            seq = reg.add(self._keys.log_count(), 1) - 1
            won = reg.compare_set(self._keys.log_entry(seq), "", line) == line
            if seq and seq % self._segment == 0:
                self._seal(seq // self._segment)
            if won:
                if kind in DEPARTURES and self._bell is not None:
                    self._bell.ring(entry=(seq, line))
                return
            log.warning("machinlike: this member's %r event was skipped at position %d (it took over %g s "
                        "to write); it posts it again", kind, seq, self._hole_wait)
        raise TimeoutError(f"machinlike: the {kind!r} event of {rec.member!r} was skipped {POST_TRIES} times "
                           f"(each write came more than {self._hole_wait:g} s after its claim)")

    def _seal(self, opened: int) -> None:
        """This poster opened range ``opened``: snapshot the ranges before ``opened - 1``
        that have none (one poster per range, amortised O(1) requests per post).

        Why not range ``opened - 1``: its posts were claimed just now and many are still
        being written; the range before has long been written, so its sealing seldom waits.
        """
        reg, keys, size = self._registry, self._keys, self._segment
        end = opened - 1
        deadline = time.monotonic() + self._hole_wait  # one wait for holes, shared by the ranges
        # The ranges are folded in order: the poster that opened the range before this
        # one folds the one before mine; wait for it rather than fold it twice (a dead
        # one is taken over at the deadline, by the loop below).
        while end > 1 and not reg.present([keys.log_snapshot(end - 1)]) and time.monotonic() < deadline:
            time.sleep(0.02)
        k = reg.add(keys.log_head(), 0)
        while k < end:
            # A sealer of a later range may be at it too (this one lagged): the snapshot
            # it wrote is one look, not a second fold.
            if not reg.present([keys.log_snapshot(k + 1)]):
                values = self._written(k * size, (k + 1) * size, deadline)
                state = Snapshot.decode(reg.get_or_empty(keys.log_snapshot(k))) if k else Snapshot(NO_EVENTS, {}, {})
                folded = state.after(_numbered(k * size, values), (k + 1) * size)
                reg.compare_set(keys.log_snapshot(k + 1), "", folded.encode())
            reg.compare_set(keys.log_head(), str(k), str(k + 1))
            k += 1
        old = end - KEEP  # deleted by this poster alone (positions are unique: no race)
        if old >= 0 and k >= end:
            reg.delete([keys.log_snapshot(old)] + [keys.log_entry(s) for s in range(old * size, (old + 1) * size)])

    def _written(self, lo: int, hi: int, deadline: float) -> List[str]:
        """Positions ``lo .. hi - 1`` once all are written; at ``deadline`` the holes are skipped."""
        reg = self._registry
        keys = [self._keys.log_entry(s) for s in range(lo, hi)]
        while not reg.present(keys):
            if time.monotonic() >= deadline:
                # Rare (a poster died mid-post): probe each; written ones stay as they are.
                return [reg.compare_set(key, "", SKIP) for key in keys]
            time.sleep(0.01)
        return reg.read(keys)

    # ---------------------------------------------------------------- reading
    @property
    def position(self) -> int:
        """The next position this process delivers (read without the lock: a hint)."""
        return self._seq

    def catch_up(self, total: Optional[int] = None, wait: bool = True,
                 known: Optional[Mapping[int, str]] = None, within: Optional[float] = None) -> None:
        """Deliver every entry posted since the last call, in log order.

        Args:
            total: The counter ``m/evn`` as the caller just read it (the liveness watch
                reads it with the heartbeats, in one request); None: read it here.
            wait: False: return at once when another thread is catching up, and deliver
                only what is cached while another member of this process reads the store
                (the liveness tick: its next heartbeat must not wait behind another
                thread's reads).
            known: Positions below ``total`` already read from the store, with their
                values (the bell reads them once for the members of its process): kept
                in the cache, they are delivered without a request.
            within: Seconds to wait for another thread's catch-up to end, then read as
                ``wait`` True does (None: ``wait`` decides). Why: that thread may have read
                the counter before the entry the caller needs was posted. On the thread
                delivering (a callback's catch-up) it returns at once: the lock is its own.
        """
        if within is not None:
            if self._holder == threading.get_ident() or not self._lock.acquire(timeout=max(0.0, within)):
                return
            wait = True
        elif not self._lock.acquire(blocking=wait):
            return
        self._holder = threading.get_ident()
        try:
            if total is None:
                total = self._registry.add(self._keys.log_count(), 0)
            if not self._started:
                self._start()
            claimed, self._claimed = self._claimed, total
            cache = self._cache
            if known:
                lo = min(known)
                cache.put(lo, [known[seq] for seq in range(lo, lo + len(known))])
            while self._seq < total:
                cached = cache.run(self._seq, total)
                if cached:
                    self._deliver_run(cached)
                    continue
                end = min(total, self._seq + self._segment)
                read = self._read_shared(cache, end, claimed, wait)
                if read is None:
                    if wait:
                        continue  # another member of this process read them meanwhile: cached now
                    break  # another is reading them: the next tick finds them cached
                self._deliver_run(read[1])
                if read[0] and self._seq < end:
                    break  # the rest is being written: the next catch-up reads on
                if not read[0] and not self._past_hole(self._seq, total):
                    break  # a post under way (or a dead poster's, skipped in time)
        finally:
            self._holder = None
            self._lock.release()

    def _read_shared(self, cache: LogCache, end: int, claimed: int, wait: bool
                     ) -> Optional[Tuple[List[str], List[Optional[LogEntry]]]]:
        """Read positions ``self._seq`` .. (below ``end``) from the store into ``cache``: the
        values read and their entries. None: another member of this process read
        ``self._seq`` while this one waited for its turn (it is cached now), or, when
        ``wait`` is False, another member is reading now.

        Why one reader at a time: while a thousand members join, every tick of every member
        finds new positions that no one has read yet, and each read them itself (two
        requests per member per tick, on top of the tick's two: the joins' store load
        doubled, and each request is one more wait for the GIL). Taking turns, the others
        find them cached. The turn is waited for ``READ_TURN`` at most: a reader stuck on
        a dying store must not make every member of the process wait out its timeout in
        a row. A liveness tick (``wait`` False) does not wait at all: its heartbeats must
        not stall behind another member's request.
        """
        turn = cache.reading.acquire(timeout=READ_TURN) if wait else cache.reading.acquire(False)
        if not turn and not wait:
            return None
        try:
            if turn and cache.run(self._seq, self._seq + 1):
                return None
            values = self._read_written(self._seq, end, claimed)
            return values, cache.put(self._seq, values)
        finally:
            if turn:
                cache.reading.release()

    def _deliver_run(self, entries: Sequence[Optional[LogEntry]]) -> None:
        """Deliver positions ``self._seq`` .. (None: a skipped one), then move past them."""
        if not entries:
            return  # (a hole being timed stays timed)
        seq = self._seq
        run = [(seq + i, entry) for i, entry in enumerate(entries) if entry is not None]
        if run:
            self._deliver(run)
        self._seq = seq + len(entries)
        self._hole = None

    def _read_written(self, lo: int, hi: int, claimed: int) -> List[str]:
        """The values of the written positions from ``lo`` on (up to the first unwritten);
        ``claimed``: the positions claimed at the catch-up before.

        A store ``multi_get`` waits for absent keys, so a check comes first. While posts
        stream in (a thousand members joining), the newest positions are often still
        being written: so when some were claimed before the last catch-up (long written),
        only those are read, in two requests, and the newer ones next time; a lone new
        event is one ``get``. Halving (log2 checks) only when those
        are not all written: a thousand readers halving every tick saturated the store.
        """
        reg = self._registry
        older = min(hi - lo, claimed - lo)
        if older >= 1:
            hi = lo + older  # the newer ones are read next time (many are being written now)
        keys = [self._keys.log_entry(s) for s in range(lo, hi)]
        if len(keys) > 1 and not reg.present(keys):
            # A new reader, a slow post, or a dead poster's hole: halve (log2 checks, seldom).
            good, bad = 0, len(keys)  # keys[:good] written; keys[:bad] not all written
            while bad - good > 1:
                mid = (good + bad) // 2
                good, bad = (mid, bad) if reg.present(keys[:mid]) else (good, mid)
            keys = keys[:max(good, 1)]
        if len(keys) == 1:
            value = reg.get_or_empty(keys[0])  # one request, never waits
            return [value] if value else []
        try:
            return reg.read(keys)
        except dist.DistStoreError:
            return []  # deleted since the check (this reader fell KEEP ranges behind)

    def _past_hole(self, seq: int, total: int) -> bool:
        """Position ``seq`` is unwritten: catch up from a snapshot if it was deleted, skip
        it once it has been unwritten for ``hole_wait``. False: wait (read on next time).

        A hole near the claims is a post under way; one a range behind them may be a
        deleted position, looked at at once (a reader that slept must not stall).
        """
        now = time.monotonic()
        fresh = self._hole is None or self._hole[0] != seq
        if fresh:
            self._hole = (seq, now)
        overdue = now - self._hole[1] >= self._hole_wait  # type: ignore[index]  # set just above
        if not overdue and not (fresh and total - seq > self._segment):
            return False
        head = self._registry.add(self._keys.log_head(), 0)
        if seq < head * self._segment:  # a snapshotted range was all written: deleted since
            self._skip_ahead(head)
            return True
        if not overdue:
            return False
        value = self._registry.compare_set(self._keys.log_entry(seq), "", SKIP)
        if value == SKIP:
            self.skipped += 1
        self._deliver_run(self._cache.put(seq, [value]))
        return True

    def _start(self) -> None:
        """A new reader begins at the newest snapshot: the members as they stand."""
        if self._server is not None:
            self._cache = shared_cache(self._registry, self._keys, self._server)
        self._started = True
        head = self._registry.add(self._keys.log_head(), 0)
        if head:
            self._resume(head)

    def _resume(self, k: int) -> None:
        kept = self._cache.snapshot(k)
        if kept is None:
            state = Snapshot.decode(self._registry.get_or_empty(self._keys.log_snapshot(k)))
            kept = (state.start, state.entries())
            self._cache.keep_snapshot(k, *kept)
        start, entries = kept
        run = [(seq, entry) for seq, entry in entries if seq >= self._seq]
        if run:
            self._deliver(run)
        self._seq, self._hole = max(self._seq, start), None

    def _skip_ahead(self, head: int) -> None:
        """This reader's positions were deleted (it fell ``KEEP`` ranges behind)."""
        log.warning("machinlike: this member read the event log too slowly (position %d is gone, the newest "
                    "snapshot is range %d); it catches up from there and misses the events in between",
                    self._seq, head)
        self._resume(head)


def _numbered(lo: int, values: List[str]) -> List[Numbered]:
    """The entries among ``values`` (positions ``lo`` ..), skipped positions left out."""
    out: List[Numbered] = []
    for i, value in enumerate(values):
        entry = entry_of(value)
        if entry is not None:
            out.append((lo + i, entry))
    return out

