"""Watch: which members this member's liveness thread checks, and how it reads them.

Two strategies, chosen once per process (``MACHINLIKE_LIVENESS_WATCH``, read when a World
starts; the benchmark ``benchmarks/liveness_scale.py`` runs both side by side):

    "ring" (default)  each member checks the next ``k`` live members after it in ring
                      order (its successors; names ordered by a stable hash of each,
                      ``roster.ring_key``), wrapping round:

                          a ──► b ──► c ──► d ──► e ──► a      (k = 1 drawn; k = 3 by
                                                                 default: dead watchers
                                                                 seldom blind the ring,
                                                                 and it looks past the
                                                                 silent: RingWatch)
                      one tick = add(m/hb/<me>)                          1 request
                                 multi_get(m/evn, m/hb/<s1>, .. <sk>)     1 request
                      the log counter rides in the same multi_get, so catching up
                      with the log costs nothing more unless an event was posted.
                      A loss found is declared through the one-winner election
                      (``m/lost/...``) and posted to the log, which every member reads.

    "all"             every member reads every other member's heartbeat each tick
                      (check + multi_get of N-1 keys) and catches up with the log on
                      its own (add m/evn): 4 requests and N-1 key reads per tick.
                      The design before issue 37, kept to be measured against.

Why a ring: the store is one thread. With "all", key reads grow as N² (8.4 M/s at 1,024
members); with the ring every member reads k + 1 keys per tick whatever N is, and a
death still reaches everyone within one more tick, through the log they already read.
Why successors in ring order: every view orders the same names the same way, with no
coordination; the views agree once they have read the same events. Why a hash of the
name, not the name: names come in runs (joiners numbered in sequence, a host's members
named alike); in name order a run of joiners kept changing the watchers of the members
after it, and a host's members died as one block of neighbours.

Why the silence bound is shorter for the ring: a loss is seen by a watcher, then by
everyone one tick later, so the ring declares after ``min(3/4, 1 - 3 ticks/liveness)`` of
``liveness`` (1.25 s of 2 s) to name the death to all within ``liveness``.

A key this strategy reads with ``multi_get`` must exist (a store ``get`` waits for an
absent key): a member's heartbeat and the log counter are read one by one (a probe that
never waits) until seen once, and the multi_get runs on a connection of its own with a
short timeout, after which that tick falls back to the probes (counted in ``fallbacks``).
"""

from __future__ import annotations

import datetime
import os
import time
from typing import List, Optional, Sequence, Set, Tuple

import torch.distributed as dist

from .._store import Keys, MemberRecord, Registry, multi_get, own_client
from .event_log import EventLog
from .processes import DEFAULT_LIVENESS, tick_of
from .roster import Roster

__all__ = ["Watch", "RingWatch", "AllWatch", "watch_from_env", "WATCH_ENV", "RING_K", "RING_MAX"]

#: Environment variable choosing the strategy: ``ring`` (default) or ``all``.
WATCH_ENV = "MACHINLIKE_LIVENESS_WATCH"
#: Successors each member watches in the ring. 3, not 2: at 10 deaths a second among
#: 1,024 members, a death's 2 watchers both died before declaring it in 2% of deaths,
#: and its next watcher timed it from scratch (benchmarks/liveness_scale.py --churn).
RING_K = 3
#: Successors a member watches at most while some of them are silent (k plus two per
#: silent one: see RingWatch); a bound on one multi_get's size.
RING_MAX = 256

# Ticks between tries to open the multi_get's connection after one failed. Why not every
# tick: a try can hold the monitor for the resolver's timeout (the store client looks up
# the store's name on each connection, 5 s where a query is lost), and where every try
# failed (a resolver slower than the short timeout) the tick raised each time: no key
# was read and a traceback was logged at every tick. Meanwhile the keys are read one by one.
RECONNECT_TICKS = 16


