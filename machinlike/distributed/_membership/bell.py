"""Bell: a departure reaches every member at once, not at its next liveness tick.

A Bell owns one member's rings and counters; a _Hub owns the thread and the store
connection that wait for rings, one per process and world, shared by the members that
process holds (one, in a deployment; hundreds, in the benchmark's simulation and tests).

    a member that posted "lost" or "leave"         the world's store
      ring()   g = add(m/belln, 1)                  m/belln      rings so far
               set m/bell/<g> = "<seq>|<entry>"     m/bell/<g>   set by the g-th ring: the
                                                                 departure it rings for
               fill m/bell/<g-1> with "1" if unset               (or "1": none)
               delete m/bell/<g - KEEP>
    the process's bell thread (a _Hub; listen joins it)
      heard = add(m/belln, 0)
      loop   wait(m/bell/<heard + 1>)               blocked in the store: no CPU and
                                                    no request while nothing happens
             ring, heard, total = multi_get(m/bell/<heard + 1>, m/belln, m/evn)
             the ring's entry is position total - 1, and its members have
             delivered all before it? that is all there is to read; else read
             m/e/<lo> .. m/e/<total - 1> once (check, multi_get), lo the lowest
             position its members have yet to deliver
             each member listening here: closing, or cut off? it leaves the hub;
             else it delivers what is new from those values (EventLog.catch_up;
             the event was posted before its ring); it reads on by itself from
             wherever they stop
             no member left? end
             more than BURST rings within BURST gaps? sleep until the pace is one
             per ``gap`` (the rings in between are found at once after it)

Why: every member reads the log at its liveness tick (every 0.5 s at the default
liveness), so a death its watcher saw at once (a pidfd on the same host) still reached
the others up to a tick later: 0.85 s at the 99th percentile with 1,024 members (issue
37). A faster tick costs every member requests all the time; the bell costs each member
one request that waits, and one catch-up per departure.
Why one thread per process, and one read: a ring woke the hundred-odd member threads of
each of the benchmark's processes at once, and they queued for the process's GIL three
times each (1.04 s p99 at 1,024 members, against 0.86 s with no bell); one thread that
then read the log for each member in turn still took 0.80 s, a request each, each
waiting for the GIL again. The new entries are the same for every member of a process:
read once, they are delivered to all in one go. (With 1,024 simulated members on 2
cores and the departure carried in the ring, four runs gave 0.17-0.66 s at the 99th
percentile. The declarer and this thread still queue for the GIL behind 128 member
threads; see BENCHMARKS.md, session 20.)
Why departures only: a world filling would wake every member at each join (N² catch-ups
while N members join), and nothing fails over on a join; joins are read at the ticks.
Why a pace (a bucket of BURST wakes, refilled one per ``gap``, a tick): deaths one after
another are each read at once, while a long burst wakes each member at most once per
tick, so the store's load during it stays within about twice the steady one. (A plain
sleep of a tick after each wake held the second of two deaths 0.1 s apart for 0.2 s.)
Why the departure in the ring: a wake was four requests (the wait, the counters, a check
and the entries), each one more wait for the GIL of a process with a hundred-odd member
threads; with the entry carried, a lone departure is the wait and one read.
Why the fill of the ring before: waiters wait for ring g, and a ringer that died between
its two requests would leave them waiting for a key nobody writes; the next ring writes
it (after its own: the waiters of ring g wake first). A waiter more than ``KEEP`` rings
behind is impossible: it reads the counter at each wake, and again after a pause.
The wait is bounded by ``WAIT``, long because torch logs a warning at each timed-out wait;
the thread ends at the first ring after its last member's ``closing`` is set (a member's
own "leave" rings; ``stop`` rings once for the last one here when it stops without
leaving), or when the store goes.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
import time
from typing import Callable, Dict, Hashable, List, Mapping, Optional, Tuple

import torch.distributed as dist

from ...exception import PeerLostError
from .._store import Keys, Registry, multi_get, own_client, server_of
from .log_state import SEGMENT

__all__ = ["Bell", "BURST", "KEEP", "WAIT", "hub_count"]

log = logging.getLogger(__name__)

#: EventLog.catch_up as the bell calls it: (the log's counter, wait, positions read).
CatchUp = Callable[[int, bool, Mapping[int, str]], None]

#: Rings kept in the store (older ones are deleted by the ringer).
KEEP = 64
#: The bound on one wait of the bell thread (it waits again after it).
WAIT = datetime.timedelta(hours=1)
#: Timeout of the bell connection's other requests (its counter read), seconds.
REQUEST_TIMEOUT = 10.0
#: Seconds the bell's connection may take to open.
CONNECT_TIMEOUT = 30.0
#: Bound on the read of the ring that woke the thread (it may have been deleted since).
RING_READ = datetime.timedelta(seconds=1)
#: Wakes in a row before the bell keeps to one per ``gap``.
BURST = 4
#: What a ring holds when it carries no departure (a member stopping; a hole's fill).
NONE = "1"


class Bell:
    """Rings on departures; the process's bell thread catches this member up at each ring.

    Args:
        registry: The world's store tables (rings go through it).
        keys: The world's keys.
        store: The world's store; the bell thread opens a connection of its own to it.
        name: This member's name.

    Attributes:
        rings: Departures this member rang.
        ring_failures: Rings that failed (the store was lost mid-ring; the others read
            the event at their next tick).
        wakes: Catch-ups a ring started for this member.
    """

    def __init__(self, registry: Registry, keys: Keys, store: dist.Store, name: str) -> None:
        self._registry = registry
        self._keys = keys
        self._store = store
        self._name = name
        self._hub: Optional[_Hub] = None
        self._listener: Optional[_Listener] = None
        self.rings = 0
        self.ring_failures = 0

    @property
    def wakes(self) -> int:
        return self._listener.wakes if self._listener is not None else 0

    def ring(self, quiet: bool = False, entry: Optional[Tuple[int, str]] = None) -> None:
        """Wake every process's bell thread (after a departure was posted); never raises.

        Args:
            quiet: A failure is counted but not logged (this member is stopping).
            entry: The departure's position in the log and its line (the bell threads
                deliver it without reading the log); None: a ring with none.
        """
        reg, keys = self._registry, self._keys
        try:
            g = reg.add(keys.bell_count(), 1)
            reg.set(keys.bell(g), NONE if entry is None else f"{entry[0]}|{entry[1]}")
            if g > 1:
                reg.compare_set(keys.bell(g - 1), "", NONE)  # (a hole only: a set one stays)
            if g > KEEP:
                reg.delete([keys.bell(g - KEEP)])
            self.rings += 1
        except PeerLostError as err:
            self.ring_failures += 1
            if quiet:
                return
            log.warning("machinlike: member %r could not ring the departure bell (%s); the others read the "
                        "departure at their next liveness tick", self._name, err)

    def listen(self, catch_up: CatchUp, position: Callable[[], int], stopped: Callable[[], bool],
               gap: float) -> None:
        """Be caught up at each ring from now on (once).

        Args:
            catch_up: Delivers what is new up to the position it is given (the log's
                counter), from the values given (read once for the process) and reading
                the rest (``EventLog.catch_up``).
            position: The next position this member delivers (``EventLog.position``).
            stopped: Whether this member is done (closing, or cut off from the world).
            gap: Seconds between two catch-ups the bell starts, at least, after BURST
                in a row.
        """
        if self._listener is not None:
            return
        self._listener = _Listener(catch_up, position, stopped, self.ring)
        self._hub = _join_hub(self._store, self._keys, self._listener, gap)

    def stop(self, timeout: float) -> None:
        """Leave the hub (``closing`` must be set); the last member to leave it rings once
        (its thread waits for a ring), then waits up to ``timeout`` s for the thread."""
        hub, listener = self._hub, self._listener
        if hub is None or listener is None:
            return
        if hub.leave(listener):
            self.ring(quiet=True)
            hub.join(timeout)


class _Listener:
    """One member, as the hub sees it."""

    def __init__(self, catch_up: CatchUp, position: Callable[[], int], stopped: Callable[[], bool],
                 ring: Callable[[bool], None]) -> None:
        self.catch_up = catch_up
        self.position = position
        self.stopped = stopped
        self.ring = ring
        self.wakes = 0


#: (store address, namespace) -> the hub of this process; guarded by _HUBS_LOCK. Bounded
#: by the worlds this process is in: a hub leaves it when its last member does.
_HUBS: Dict[Tuple[Hashable, str], "_Hub"] = {}
_HUBS_LOCK = threading.Lock()
_AT_EXIT = False  # whether _end_at_exit is registered (guarded by _HUBS_LOCK)


def _join_hub(store: dist.Store, keys: Keys, listener: _Listener, gap: float) -> "_Hub":
    global _AT_EXIT
    key = (server_of(store), keys.ns)
    with _HUBS_LOCK:
        if not _AT_EXIT:
            # (registered on first use: atexit runs its hooks last-in first-out, so this
            # runs before the hooks of whatever started the store or torch's RPC earlier)
            atexit.register(_end_at_exit)
            _AT_EXIT = True
        hub = _HUBS.get(key)
        if hub is None or not hub.add(listener):
            hub = _Hub(store, keys, key, gap)
            hub.add(listener)
            _HUBS[key] = hub
            hub.start()
        return hub


def _end_at_exit() -> None:
    """Before the interpreter finalizes: end every bell thread of this process.

    Why: a thread blocked in the store's wait when the process exits gets the connection's
    end (the store server, hosted here, goes in finalization) while Python can no longer
    run it, and torch's C++ then aborts the process ("terminate called without an active
    exception", exit code 134) instead of letting it exit with its own code.
    """
    with _HUBS_LOCK:
        hubs = list(_HUBS.values())
    for hub in hubs:
        hub.end(1.0)


def _carried(value: str) -> Dict[int, str]:
    """The departure a ring's value carries, as {position: line}; empty for NONE."""
    seq, sep, line = value.partition("|")
    return {int(seq): line} if sep and seq.isdigit() else {}


