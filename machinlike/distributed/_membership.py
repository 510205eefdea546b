"""Membership: who is in the world, alive or not, and who owns which registry key.

This is the one owner of the world's shared tables (store keys under ``<ns>``); World and
RpcGroup use it through the methods below and never touch the keys themselves.

    member process                                the world's store (c10d TCPStore)
    --------------                                ----------------------------------
    enter:   inc = add(m/inc/<name>)              m/live/<name>   "inc|transport|rank|pid id" or ""
             claim m/live/<name>                  m/hb/<name>     heartbeat counter
             join RPC, post "join"                m/log, m/evn    event log (join | leave | lost) + its counter
    monitor thread, each tick (liveness / 8):     m/own/<transport>  registry keys it claimed
                                                  m/t/<transport> its member (RPC worker -> name)
             heartbeat, read the others'          m/lost/<name>/<inc>  elects one declarer
             apply new events, check this member's RPC listener
             suspect: process gone (same host,    m/gone/<name>/<inc>  set when its keys are free
             read from /proc) or heartbeat
             stalled for 3/4 of liveness
    declare (one winner): release its keys, prune it from the RPC group, clear m/live, post "lost"
            (a declarer that dies mid-way is taken over after a few leases: m/lostpost keeps it
            to one "lost" event per incarnation)
    apply "lost" / "leave": wake the waits that need it, run callbacks (its RPC worker stays
            known to torch's agent: see _transport)
    own RPC listener closed (see _listener): renew the agent under a new worker name, move the
            claims to it, post "move"; the others route new calls to the new worker

Why the store and not RPC: the store is torch's C++ server, reachable while any member
lives, and its compare-and-set gives one winner for every claim without a coordinator.
Why heartbeats and /proc: a SIGKILLed peer says nothing; a local one is seen gone at the
next tick through /proc (no false alarm under load), a remote one by its silent lease.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Set, Tuple

import torch
import torch.distributed as dist

from ..exception import PeerLostError
from . import _transport
from ._calls import LocalTables
from ._listener import ListenerWatch
from ._liveness import alive_here, is_here, process_identity
from ._registry import Registry, deadline_left

__all__ = ["Membership", "MemberEvent", "LOST_MARK"]

log = logging.getLogger(__name__)

#: Written into a waited-for key of a member that is gone, to wake its waiters.
LOST_MARK = "\x00lost"
#: Written into the other keys of such a wait that are still absent: a store wait ends
#: only when every key it waits for exists. A member arriving later overwrites it.
WOKEN_MARK = "\x00woken"


@dataclass(frozen=True)
class MemberEvent:
    """A change of the world's membership.

    Attributes:
        kind: ``"join"``, ``"leave"`` (it stopped) or ``"lost"`` (it died or went silent).
        member: The member's name.
        incarnation: 1 for its first process, 2 for the first replacement, ...
        rank: Its rank.
        seq: Position in the world's event log (events are seen in this order everywhere).
    """

    kind: str
    member: str
    incarnation: int
    rank: int
    seq: int


@dataclass
class _Record:
    member: str
    incarnation: int
    transport: str
    rank: int
    identity: str

    def encode(self) -> str:
        return f"{self.incarnation}|{self.transport}|{self.rank}|{self.identity}"

    @staticmethod
    def decode(member: str, text: str) -> "_Record":
        inc, transport, rank, identity = text.split("|", 3)
        return _Record(member, int(inc), transport, int(rank), identity)


class Membership:
    """This process's view of the world's members, and its handle on the shared tables.

    Args:
        store: The world's store.
        ns: Key prefix of this world in the store (ends with ``/``).
        store_owner: Who hosts the store, for error messages.
        name: This member's name.
        liveness: Seconds within which a dead member is detected; None: no monitor.
        elastic: Whether RPC is a dynamic agent group (members may join and leave).
    """

    def __init__(self, store: dist.Store, ns: str, store_owner: str, name: str,
                 liveness: Optional[float], elastic: bool) -> None:
        self.ns = ns
        self.name = name
        self.elastic = elastic
        self.liveness = liveness
        self.registry = Registry(store, store_owner)
        self.tables = LocalTables(name)
        self.incarnation = 1
        self.transport = name
        self.rank = -1
        self._store = store
        # Re-entrant: wait_until evaluates the caller's predicate under it, and the
        # predicate may ask this object again (incarnation_of, members).
        self._lock = threading.RLock()
        self._live: Dict[str, _Record] = {}
        self._by_transport: Dict[str, str] = {}
        self._gone: Dict[str, str] = {}  # member -> "lost" | "left" (latest incarnation)
        self._gone_transports: Set[str] = set()
        self._pending: Dict[str, Set[threading.Event]] = {}  # worker -> waits of calls to it
        self._here: Dict[str, bool] = {}  # worker -> on this host (cached: a call asks every time)
        self._declaring: Dict[Tuple[str, int], float] = {}  # losses another member is cleaning up
        self._waits: Dict[int, Tuple[str, Dict[str, str], Optional[Dict[str, int]]]] = {}
        self._wait_ids = 0
        self._callbacks: List[Callable[[MemberEvent], None]] = []
        self._changed = threading.Condition(self._lock)
        self._seen = 0  # events of the log applied here
        self._counted = 0  # the log's counter when it was last read
        self._beats: Dict[str, Tuple[int, float]] = {}
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._store_lost: Optional[PeerLostError] = None
        self._static_order: List[str] = []
        # Transport renewal (elastic worlds): see _listener. Claims are made and moved
        # under _claims, so none is noted under a worker name that is being replaced.
        self._claims = threading.Lock()
        self._listener: Optional[ListenerWatch] = None
        self._join_args: Tuple[int, float, float] = (1, 1.0, 1.0)
        self._old_transports: Set[str] = set()
        #: How many times this member renewed its RPC agent (its listener had closed).
        self.renewals = 0
        #: This process's handles of the groups it belongs to, by name (owned by RpcGroup).
        self.groups: Dict[str, object] = {}
        #: How many times each group name was created here (static groups' epochs).
        self.group_epochs: Dict[str, int] = {}

    # ------------------------------------------------------------------ keys
    def key(self, suffix: str) -> str:
        return self.ns + suffix

    def _rpc_store(self) -> dist.Store:
        return dist.PrefixStore(self.ns + "rpc", self._store)

    # ----------------------------------------------------------------- enter
    def enter(self, rank: Optional[int], deadline: float) -> None:
        """Claim this member's name for a new incarnation (elastic worlds).

        A record left by a dead incarnation is taken over once that one is declared lost.

        Raises:
            ValueError: a live member already uses the name (named).
            TimeoutError: the previous incarnation's clean-up did not finish in time.
        """
        reg = self.registry
        self.incarnation = int(reg.add(self.key(f"m/inc/{self.name}"), 1))
        self._new_transport()
        self.rank = self._tid if rank is None else rank
        mine = _Record(self.name, self.incarnation, self.transport, self.rank, process_identity())
        live_key = self.key(f"m/live/{self.name}")
        while True:
            held = reg.claim(live_key, mine.encode())
            if held is None:
                break
            old = _Record.decode(self.name, held)
            if self._record_alive(old, wait=min(deadline_left(deadline), self._lease())):
                raise ValueError(f"a member named {self.name!r} is alive in this world (incarnation "
                                 f"{old.incarnation}, rank {old.rank}); pick another name or stop it first")
            self._declare(old, deadline)
        self._me = mine

    def enter_static(self, rank: int, names: Sequence[str], identities: Sequence[str]) -> None:
        """Record the members of a static world (rank ``i`` is ``names[i]``)."""
        self.rank = rank
        self._tid = rank
        with self._lock:
            for r, (member, identity) in enumerate(zip(names, identities)):
                rec = _Record(member, 1, member, r, identity)
                self._live[member] = rec
                self._by_transport[member] = member
        self._me = self._live[self.name]
        self._static_order = list(names)
        self.registry.set(self.key(f"m/live/{self.name}"), self._me.encode())

    def _new_transport(self) -> None:
        """Take a fresh RPC worker id and name (each join attempt needs its own)."""
        tid = self.registry.add(self.key("m/tid"), 1) - 1
        if tid > 32000:
            raise RuntimeError("this elastic world has used up its 32,000 RPC worker ids; start a new one")
        self._tid = tid
        # torch's dynamic join parses its worker list as "name-id," entries, so a worker
        # name must not contain "-"; the unique id keeps every incarnation's name apart.
        self.transport = f"{self.name.replace('-', '_')}_{tid}"
        self.registry.set(self.key(f"m/t/{self.transport}"), self.name)

    def join_transport(self, threads: int, timeout: float, deadline: float, default_timeout: float) -> None:
        """Join the world's dynamic RPC group (elastic worlds), pruning the dead first.

        A member that dies while this one joins makes torch's join fail (it calls every
        listed worker); the attempt is then undone and repeated under a fresh worker name
        until ``deadline``.

        Args:
            threads: RPC worker threads of the agent.
            timeout: Seconds for each call the join makes.
            deadline: ``time.monotonic()`` deadline of the whole join.
            default_timeout: The agent's default RPC timeout afterwards, in seconds.

        Raises:
            RuntimeError, TimeoutError: the last attempt's error, when the deadline passed.
        """
        self._join_args = (threads, timeout, default_timeout)
        store = self._rpc_store()
        while True:
            # A listed worker is stale when no live claim names it (its member was declared
            # gone, or came back as another incarnation) or its process is gone. The live
            # claims decide, not the event log: a member joins RPC before it posts "join".
            try:
                _transport.start_dynamic(store, self.transport, self._tid, threads, max(0.5, min(timeout, 5.0)),
                                         deadline, self._token_holder_dead, self._worker_dead)
                _transport.set_default_timeout(default_timeout)
                self.tables.rrefs_stale = _transport.rrefs_bound_elsewhere()
                self._listener = ListenerWatch(_transport.published_address(store, self.transport))
                return
            except RuntimeError as err:
                if deadline_left(deadline) < 1.0:
                    raise
                log.warning("machinlike: member %r: RPC join attempt failed (%s); retrying", self.name, err)
                # A pause, not a synchronisation: what failed (a silent peer renewing its
                # agent, one dying) takes a monitor tick to change.
                self._stop.wait(max(0.02, (self.liveness or 2.0) / 8))
            old = self._me.encode()
            self._new_transport()
            self._me = _Record(self.name, self.incarnation, self.transport, self.rank, self._me.identity)
            self.registry.compare_set(self.key(f"m/live/{self.name}"), old, self._me.encode())

    def announce(self) -> None:
        """Post this member's "join" and start the monitor."""
        self._post("join", self._me)
        self.start_monitor()

    def start_monitor(self) -> None:
        self._catch_up()
        if self.liveness is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._monitor, name=f"machinlike-liveness-{self.name}", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------- queries
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

    def incarnation_of(self, member: str) -> Optional[int]:
        with self._lock:
            rec = self._live.get(member)
            return None if rec is None else rec.incarnation

    def gone(self, member: str) -> Optional[str]:
        """``"left"`` or ``"lost"`` when ``member``'s latest incarnation is gone, else None."""
        with self._lock:
            return None if member in self._live else self._gone.get(member)

    def rpc_address(self) -> Optional[str]:
        """The address this member's RPC agent listens on (elastic worlds; None if unknown)."""
        return _transport.published_address(self._rpc_store(), self.transport) if self.elastic else None

    def transport_of(self, member: str) -> str:
        """The RPC worker name of live ``member``.

        Raises:
            PeerLostError: the member is gone (left or lost) or the store is.
        """
        with self._lock:
            rec = self._live.get(member)
            gone = self._gone.get(member)
        if self._store_lost is not None:
            raise self._store_lost
        if rec is None:
            raise PeerLostError(member, f"it {gone} the world" if gone == "left" else
                                "it was lost (its process died or went silent)" if gone else
                                "it is not a member of this world")
        return rec.transport

    def identity_of(self, worker: str) -> Optional[str]:
        """The process identity of RPC worker ``worker`` (a live member's), None if unknown."""
        with self._lock:
            member = self._by_transport.get(worker)
            rec = self._live.get(member) if member is not None else None
            return rec.identity if rec is not None and rec.transport == worker else None

    def on_this_host(self, worker: str) -> bool:
        """Whether RPC worker ``worker`` runs where ``/proc`` sees it (its death shows at once)."""
        here = self._here.get(worker)
        if here is None:
            identity = self.identity_of(worker)
            if identity is None:
                return False
            here = self._here[worker] = is_here(identity)  # fixed for a worker's life
        return here

    def wait_call(self, fut: "torch.futures.Future", worker: str, what: str) -> object:
        """The result of ``fut``, a call to ``worker``; PeerLostError as soon as it is lost.

        Raises:
            PeerLostError: the worker left or was lost while the call was pending.
            RuntimeError: what ``fut`` raised (torch's text errors, timeouts included).
        """
        done = threading.Event()
        with self._lock:
            if worker in self._gone_transports:
                raise PeerLostError(self.member_of(worker), f"{what}: it left or was lost")
            self._pending.setdefault(worker, set()).add(done)
        try:
            fut.add_done_callback(lambda _: done.set())
            done.wait()  # bounded: torch completes the future at the call's own timeout
            if not fut.done():
                raise PeerLostError(self.member_of(worker), f"{what}: it was lost while the call was pending")
            return fut.wait()
        finally:
            with self._lock:
                self._pending.get(worker, set()).discard(done)

    def member_of(self, transport: str) -> str:
        with self._lock:
            return self._by_transport.get(transport, transport)

    def transport_gone(self, transport: str) -> bool:
        with self._lock:
            return transport in self._gone_transports

    def worker_dead(self, worker: str) -> bool:
        """Whether RPC worker ``worker`` is gone, asking the store when this view has not seen it yet.

        Unlike :meth:`transport_gone` (this process's view, a monitor tick behind), this
        is true as soon as the worker's process is seen dead here (``/proc``) or its
        member's claim was cleared or taken by another incarnation. Both stay true.
        """
        if self.transport_gone(worker):
            return True
        return self._worker_dead(worker)

    # -------------------------------------------------------------- callbacks
    def subscribe(self, callback: Callable[[MemberEvent], None]) -> None:
        with self._lock:
            self._callbacks.append(callback)

    def unsubscribe(self, callback: Callable[[MemberEvent], None]) -> None:
        with self._lock:
            if callback in self._callbacks:
                self._callbacks.remove(callback)

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
                self._changed.wait(left)

    # ------------------------------------------------------------ owner table
    def claim(self, key: str, holder: str) -> Optional[str]:
        """Claim registry ``key`` for ``holder`` (noted, so it is freed if this member dies).

        ``holder`` names this member's RPC worker last (``"<worker>"`` or
        ``"<tag>:<worker>"``); one naming a worker this member had before a transport
        renewal is taken as naming the current one.
        """
        with self._claims:
            holder = self._current_holder(holder)
            held = self.registry.claim(key, holder)
            if held is None:
                self.registry.append(self.key(f"m/own/{self.transport}"), f"{key}\x1f{holder}\n")
        return held

    def release(self, key: str, holder: str) -> bool:
        with self._claims:
            return self.registry.release(key, self._current_holder(holder))

    def _current_holder(self, holder: str) -> str:
        tag, colon, worker = holder.rpartition(":")
        return f"{tag}{colon}{self.transport}" if worker in self._old_transports else holder

    def owner(self, key: str) -> Optional[str]:
        return self.registry.owner(key)

    # ------------------------------------------------------------------ waits
    def wait_all(self, prefix: str, names: Sequence[str], members: Sequence[str], timeout: float, what: str,
                 stated: Optional[float] = None, incarnations: Optional[Dict[str, int]] = None) -> None:
        """``Registry.wait_all`` that fails fast when a member it waits for is gone.

        ``names[i]`` is the key suffix member ``members[i]`` writes.

        Args:
            incarnations: The incarnation each member must have (a member that came back
                as a later one counts as gone); None: any.

        Raises:
            PeerLostError: a member it waits for left or was lost (named).
            TimeoutError: as ``Registry.wait_all``.
        """
        mapping = dict(zip(members, names))
        with self._lock:
            self._wait_ids += 1
            wid = self._wait_ids
            self._waits[wid] = (prefix, mapping, incarnations)
            already = [m for m in members if m not in self._live
                       or (incarnations is not None and self._live[m].incarnation != incarnations.get(m))]
        try:
            if already:
                self._wake(prefix, [mapping[m] for m in already], list(names))
            self.registry.wait_all(prefix, names, timeout, what, stated)
            marked = [m for m, v in zip(members, self.registry.values(prefix, names)) if v == LOST_MARK]
        finally:
            with self._lock:
                self._waits.pop(wid, None)
        if marked:
            gone = ", ".join(repr(m) for m in marked)
            raise PeerLostError(marked[0], f"{what}: {gone} left or died while being waited for")

    def incarnations(self, members: Iterable[str]) -> Dict[str, int]:
        """The current incarnation of each live member among ``members``."""
        with self._lock:
            return {m: self._live[m].incarnation for m in members if m in self._live}

    def _wake(self, prefix: str, lost: Sequence[str], names: Sequence[str]) -> None:
        """Mark ``lost`` keys of a wait as gone and fill its other absent keys, so it ends."""
        try:
            for name in lost:
                self.registry.compare_set(prefix + name, "", LOST_MARK)
            for name in names:
                self.registry.compare_set(prefix + name, "", WOKEN_MARK)
        except PeerLostError:
            pass

    # --------------------------------------------------------------- monitor
    def _lease(self) -> float:
        return 0.75 * (self.liveness or 2.0)

    def _monitor(self) -> None:
        tick = max(0.02, (self.liveness or 2.0) / 8)
        beat_key = self.key(f"m/hb/{self.name}")
        while not self._stop.wait(tick):
            try:
                self.registry.add(beat_key, 1)
                self._catch_up()
                if self._listener is not None and self._listener.alive() is False:
                    self._renew()
                for rec in self._suspects():
                    self._declare(rec, time.monotonic() + 10 * tick, wait=False)
            except PeerLostError as err:
                self._on_store_lost(err)
                return
            except Exception:  # never let the monitor die silently
                log.exception("machinlike liveness monitor of %r", self.name)

    def _suspects(self) -> List[_Record]:
        with self._lock:
            others = [r for m, r in self._live.items() if m != self.name]
        if not others:
            return []
        counts = self.registry.values_or_empty(self.key("m/hb/"), [r.member for r in others])
        now = time.monotonic()
        out = []
        for rec, count in zip(others, counts):
            local = alive_here(rec.identity)
            if local is False:
                out.append(rec)
                continue
            last = self._beats.get(rec.member)
            if last is None or last[0] != count or local:
                self._beats[rec.member] = (count, now)
            elif now - last[1] > self._lease():
                out.append(rec)
        return out

    def _record_alive(self, rec: _Record, wait: float) -> bool:
        local = alive_here(rec.identity)
        if local is not None:
            return local
        key = self.key(f"m/hb/{rec.member}")
        first = self.registry.get_or_empty(key)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:  # its heartbeat moving within a lease: alive
            self._stop.wait(min(0.1, deadline_left(deadline)))
            if self.registry.get_or_empty(key) != first:
                return True
        return False

    def _worker_dead(self, worker: str) -> bool:
        """Whether RPC worker ``worker`` belongs to no live claim (read from the store)."""
        member = self.registry.get_or_empty(self.key(f"m/t/{worker}"))
        held = self.registry.get_or_empty(self.key(f"m/live/{member}")) if member else ""
        if not held:
            return True
        rec = _Record.decode(member, held)
        return rec.transport != worker or alive_here(rec.identity) is False

    def _token_holder_dead(self, token: str) -> bool:
        holder = _transport.token_holder(token)
        return holder is not None and holder != self.transport and self._worker_dead(holder)

    def _declare(self, rec: _Record, deadline: float, wait: bool = True) -> None:
        """Make ``rec`` lost everywhere: one member (the first to ask) cleans up after it.

        Args:
            wait: When another member declares it, wait (until ``deadline``) for its keys
                to be free; the monitor does not (the event will come).
        """
        reg = self.registry
        if reg.add(self.key(f"m/lost/{rec.member}/{rec.incarnation}"), 1) != 1:
            if wait:
                try:
                    reg.wait_all(self.key(f"m/gone/{rec.member}/"), [str(rec.incarnation)],
                                 max(0.1, deadline_left(deadline)), f"clean-up after member {rec.member!r}")
                    return
                except TimeoutError:
                    pass  # the declarer died or stalls mid-clean-up: finish it here (below)
            else:
                # The monitor never blocks on another's clean-up; it takes over only when
                # the declarer has not finished within a few ticks (it may have died too).
                first = self._declaring.setdefault((rec.member, rec.incarnation), time.monotonic())
                if time.monotonic() - first < 4 * self._lease():
                    return
            log.warning("machinlike: finishing the clean-up after member %r (incarnation %d) that another "
                        "member began", rec.member, rec.incarnation)
            deadline = time.monotonic() + 10 * max(0.02, (self.liveness or 2.0) / 8)
        else:
            log.warning("machinlike: member %r (incarnation %d, rank %d) is lost", rec.member, rec.incarnation,
                        rec.rank)
        self._free(rec, deadline)  # idempotent: releases compare the holder
        # One "lost" event per incarnation, whoever finished the clean-up.
        if reg.add(self.key(f"m/lostpost/{rec.member}/{rec.incarnation}"), 1) == 1:
            self._post("lost", rec)

    def _free(self, rec: _Record, deadline: float) -> None:
        reg = self.registry
        for line in reg.get_or_empty(self.key(f"m/own/{rec.transport}")).splitlines():
            key, _, holder = line.partition("\x1f")
            reg.release(key, holder)
        if self.elastic:
            # Best effort, briefly: whoever joins next prunes stale workers itself.
            try:
                _transport.prune_workers(self._rpc_store(), self.transport, [rec.transport],
                                         min(deadline, time.monotonic() + 0.5), self._token_holder_dead)
            except TimeoutError as err:
                log.info("machinlike: %r stays listed in the RPC group for now: %s", rec.transport, err)
        reg.compare_set(self.key(f"m/live/{rec.member}"), rec.encode(), "")
        reg.set(self.key(f"m/gone/{rec.member}/{rec.incarnation}"), "1")

    # ---------------------------------------------------------------- events
    def _post(self, kind: str, rec: _Record) -> None:
        # One atomic append: a poster SIGKILLed mid-post leaves the event whole or absent,
        # never a numbered hole every reader would wait on. The counter after it only
        # tells readers that the log grew (one lagging behind is caught up by the next).
        self.registry.append(self.key("m/log"), f"{kind}|{rec.member}|{rec.encode()}\n")
        self.registry.add(self.key("m/evn"), 1)

    def _catch_up(self) -> None:
        """Apply every event posted since the last call, in log order."""
        total = self.registry.add(self.key("m/evn"), 0)
        if total <= self._counted:
            return
        lines = self.registry.get_or_empty(self.key("m/log")).splitlines()
        for seq in range(self._seen, len(lines)):
            kind, member, encoded = lines[seq].split("|", 2)
            self._apply(kind, _Record.decode(member, encoded), seq)
        self._seen = len(lines)
        self._counted = total

    def _apply(self, kind: str, rec: _Record, seq: int) -> None:
        with self._lock:
            if kind == "move":
                self._apply_move(rec)
                return
            if kind == "join":
                old = self._live.get(rec.member)
                if old is not None and old.incarnation >= rec.incarnation:
                    return  # a static member's record, or a replayed join
                self._live[rec.member] = rec
                self._by_transport[rec.transport] = rec.member
                self._gone.pop(rec.member, None)
                wake: List[Tuple[str, str, List[str]]] = []
            else:
                current = self._live.get(rec.member)
                if current is not None and current.incarnation == rec.incarnation:
                    del self._live[rec.member]
                    self._gone[rec.member] = "left" if kind == "leave" else "lost"
                self._gone_transports.add(rec.transport)
                # Its worker, and any it had before a renewal (calls on those may be under way).
                for worker in [w for w in self._pending if w in self._gone_transports
                               and self._by_transport.get(w) == rec.member]:
                    for done in self._pending.pop(worker):
                        done.set()  # wait_call sees the future still pending: lost
                self._beats.pop(rec.member, None)
                wake = [(p, m[rec.member], list(m.values())) for p, m, incs in self._waits.values()
                        if rec.member in m and (incs is None or incs.get(rec.member) == rec.incarnation)]
            callbacks = list(self._callbacks)
            self._changed.notify_all()
        if kind != "join":
            # The gone worker stays in this process's RPC agent: see _transport's "why".
            for prefix, name, names in wake:
                self._wake(prefix, [name], names)
        event = MemberEvent(kind, rec.member, rec.incarnation, rec.rank, seq)
        for callback in callbacks:
            try:
                callback(event)
            except Exception:  # a user callback must not stop the monitor
                log.exception("membership callback %r failed on %s", callback, event)

    def _on_store_lost(self, err: PeerLostError) -> None:
        self._store_lost = err
        with self._lock:
            self._changed.notify_all()
        log.error("machinlike: %s; every call of this member now fails", err)

    # ------------------------------------------------------------------ leave
    # ------------------------------------------------------- transport renewal
    def _renew(self) -> None:
        """Give this member a new RPC agent (and worker name) after its listener closed.

        Its incarnation, services and values stay: the registry keys it holds move to the
        new worker name, and a "move" event tells the others. The old agent keeps serving
        the connections it has (calls under way complete), until the World stops.
        """
        old = self._me
        threads, timeout, default_timeout = self._join_args
        log.warning("machinlike: member %r: the RPC listener of %r closed (a peer vanished while connecting, "
                    "or something probed its port); restarting its RPC agent", self.name, old.transport)
        self._listener = None
        with self._claims:
            _transport.retire_current()
            self._old_transports.add(old.transport)
            self._new_transport()
            self._me = _Record(self.name, self.incarnation, self.transport, self.rank, old.identity)
            self.registry.compare_set(self.key(f"m/live/{self.name}"), old.encode(), self._me.encode())
            self.join_transport(threads, timeout, time.monotonic() + max(10.0, 3 * timeout), default_timeout)
            moved = []
            for line in self.registry.get_or_empty(self.key(f"m/own/{old.transport}")).splitlines():
                key, _, holder = line.partition("\x1f")
                new = self._current_holder(holder)
                if self.registry.compare_set(key, holder, new) == new:
                    moved.append(f"{key}\x1f{new}\n")
            if moved:
                self.registry.append(self.key(f"m/own/{self.transport}"), "".join(moved))
        self.renewals += 1
        self._post("move", self._me)
        log.warning("machinlike: member %r now answers as RPC worker %r", self.name, self.transport)

    def _apply_move(self, rec: _Record) -> None:
        """A live member's new RPC worker (called under the lock)."""
        current = self._live.get(rec.member)
        if current is None or current.incarnation != rec.incarnation or current.transport == rec.transport:
            return
        self._live[rec.member] = rec
        self._by_transport[rec.transport] = rec.member
        # New calls go to the new worker; calls under way on the old one still complete.
        self._gone_transports.add(current.transport)

    def leave(self, deadline: float) -> None:
        """Leave the world on purpose: free this member's keys, tell the others."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(max(0.0, min(deadline_left(deadline), 5.0)))
        if self._store_lost is not None:
            return
        try:
            self._free(self._me, deadline)
            self._post("leave", self._me)
        except (PeerLostError, TimeoutError) as err:
            log.warning("machinlike: member %r leaves without telling the others: %s", self.name, err)

    def close(self) -> None:
        """Stop the monitor (local teardown; tells nobody)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
