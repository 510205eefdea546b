"""Membership: who is in the world, alive or not, and who owns which registry key.

The composition root of one member's view of the world. It builds the parts below once,
hands each its collaborators, and wires the one path they share: an event read from the
log is applied to the Roster, then ends the Waits that need a departed member, then
reaches the subscribers.

    Membership ─┬─ Registry   the store's tables, one round trip each          (_store.registry)
                ├─ Roster     live members, workers, gone, callbacks; its lock (_membership.roster)
                ├─ Waits      store waits and pending calls, ended when a
                │             member they need goes                            (_membership.waits)
                ├─ Endpoint   this member: incarnation, RPC worker, listener   (_membership.endpoint)
                ├─ Claims     registry keys this member holds; their lock      (_membership.claims)
                ├─ EventLog   post / read the event log in one order           (_membership.event_log)
                │  ├─ LogCache  positions read once for the members of this
                │  │            process (shared, per log)                      (_membership.log_cache)
                │  └─ Bell    rung on a departure, carrying it; its thread
                │             delivers it at once                              (_membership.bell)
                ├─ (StoreWatch: one per store in the process) a store that
                │             stops answering is lost like a dead one          (_membership.store_watch)
                ├─ Monitor    the liveness thread; declares and frees the lost (_membership.monitor)
                │  └─ PidWatch  its sleep, cut short by a watched process's
                │               exit on this host                              (_membership.pidwatch)
                └─ ServerNotesPublisher  this member's servers' numbers, for the
                              status view; a thread only while a server lives  (_membership.server_notes)

    EventLog.catch_up ─► _deliver(run) ─► Roster.apply ─► Waits.on_gone ─► Roster.publish
                                       (a stretch of joins: Roster.apply_joins, one lock)

Why this cut: each part owns one lock or none, and the state each lock guards sits in
the same object (the Roster's lock guards the tables ``wait_until`` reads; the Claims
lock makes "claim" and "move to a new worker" exclusive). The review's separate
``Liveness`` became the Monitor, which also declares the lost, since both the tick and
the declaration read the same heartbeat table. Parts talk only through what they were
given in their constructors; none reaches back into this root.

Why the store and not RPC: the store is torch's C++ server, reachable while any member
lives, and its compare-and-set gives one winner for every claim without a coordinator.
Every key is spelled in ``_store.keys``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch.distributed as dist

from ...exception import PeerLostError
from .. import _transport
from .bell import Bell
from .claims import Claims
from .departures import Departures
from .endpoint import Endpoint
from .event_log import EventLog
from .log_state import Numbered
from .._store import ExitRecord, Keys, LogEntry, MemberRecord, server_of
from .processes import alive_here, is_here, pid_in, tick_of
from .member_event import MemberEvent
from .monitor import Monitor
from .._transport import PipeLedger, recycle_after
from .._store import STORE_OF_RANK0, Registry
from ..._deadline import deadline_left
from .roster import Roster
from .server_notes import ServerNotesPublisher, stats_interval
from .stops import Stops
from .store_watch import watch_store
from .waits import Waits
from .watch import watch_from_env
from .pidwatch import PidWatch, WakingEvent
from .rank_claim import claim_rank

__all__ = ["Membership", "MemberEvent"]

log = logging.getLogger(__name__)

_new_event = tuple.__new__


class Membership:
    """This process's view of the world's members, and its handle on the shared tables.

    ``World.membership`` returns it. The documented queries are :meth:`members`,
    :meth:`incarnation_of`, :meth:`incarnations`, :meth:`gone`, :meth:`subscribe`,
    :meth:`unsubscribe` and :meth:`wait_until`.

    Args:
        store: The world's store.
        keys: The keys of this world in the store.
        store_owner: Who hosts the store, for error messages.
        name: This member's name.
        liveness: Seconds within which a dead member is detected; None: no monitor.
        elastic: Whether RPC is a dynamic agent group (members may join and leave).
    """

    def __init__(self, store: dist.Store, keys: Keys, store_owner: str, name: str,
                 liveness: Optional[float], elastic: bool) -> None:
        notes_interval = stats_interval()  # (first: a bad setting is told before anything opens)
        self.name = name
        self.elastic = elastic
        self.liveness = liveness
        # When this member had read the log of the world it joined (departures this view
        # saw until then happened before it came, at a time it does not know)
        self._caught_up_at = time.monotonic()
        self.keys = keys
        self.registry = Registry(store, store_owner)
        #: Called after a member (not a move) left, before the event is published: the
        #: Session sweeps the results kept here for handles held only by the gone member.
        self.on_departure: Optional[Callable[[], None]] = None
        # The liveness thread's sleep, cut short by a watched process's exit on this host;
        # closing ends it too (a WakingEvent).
        pids = PidWatch()
        # Set when this member leaves or stops: ends the monitor and any pause.
        self._closing: threading.Event = WakingEvent(pids)
        # Shared by the roster (tells it who went) and the endpoint (recycles the agent).
        pipes = PipeLedger(recycle_after() if elastic else 0)
        self.roster = Roster(pipes)
        self.waits = Waits(self.registry, self.roster, None if elastic else Stops(self.registry, keys, self.roster))
        self.roster.when_cut_off(self.waits.on_cut_off)
        self.endpoint = Endpoint(self.registry, keys, store, name, self._closing, liveness, pipes)
        self.claims = Claims(self.registry, keys, self.endpoint)
        # Rung after each departure this member posts; its thread reads the log at each ring.
        self.bell = Bell(self.registry, keys, store, name)
        self.events = EventLog(self.registry, keys, self._deliver, bell=self.bell, server=server_of(store))
        self.roster.refresh_with(self.catch_up)
        self.departures = Departures(self.registry, keys)
        # Whom the liveness thread checks: k successors in a ring by default (see watch).
        watch = watch_from_env(self.registry, keys, self.roster, self.events, store, liveness)
        self.monitor = Monitor(self.registry, keys, self.roster, self.events, self.claims, self.endpoint,
                               self.departures, liveness, elastic, self._closing, watch, pids)
        self.monitor.ticked = self.waits.check_stops
        self._store = store
        #: Where this member's servers hand their numbers for the status view (``add``).
        self.server_notes = ServerNotesPublisher(store, keys, name, lambda: self.endpoint.incarnation,
                                                 notes_interval)
        # Leaves this process's watch of the store (see start_liveness).
        self._unwatch_store: Callable[[], None] = lambda: None

    def _deliver(self, run: Sequence[Numbered]) -> None:
        """Apply a run of the log's entries (position, entry), in order, and publish them.

        A stretch of joins is applied at once (Roster.apply_joins), then published; any
        other event is applied and published alone, so that a departure's clean-up and
        its subscribers see the roster as of that event.
        """
        i, size = 0, len(run)
        while i < size:
            j = i
            while j < size and run[j][1].kind == "join":
                j += 1
            if j > i + 1:
                self._deliver_joins(run[i:j])
                i = j
            else:
                self._deliver_one(run[i][1], run[i][0])
                i += 1

    def _deliver_joins(self, joins: Sequence[Numbered]) -> None:
        newest = -1
        for _, entry in joins:
            number = _transport.worker_seq(entry.record.worker)
            if number is not None and number > newest:
                newest = number
        if newest >= 0:
            self.endpoint.note_seq(newest)
        fresh = self.roster.apply_joins([entry.record for _, entry in joins])
        self._name_store_host(entry.record for _, entry in joins)
        publish = self.roster.publish
        for (seq, entry), told in zip(joins, fresh):
            if told:
                rec = entry.record
                # (tuple.__new__: the named tuple's own __new__ is a Python function, and
                # twice the cost of this once per event per member)
                publish(_new_event(MemberEvent, ("join", rec.member, rec.incarnation, rec.rank, seq)))

    def _deliver_one(self, entry: LogEntry, seq: int) -> None:
        rec = entry.record
        if entry.kind in ("join", "move"):
            number = _transport.worker_seq(rec.worker)  # (not ``seq``: the worker's own)
            if number is not None:  # (an elastic worker: see Endpoint.aged)
                self.endpoint.note_seq(number)
        workers = self.roster.apply(entry.kind, rec)
        if workers is None:
            return
        if entry.kind == "join":
            self._name_store_host((rec,))
        if entry.kind != "join":
            # The gone worker stays in this process's RPC agent: see _transport's "why".
            self.waits.on_gone(rec, workers)
            if entry.kind == "lost" and is_here(rec.identity):
                # A process of this host declared lost but still there (stopped by a
                # signal) closes no socket: calls pending on its lane end here.
                lane = _transport.lane.current()
                if lane is not None:
                    lane.abandon(pid_in(rec.identity), f"member {rec.member!r} was declared lost")
            hook = self.on_departure
            if entry.kind != "move" and hook is not None:
                hook()  # the results only it held go with it
        self.roster.publish(MemberEvent(entry.kind, rec.member, rec.incarnation, rec.rank, seq))

    def _name_store_host(self, joined: Iterable[MemberRecord]) -> None:
        """Errors about the store name the member that hosts it, once its join is read.

        Why: an elastic world's store is served by the member started with ``rank=0``,
        and "member 'rank 0' is unreachable" sent users looking for a member of that
        name. The rank alone does not tell: a member given no rank takes its worker's
        sequence number, 0 for the first on a store nobody of the world hosts (a
        launcher's, a hand-started one). So a rank-0 join costs one read of the name
        the host posted before its join (``note_store_host``).
        """
        if self.registry.store_owner != STORE_OF_RANK0:
            return
        for rec in joined:
            if rec.rank == 0 and self.registry.get_or_empty(self.keys.store_host()) == rec.member:
                self.registry.name_store_owner(rec.member)
                return

    def note_store_host(self) -> None:
        """This member's process hosts the store: say so before its join is posted."""
        self.registry.set(self.keys.store_host(), self.name)
        self.registry.name_store_owner(self.name)

    # ------------------------------------------------------------------ entry
    def enter(self, rank: Optional[int], deadline: float) -> None:
        """Claim this member's name for a new incarnation (elastic worlds).

        A record left by a dead incarnation is taken over once that one is declared lost.

        Raises:
            ValueError: a live member already uses the name, or the given ``rank`` (named).
            TimeoutError: the previous incarnation's clean-up did not finish in time.
        """
        mine = self.endpoint.new_incarnation(rank)
        while True:
            held = self.registry.claim(self.keys.live(self.name), mine.encode())
            if held is None:
                break
            old = MemberRecord.decode(self.name, held)
            if self.monitor.record_alive(old, wait=min(deadline_left(deadline), self.monitor.lease())):
                raise ValueError(f"a member named {self.name!r} is alive in this world (incarnation "
                                 f"{old.incarnation}, rank {old.rank}); pick another name or stop it first")
            self.monitor.declare(old, deadline, why="found dead by its next incarnation")
            # The claim this process read belongs to a process that is not alive and is
            # declared lost now: clear exactly that text, in case the declarer's view of it
            # was stale, so that the next claim wins instead of finding it again.
            self.registry.compare_set(self.keys.live(self.name), held, "")
        self.endpoint.claimed(mine)
        try:
            claim_rank(mine, rank is not None, self.registry, self.keys, self.claims, self.endpoint, self.monitor,
                       deadline)
        except BaseException:
            # Not entered: the name is free again for whoever (or whenever) is right.
            self.registry.compare_set(self.keys.live(self.name), self.endpoint.me.encode(), "")
            raise
        # The loss keys of the incarnation before last: nobody declares that one any more
        # (the last one was declared, or left, before this claim won). Left, every death
        # would leave three keys for good.
        older = mine.incarnation - 2
        if older >= 1:
            self.registry.delete([self.keys.lost(self.name, older), self.keys.lost_posted(self.name, older),
                                  self.keys.gone(self.name, older)])

    def join_rpc(self, threads: int, timeout: float, deadline: float, default_timeout: float,
                 transports: Optional[List[str]] = None) -> None:
        """Join the dynamic RPC group after :meth:`enter` (``Endpoint.join``'s arguments).

        A retried attempt's fresh worker takes over what :meth:`enter` claimed under the
        first one (the rank), as an agent renewal's does.
        """
        claims, endpoint = self.claims, self.endpoint
        endpoint.join(threads, timeout, deadline, default_timeout, transports,
                      rename=lambda: claims.renewed(endpoint.renamed))

    def enter_static(self, rank: int, names: Sequence[str], identities: Sequence[str]) -> None:
        """Record the members of a static world (rank ``i`` is ``names[i]``)."""
        records = [MemberRecord(member, 1, member, r, identity)
                   for r, (member, identity) in enumerate(zip(names, identities))]
        self.roster.seed_static(records)
        self.endpoint.enter_static(rank, records[rank])
        if self.registry.store_owner == STORE_OF_RANK0:
            # (errors about the store then name the member that hosts it, as others do)
            self.registry.name_store_owner(names[0])

    def announce(self) -> None:
        """Post this member's "join" and start the monitor."""
        if self.liveness is not None:
            self.monitor.beat()  # its watchers read the heartbeat key as soon as they see the join
        self.events.post("join", self.endpoint.me)
        self.start_liveness()
        self._caught_up_at = time.monotonic()

    def start_liveness(self) -> None:
        """Catch up with the log, start the liveness thread and the bell's (none without
        liveness)."""
        self.monitor.start()
        if self.liveness is not None:
            # A store that stops answering is lost like one that died (torch's client
            # would wait for it for good): see store_watch.
            monitor = self.monitor
            self._unwatch_store = watch_store(self._store, self.registry, self.liveness,
                                              lambda: monitor.store_answered, self._closing)
            events = self.events
            self.bell.listen(events.catch_up, lambda: events.position, self._stopped, tick_of(self.liveness))

    def _stopped(self) -> bool:
        return self._closing.is_set() or self.roster.cut_off is not None

    # ------------------------------------------------------------------ leave
    def leave(self, deadline: float) -> None:
        """Leave the world on purpose: free this member's keys, tell the others."""
        self._closing.set()
        self.server_notes.close(min(deadline_left(deadline), 1.0))
        self.monitor.join(max(0.0, min(deadline_left(deadline), 5.0)))
        self._unwatch_store()
        if self.roster.cut_off is not None:
            return
        try:
            released = self.monitor.free(self.endpoint.me, deadline)
            self.events.post("leave", self.endpoint.me)
            self.departures.record(self.name, self.endpoint.incarnation, released)
        except (PeerLostError, TimeoutError) as err:
            log.warning("machinlike: member %r leaves without telling the others: %s", self.name, err)

    def close(self) -> None:
        """Stop the monitor and leave the bell (local teardown: posts nothing; the last
        member of this process to leave the bell rings it once, so that its thread ends)."""
        self._closing.set()
        self.server_notes.close(1.0)
        self.monitor.join(5.0)
        self._unwatch_store()
        self.bell.stop(2.0)
        self.registry.close()

    # ------------------------------------------------------- documented queries
    def members(self) -> List[str]:
        """Names of the live members, sorted."""
        return self.roster.members()

    def incarnation_of(self, member: str) -> Optional[int]:
        """The incarnation of live ``member``; None when it is not live."""
        return self.roster.incarnation_of(member)

    def incarnations(self, members: Iterable[str]) -> Dict[str, int]:
        """The current incarnation of each live member among ``members``."""
        return self.roster.incarnations(members)

    def gone(self, member: str) -> Optional[str]:
        """``"left"`` or ``"lost"`` when ``member``'s latest incarnation is gone, else None."""
        return self.roster.gone(member)

    def may_run(self, member: str, incarnation: int) -> bool:
        """Whether incarnation ``incarnation`` of ``member``, named by a call it made, may still
        run: live here, or newer than this view knows (it joined since the last catch-up)."""
        return self.roster.may_run(member, incarnation)

    def departure(self, member: str) -> Optional[Tuple[str, bool]]:
        """How ``member``'s latest incarnation went, for a message ("left the world 2.5 s
        ago, cleanly (...)", "was lost 0.3 s ago: killed by signal SIGKILL (9)"), and whether
        it left cleanly (raised nothing: no launcher restarts it); None while it is live or
        when this view never saw it. One store read (its exit cause): error paths only."""
        gone = self.roster.departed(member)
        if gone is None:
            return None
        kind, incarnation, when = gone
        try:
            record = ExitRecord.decode(self.registry.get_or_empty(self.keys.exit_cause(member)))
        except PeerLostError:  # (the store is gone: say what this view knows)
            record = None
        cause = record.cause if record is not None and record.incarnation == incarnation else ""
        ago = ("before this member joined" if when <= self._caught_up_at
               else f"{time.monotonic() - when:.1f} s ago")
        if kind == "lost":
            return f"was lost {ago}{': ' + cause if cause else ''}", False
        if cause:
            return f"left the world {ago}, after it {cause}", False
        return f"left the world {ago}, cleanly (it returned or stopped)", True

    def wait_live(self, names: Set[str], timeout: float) -> List[str]:
        """Block until every one of ``names`` is live; the live members then, sorted
        (``World.wait_for_members``).

        One that left cleanly fails the wait at once: it comes back only if started again
        by hand. One that was lost, or left after raising, is waited for (a launcher with
        ``max_restarts`` restarts it under its name); a timeout then says how it went.

        Raises:
            PeerLostError: one of ``names`` left cleanly (named, with when).
            TimeoutError: not all live within ``timeout`` (each missing one said).
        """
        deadline = time.monotonic() + timeout
        judged: Dict[str, Tuple[str, int, float]] = {}  # departures already looked at
        departed = self.roster.departed

        def reached(live: List[str]) -> bool:
            return names <= set(live) or any(departed(n) not in (None, judged.get(n)) for n in names)

        while True:
            try:
                live = self.roster.wait_until(reached, deadline_left(deadline))
            except TimeoutError:
                live = self.roster.members()
                missing = sorted(names - set(live))
                if not missing:
                    return live
                said = [f"{n!r} {how[0]}" for n in missing for how in [self.departure(n)] if how is not None]
                raise TimeoutError(f"wait_for_members: waited {timeout:g} s for {missing} to be live, not yet"
                                   f"{': ' + '; '.join(said) + ', and not back' if said else ''} (live: {live})"
                                   ) from None
            if names <= set(live):
                return live
            for name in sorted(names):
                gone = departed(name)
                if gone is None or judged.get(name) == gone:
                    continue
                judged[name] = gone
                how = self.departure(name)
                if how is not None and how[1]:
                    raise PeerLostError(name, f"wait_for_members: it {how[0]}; a member that left is live again "
                                              f"only if started again under its name (launch() restarts a rank "
                                              f"that raised or died, not one that returned)")

    def subscribe(self, callback: Callable[[MemberEvent], None]) -> None:
        """Call ``callback(event)`` on every join, leave and loss from now on."""
        self.roster.subscribe(callback)

    def unsubscribe(self, callback: Callable[[MemberEvent], None]) -> None:
        """Stop calling ``callback`` (no error if it was not subscribed)."""
        self.roster.unsubscribe(callback)

    def wait_others_gone(self, timeout: float) -> None:
        """After :meth:`leave` (the monitor is stopped): wait until every other member left
        or is known dead, reading the log and the claims itself.

        Why not :meth:`wait_until`: with the monitor stopped nobody catches up with the log
        any more, so the store's host waited its whole stop timeout (30 s) for a member
        that had left at once (benchmarks/soak.py's probe, every run).

        Raises:
            TimeoutError: some are still there after ``timeout`` seconds (named).
        """
        deadline = time.monotonic() + timeout
        while True:
            self.events.catch_up()
            remaining = [rec.member for rec in self.roster.others(self.name)
                         if self._claim_held(rec) and alive_here(rec.identity) is not False]
            if not remaining or time.monotonic() >= deadline:
                break
            time.sleep(min(0.05, deadline_left(deadline)))  # a poll: no event tells of a claim cleared
        if remaining:
            raise TimeoutError(f"members {sorted(remaining)} were still in the world after {timeout:g} s")

    def _claim_held(self, rec: MemberRecord) -> bool:
        """Whether ``rec``'s incarnation still holds its claim (under any worker: it may
        be renewing its agent)."""
        held = self.registry.get_or_empty(self.keys.live(rec.member))
        return bool(held) and MemberRecord.decode(rec.member, held).incarnation == rec.incarnation

    def wait_until(self, predicate: Callable[[List[str]], bool], timeout: float) -> List[str]:
        """Block until ``predicate(live members)`` holds; return the members then.

        Raises:
            TimeoutError: it did not hold within ``timeout`` seconds.
        """
        return self.roster.wait_until(predicate, timeout)

    # ----------------------------------------- what the servers and tools ask
    def worker_of(self, member: str) -> str:
        """The RPC worker name of live ``member`` (PeerLostError when it is gone)."""
        return self.roster.worker_of(member)

    def catch_up(self, within: float = 0.0) -> bool:
        """Read the world's log now (this view is otherwise up to a liveness tick behind);
        False when the store could not be read (the view stays as it was).

        ``within``: seconds to wait for another thread's catch-up to end first (it may have
        read the log's counter before the entry the caller needs). 0: never waits: what that
        thread reads reaches this view soon. A callback's catch-up, on the thread delivering
        an event (the log's lock is not reentrant), returns at once either way.
        """
        try:
            if within > 0:
                self.events.catch_up(within=within)
            else:
                self.events.catch_up(wait=False)
        except Exception as err:  # (the store is going, or this member stopped)
            log.debug("machinlike: could not read the world's log now: %s", err)
            return False
        return True

    def worker_gone(self, worker: str) -> bool:
        """Whether RPC worker ``worker`` left, was lost or was replaced (this view)."""
        return self.roster.worker_gone(worker)

    def worker_dead(self, worker: str) -> bool:
        """Whether RPC worker ``worker`` is gone, asking the store when this view has not seen it yet.

        Unlike :meth:`worker_gone` (this process's view, a monitor tick behind), this
        is true as soon as the worker's process is seen dead here (``/proc``) or its
        member's claim was cleared or taken by another incarnation. Both stay true.
        """
        return self.roster.worker_gone(worker) or self.endpoint.worker_dead(worker)

    def worker_ended(self, worker: str) -> bool:
        """Whether the incarnation RPC worker ``worker`` served is gone in this view: it left
        or was lost; not when it renewed its agent (the worker then moved, the process is
        the same)."""
        return self.roster.resolve(worker) is None

    def incarnation_dead(self, worker: str, incarnation: int) -> bool:
        """Whether incarnation ``incarnation`` of RPC worker ``worker``'s member is gone,
        asking the store when this view has not seen it yet (as :meth:`worker_dead`, but a
        worker retired by a renewal of that incarnation is not dead)."""
        return self.worker_ended(worker) or self.endpoint.incarnation_dead(worker, incarnation)

    @property
    def worker(self) -> str:
        """The RPC worker this member answers as."""
        return self.endpoint.worker

    @property
    def first_worker(self) -> str:
        """The RPC worker of this incarnation's first agent: its entry stays in the store
        while the incarnation lives (a name for the incarnation across renewals)."""
        return self.endpoint.first_worker

    @property
    def renewals(self) -> int:
        """How many times this member renewed its RPC agent (its listener had closed)."""
        return self.endpoint.renewals

    def rpc_address(self) -> Optional[str]:
        """The address this member's RPC agent listens on (elastic worlds; None if unknown)."""
        return self.endpoint.rpc_address() if self.elastic else None