class Watch:
    """A liveness-watch strategy (see the module doc).

    ``tick`` catches this member up with the event log and returns the members it checks
    this tick with their heartbeat counters as the store holds them ("" when absent).
    """

    #: Store requests the strategy sent, and keys it read (for benchmarks and tests).
    requests = 0
    key_reads = 0

    def tick(self, me: str, past: int = 0) -> Tuple[List[MemberRecord], List[str]]:
        """Catch up and read the watched members' heartbeats; ``past``: how many of the
        members watched last tick are silent (the ring watches two more for each)."""
        raise NotImplementedError

    def silence(self, liveness: Optional[float]) -> float:
        """Seconds a remote member's heartbeat may stall before it is declared lost."""
        return 0.75 * (liveness or DEFAULT_LIVENESS)

    def connect(self) -> None:
        """Open what the ticks need (the liveness thread calls it first; never raises)."""

    def disconnect(self) -> None:
        """Close what :meth:`connect` opened (the liveness thread calls it last)."""

    @property
    def connected(self) -> bool:
        """Whether what :meth:`connect` opens is open."""
        return True


class AllWatch(Watch):
    """Every member reads every other member's heartbeat each tick (the design before #37).

    Args:
        registry: The world's store tables.
        keys: The world's keys.
        roster: Who is live.
        events: The event log (caught up each tick).
    """

    def __init__(self, registry: Registry, keys: Keys, roster: Roster, events: EventLog) -> None:
        self._registry = registry
        self._keys = keys
        self._roster = roster
        self._events = events
        self.requests = 0
        self.key_reads = 0

    def tick(self, me: str, past: int = 0) -> Tuple[List[MemberRecord], List[str]]:
        self._events.catch_up()
        others = self._roster.others(me)
        self.requests += 1
        self.key_reads += 1
        if not others:
            return [], []
        self.requests += 2  # check + multi_get
        self.key_reads += 2 * len(others)
        return others, self._registry.values_or_empty(self._keys.heartbeat_prefix(), [r.member for r in others])