def hub_count() -> int:
    """Bell threads of this process (for tests)."""
    with _HUBS_LOCK:
        return len(_HUBS)


class _Hub:
    """The bell thread of one world in this process, and the members it catches up."""

    def __init__(self, store: dist.Store, keys: Keys, key: Tuple[Hashable, str], gap: float) -> None:
        self._store = store
        self._keys = keys
        self._key = key
        self._gap = gap
        self._lock = threading.Lock()
        self._listeners: List[_Listener] = []
        self._closed = False  # no member left: the thread ends, nobody may join
        self._empty = threading.Event()  # cuts the pacing sleep short when the last one leaves
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"machinlike-bell-{keys.ns}")

    def start(self) -> None:
        self._thread.start()

    def add(self, listener: _Listener) -> bool:
        """Take ``listener`` in; False when this hub is ending (make a new one)."""
        with self._lock:
            if self._closed:
                return False
            self._listeners.append(listener)
            return True

    def leave(self, listener: _Listener) -> bool:
        """Take ``listener`` out; whether the thread now waits to end (ring to end it)."""
        with self._lock:
            if listener in self._listeners:
                self._listeners.remove(listener)
            last = not self._listeners and not self._closed
            if last:
                self._close()
        if last:
            self._discard()
        return last and self._thread.is_alive()

    def end(self, timeout: float) -> None:
        """End the thread although members still listen (the process exits): ring through
        one of them, then wait up to ``timeout`` seconds."""
        with self._lock:
            members, already = list(self._listeners), self._closed
            self._close()
        self._discard()
        if not already and members and self._thread.is_alive():
            members[0].ring(True)
            self.join(timeout)

    def join(self, timeout: float) -> None:
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    def _close(self) -> None:
        """(under the lock) No member left: nobody joins any more, the thread ends."""
        self._closed = True
        self._empty.set()

    def _discard(self) -> None:
        """(after _close, not under the lock: _join_hub takes the two locks the other way
        round) Forget this hub, unless a new one took its place."""
        with _HUBS_LOCK:
            if _HUBS.get(self._key) is self:
                del _HUBS[self._key]

    def _members(self) -> List[_Listener]:
        """The members still listening (the stopped ones leave); none: the hub closes."""
        with self._lock:
            self._listeners = [m for m in self._listeners if not m.stopped()]
            closing = not self._listeners and not self._closed
            if closing:
                self._close()
            members = [] if self._closed else list(self._listeners)
        if closing:
            self._discard()
        return members

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            with self._lock:
                self._close()
            self._discard()

    def _read(self, own: dist.Store, lo: int, total: int) -> Dict[int, str]:
        """Positions ``lo`` .. ``total - 1`` of the log, read once for every member here;
        empty when they are more than a range (a member far behind reads for itself), or
        not all written yet (a post under way: each member's own read handles it)."""
        if not 0 < total - lo <= SEGMENT:
            return {}
        keys = [self._keys.log_entry(seq) for seq in range(lo, total)]
        if not own.check(keys):
            return {}
        return {lo + i: v.decode() for i, v in enumerate(multi_get(own, keys))}

    def _serve(self) -> None:
        # The connection is made here: a member's join never waits on it. Opening it may
        # take longer than a request (a name lookup the resolver lost: see _store.client).
        try:
            own = own_client(self._store, datetime.timedelta(seconds=REQUEST_TIMEOUT),
                             datetime.timedelta(seconds=CONNECT_TIMEOUT))
        except (dist.DistError, RuntimeError, OSError) as err:
            log.warning("machinlike: the departure bell of %s could not connect to the store (%s); "
                        "departures are heard at the liveness ticks only", self._keys.ns, err)
            return
        if own is None:
            return  # a store that cannot be reached anew (a test's HashStore): ticks alone
        count, log_count = self._keys.bell_count(), self._keys.log_count()
        try:
            heard = own.add(count, 0)
            own.add(log_count, 0)  # (exists from now on: multi_get waits for absent keys)
            tokens, stamp = float(BURST), time.monotonic()
            while self._members():
                try:
                    own.wait([self._keys.bell(heard + 1)], WAIT)
                except dist.DistStoreError:
                    continue  # WAIT passed with no departure: wait again
                try:
                    # A read of a key waits for it: that ring, deleted because KEEP more
                    # came since the wait ended (a burst while this thread starved), held
                    # the thread REQUEST_TIMEOUT. A short bound: then the counters alone.
                    own.set_timeout(RING_READ)
                    try:
                        carried, rung, counted = (v.decode() for v in multi_get(
                            own, [self._keys.bell(heard + 1), count, log_count]))
                    finally:
                        own.set_timeout(datetime.timedelta(seconds=REQUEST_TIMEOUT))
                except dist.DistStoreError:
                    carried, rung, counted = NONE, *(v.decode() for v in multi_get(own, [count, log_count]))
                heard, total = int(rung), int(counted)
                members = self._members()
                lo = min((m.position() for m in members), default=total)
                known = _carried(carried)
                if lo not in known or total != lo + 1:  # more than the ring's own entry to read
                    known = self._read(own, lo, total)
                for member in members:
                    try:
                        member.catch_up(total, True, known)
                        member.wakes += 1
                    except PeerLostError:
                        pass  # its monitor reports the store's loss; it stops listening then
                    except Exception:  # one member's failure must not deafen the others
                        log.exception("machinlike: catching a member up with the event log at a departure")
                now = time.monotonic()
                tokens, stamp = min(float(BURST), tokens + (now - stamp) / self._gap) - 1.0, now
                if tokens < 0.0:
                    self._empty.wait(-tokens * self._gap)
                    # Rings that came during the pause are read at once, from the newest
                    # (over KEEP of them, the one after ``heard`` would be deleted: a wait
                    # for it would last WAIT).
                    heard = max(heard, own.add(count, 0) - 1)
        except (dist.DistError, RuntimeError, OSError) as err:
            # The store went, or this connection did: the liveness ticks still read the log.
            log.debug("machinlike: the departure bell of %s stopped: %s", self._keys.ns, err)
