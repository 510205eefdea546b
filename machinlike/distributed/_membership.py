"""Membership: who is in the world, alive or not, and who owns which registry key.

This is the one owner of the world's shared tables (store keys under ``<ns>``); World and
RpcGroup use it through the methods below and never touch the keys themselves. Its state
lives here (``Membership.__init__``); two mixins hold the methods of two concerns:
``_member_monitor`` (liveness, clean-up after the lost, this member's RPC worker) and
``_member_waits`` (waits that end when a member they need is gone).

    member process                                the world's store (c10d TCPStore)
    --------------                                ----------------------------------
    enter:   inc = add(m/inc/<name>)              m/live/<name>   "inc|transport|rank|pid id" or ""
             claim m/live/<name>                  m/hb/<name>     heartbeat counter
             join RPC, post "join"                m/log, m/evn    event log (join | leave | lost) + its counter
    monitor thread, each tick (liveness / 8):     m/own/<transport>  registry keys it claimed
             see _member_monitor                  m/t/<transport> its member (RPC worker -> name)
                                                  m/lost/<name>/<inc>  elects one declarer
                                                  m/gone/<name>/<inc>  set when its keys are free
    declare (one winner): release its keys, prune it from the RPC group, clear m/live, post "lost"
    apply "lost" / "leave": wake the waits that need it, run callbacks (its RPC worker stays
            known to torch's agent: see _transport)
    apply "move": a live member renewed its RPC agent; new calls go to its new worker

Why the store and not RPC: the store is torch's C++ server, reachable while any member
lives, and its compare-and-set gives one winner for every claim without a coordinator.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch.distributed as dist

from ..exception import PeerLostError
from . import _transport
from ._calls import LocalTables
from ._listener import ListenerWatch
from ._liveness import is_here, process_identity
from ._member_monitor import MembershipMonitor
from ._keys import LOST_MARK, Keys, LogEntry, MemberRecord, OwnedKey, rebind_holder
from ._member_records import MemberEvent
from ._member_waits import MembershipWaits
from ._registry import Registry, deadline_left

__all__ = ["Membership", "MemberEvent", "LOST_MARK"]

log = logging.getLogger(__name__)


class Membership(MembershipMonitor, MembershipWaits):
    """This process's view of the world's members, and its handle on the shared tables.

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
        self.keys = keys
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
        self._live: Dict[str, MemberRecord] = {}
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

    def _rpc_store(self) -> dist.Store:
        return dist.PrefixStore(self.keys.rpc_prefix(), self._store)

    # ----------------------------------------------------------------- enter
    def enter(self, rank: Optional[int], deadline: float) -> None:
        """Claim this member's name for a new incarnation (elastic worlds).

        A record left by a dead incarnation is taken over once that one is declared lost.

        Raises:
            ValueError: a live member already uses the name (named).
            TimeoutError: the previous incarnation's clean-up did not finish in time.
        """
        reg = self.registry
        self.incarnation = int(reg.add(self.keys.incarnations(self.name), 1))
        self._new_transport()
        self.rank = self._tid if rank is None else rank
        mine = MemberRecord(self.name, self.incarnation, self.transport, self.rank, process_identity())
        live_key = self.keys.live(self.name)
        while True:
            held = reg.claim(live_key, mine.encode())
            if held is None:
                break
            old = MemberRecord.decode(self.name, held)
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
                rec = MemberRecord(member, 1, member, r, identity)
                self._live[member] = rec
                self._by_transport[member] = member
        self._me = self._live[self.name]
        self._static_order = list(names)
        self.registry.set(self.keys.live(self.name), self._me.encode())

    def announce(self) -> None:
        """Post this member's "join" and start the monitor."""
        self._post("join", self._me)
        self.start_monitor()

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

    def member_of(self, transport: str) -> str:
        with self._lock:
            return self._by_transport.get(transport, transport)

    def transport_gone(self, transport: str) -> bool:
        # No lock: one set look-up is atomic, the set only grows (under the lock), and
        # every call asks this twice.
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
                self.registry.append(self.keys.owned(self.transport), OwnedKey(key, holder).encode())
        return held

    def release(self, key: str, holder: str) -> bool:
        with self._claims:
            return self.registry.release(key, self._current_holder(holder))

    def _current_holder(self, holder: str) -> str:
        return rebind_holder(holder, self._old_transports, self.transport)

    def owner(self, key: str) -> Optional[str]:
        return self.registry.owner(key)

    # ---------------------------------------------------------------- events
    def _post(self, kind: str, rec: MemberRecord) -> None:
        # One atomic append: a poster SIGKILLed mid-post leaves the event whole or absent,
        # never a numbered hole every reader would wait on. The counter after it only
        # tells readers that the log grew (one lagging behind is caught up by the next).
        self.registry.append(self.keys.log(), LogEntry(kind, rec).encode())
        self.registry.add(self.keys.log_count(), 1)

    def _catch_up(self) -> None:
        """Apply every event posted since the last call, in log order."""
        total = self.registry.add(self.keys.log_count(), 0)
        if total <= self._counted:
            return
        entries = LogEntry.decode_log(self.registry.get_or_empty(self.keys.log()))
        for seq in range(self._seen, len(entries)):
            self._apply(entries[seq].kind, entries[seq].record, seq)
        self._seen = len(entries)
        self._counted = total

    def _apply(self, kind: str, rec: MemberRecord, seq: int) -> None:
        with self._lock:
            if kind == "move":
                self._apply_move(rec)
                self._changed.notify_all()
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

    # ------------------------------------------------------------------ leave
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