class RingWatch(Watch):
    """Each member reads its ``k`` successors' heartbeats and the log counter in one request,
    and two successors more for each watched member that is silent.

    Why the more: a dead member's watchers are the members before it. When they died too
    and are not yet declared (a host's members dying together; or heavy churn), nobody
    timed it: the ring learned of it only once they were declared, a
    silence bound later, and a block of b dead members took b/k bounds. Looking past the
    silent ones (as the monitor counts them: silent for a quarter of the bound, 2 ticks at
    least) starts a timer on the members behind them within a fraction of the bound.

    Args:
        registry: The world's store tables (the one-by-one probes).
        keys: The world's keys.
        roster: Who is live (its ``version`` says when to recompute the successors).
        events: The event log (caught up with the counter read here).
        store: The world's store; cloned once for this strategy's multi_get.
        liveness: The world's liveness bound (seconds; sets the multi_get's timeout).
        k: Successors watched.

    Attributes:
        fallbacks: Ticks whose multi_get found a key absent (timed out) and fell back.
        connect_failures: Tries to open the multi_get's connection that failed (each
            followed by ``RECONNECT_TICKS`` ticks of one-by-one reads).
    """

    def __init__(self, registry: Registry, keys: Keys, roster: Roster, events: EventLog, store: dist.Store,
                 liveness: Optional[float], k: int = RING_K) -> None:
        if k < 1:
            raise ValueError(f"k={k}: a ring watches at least one successor")
        self._registry = registry
        self._keys = keys
        self._roster = roster
        self._events = events
        self._store = store
        self._timeout = datetime.timedelta(seconds=max(0.2, 2 * tick_of(liveness)))
        self._fast: Optional[dist.Store] = None  # the clone with the short timeout (made on first use)
        self._tick = tick_of(liveness)
        self._retry_at = float("-inf")  # (monotonic) the next try to open _fast, after one failed
        self._k = k
        self._want = k  # successors watched now: k, and two per silent one
        self._version = -1
        self._watched: List[MemberRecord] = []
        self._keys_read: List[str] = []  # the log counter's key, then the watched heartbeats'
        self._seen: Set[str] = set()  # keys seen to exist (multi_get may read them); bounded by k + 1
        self._all_seen = False  # every key of _keys_read is in _seen
        self.requests = 0
        self.key_reads = 0
        self.fallbacks = 0
        self.connect_failures = 0

    def silence(self, liveness: Optional[float]) -> float:
        bound = liveness or DEFAULT_LIVENESS
        return max(4 * tick_of(liveness), min(0.75 * bound, bound - 3 * tick_of(liveness)))

    def connect(self) -> None:
        """Open the connection of its own now, not at a tick in the middle of the run.

        Why: the store server looks up each new client's host name on its one thread; a
        lookup the resolver drops stalls every member's requests (1 s with the tests'
        RES_OPTIONS, 5 s by default). Better at the start than mid-run, where the stall
        delayed a departure by a second.
        """
        if self._fast is None:
            try:
                self._fast = own_client(self._store, self._timeout)
            except (dist.DistError, RuntimeError, OSError):
                # (the store is going, and the ticks' probes say so; or it answered too late)
                self.connect_failures += 1
                self._retry_at = time.monotonic() + RECONNECT_TICKS * self._tick

    def disconnect(self) -> None:
        # (dropping the client closes its socket: torch's TCPStore has no close)
        self._fast = None

    @property
    def connected(self) -> bool:
        return self._fast is not None

    def successors(self, me: str, past: int = 0) -> List[MemberRecord]:
        """The (at most ``k`` + 2 x ``past``, and ``RING_MAX``) live members after ``me`` in
        ring order, wrapping round."""
        version = self._roster.version
        # (two more per silent one: the list triples at each look while all are silent, so
        # a block of b dead members is passed in about log3(b) looks, not b/k; the extra
        # keys ride in the same multi_get, and only while some are silent)
        want = min(self._k + 2 * max(0, past), RING_MAX)
        if version != self._version or want != self._want:
            # (by bisection of the roster's sorted names: it runs at every tick while
            # members join, and a pass over all members cost N per member per tick)
            after = self._roster.successors(me, want)
            self._watched = after
            self._version = version
            self._want = want
            # The keys a tick reads, made once per roster change (not at every tick).
            self._keys_read = [self._keys.log_count()] + [self._keys.heartbeat(r.member) for r in after]
            self._seen &= set(self._keys_read)
            self._all_seen = False
        return self._watched

    def tick(self, me: str, past: int = 0) -> Tuple[List[MemberRecord], List[str]]:
        watched = self.successors(me, past)
        keys = self._keys_read
        values: Optional[List[str]] = None
        if not self._all_seen:
            self._all_seen = all(key in self._seen for key in keys)
        if self._all_seen:
            values = self._multi_get(keys)
        if values is None:  # a key not yet seen (a new successor), or the multi_get timed out
            values = []
            for key in keys:
                self.requests += 1
                self.key_reads += 1
                if key == keys[0]:
                    value = str(self._registry.add(key, 0))  # creates the counter
                else:
                    value = self._registry.get_or_empty(key)
                if value:
                    self._seen.add(key)
                values.append(value)
        self._events.catch_up(int(values[0] or 0), wait=False)  # (another thread may be reading it)
        return watched, values[1:]

    def _multi_get(self, keys: Sequence[str]) -> Optional[List[str]]:
        if self._fast is None:
            if time.monotonic() < self._retry_at:
                return None  # (the last try failed: one by one until the next)
            self.connect()
            if self._fast is None:
                return None  # not a TCPStore (a test's HashStore), or it failed: one by one
        self.requests += 1
        self.key_reads += len(keys)
        try:
            return [v.decode() for v in multi_get(self._fast, keys)]
        except dist.DistStoreError:
            # A key was deleted since it was seen (a member gone for many departures):
            # read them one by one this tick, and learn again which exist.
            self.fallbacks += 1
            self._seen.clear()
            self._all_seen = False
            return None
        except (dist.DistNetworkError, ConnectionError):
            self._fast = None
            return None  # the probes raise PeerLostError if the store is really gone


def watch_from_env(registry: Registry, keys: Keys, roster: Roster, events: EventLog, store: dist.Store,
                   liveness: Optional[float]) -> Watch:
    """The strategy ``MACHINLIKE_LIVENESS_WATCH`` names (``ring`` by default).

    Raises:
        ValueError: the variable names no strategy.
    """
    text = os.environ.get(WATCH_ENV, "ring").strip().lower()
    if text == "ring":
        return RingWatch(registry, keys, roster, events, store, liveness)
    if text == "all":
        return AllWatch(registry, keys, roster, events)
    raise ValueError(f"{WATCH_ENV}={text!r} names no liveness watch; use 'ring' (the default) or 'all'")
