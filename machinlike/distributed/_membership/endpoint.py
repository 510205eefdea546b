"""Endpoint: this member's own identity in the world and its RPC worker.

Owns who this process is (name, rank, incarnation, its :class:`MemberRecord`), the RPC
worker it answers as (id and name, new for every join attempt and every renewal), the
watch on that worker's listener, and how many times it was renewed. It writes only its
own keys: ``m/inc/<name>``, ``m/tid``, ``m/t/<worker>`` and (after a claim) ``m/live/<name>``.

    new_incarnation(rank)   inc = add(m/inc/<name>); a fresh worker (below)
    new_worker()            seq = add(m/tid) - 1, again while torch id seq mod the
                            id space is claimed; name "<name, '_' for '-'>_<seq>";
                            m/t/<worker> = <name>
    join(...)               join the dynamic RPC group under the current worker, pruning
                            the dead first; on failure a fresh worker, until the deadline
    renew()                 (the listener closed) a fresh worker, join (the new agent
                            becomes current once it listens; the old one is retired);
                            Claims moves the keys, the monitor posts "move"

Why a fresh worker name per attempt: torch's dynamic RPC group remembers every name it
saw, so a name is never reused, and the sequence numbers keep every incarnation's name
apart.

Why torch ids can be given again (they are 16-bit; a world that lives for days needs
more than 32,000 workers): an id is claimed in the store (``names/<id>``, by torch's
agent) until its worker's agent is shut down or its member is gone, so no two live
workers share one; an agent reaches a worker through a pipe kept per *id*, so no
current agent may still know an id's previous worker: every agent is recycled before
a quarter of the id space has been handed out after it (:meth:`Endpoint.aged`), while
an id comes round only after the whole space. machinlike's handles to remote values name
members, not workers (see ``_calls.refs``): nothing routes through torch's RRef context, which
keeps the first agent's id tables for the life of the process.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Callable, List, Optional, Tuple

import torch.distributed as dist

from .. import _transport
from .._store import Keys, MemberRecord, own_client
from .._transport import ListenerWatch
from .processes import alive_here, process_identity, tick_of
from .._transport import PipeLedger
from .._store import Registry
from ..._deadline import deadline_left

__all__ = ["Endpoint"]

# How many claimed ids in a row a new worker skips before it gives up (each is a live
# worker's, or a gone one's not yet deleted: a full id space).
_SKIP_MAX = 64

log = logging.getLogger(__name__)


class Endpoint:
    """This member as the others see it.

    Args:
        registry: The world's store tables.
        keys: The world's keys.
        store: The world's store (torch's RPC rendezvous runs under its ``rpc`` prefix).
        name: This member's name.
        closing: Set when this member leaves; ends a pause between join attempts.
        liveness: The world's liveness bound, seconds (paces retries); None: off.

    Attributes:
        name: This member's name.
        rank: Its rank (-1 until it entered).
        incarnation: 1 for a member's first process, 2 for its first replacement, ...
        worker: The RPC worker it answers as (its name in a static world).
        renewals: How many times it renewed its RPC agent (its listener had closed).
        recycles: How many times it recycled its RPC agent (too many pipes to gone
            workers; see _transport.pipes).
        pipes: The current agent's pipes (reset when the agent is replaced).
        first_worker: The worker of this incarnation's first agent that joined (its
            entry ``m/t/<worker>`` stays while the incarnation lives; see forget_retired).
    """

    def __init__(self, registry: Registry, keys: Keys, store: dist.Store, name: str,
                 closing: threading.Event, liveness: Optional[float], pipes: PipeLedger) -> None:
        self._registry = registry
        self._keys = keys
        self._store = store
        self._agent_store: Optional[dist.Store] = None  # made on first use (see _rpc_store)
        self._agent_client: Optional[dist.Store] = None
        self._agent_store_lock = threading.Lock()
        self._closing = closing
        self._liveness = liveness
        self.name = name
        self.rank = -1
        self.incarnation = 1
        self.worker = name
        self.first_worker = name
        self._joined = False
        self.renewals = 0
        self.recycles = 0
        self.pipes = pipes
        self._tid = -1
        self._seq = -1  # the current worker's sequence number (elastic worlds)
        self._latest_seq = -1  # the newest any worker of the world is known to have
        self._me: Optional[MemberRecord] = None
        self._listener: Optional[ListenerWatch] = None
        self._join_args: Tuple[int, float, float, Optional[List[str]]] = (1, 1.0, 1.0, None)

    @property
    def me(self) -> MemberRecord:
        """This member's record (what its claim ``m/live/<name>`` holds)."""
        if self._me is None:
            raise RuntimeError(f"member {self.name!r} has not entered the world yet")
        return self._me

    # -------------------------------------------------------------------- entry
    def enter_static(self, rank: int, rec: MemberRecord) -> None:
        """Be rank ``rank`` of a static world, as ``rec``; publish the claim."""
        self.rank = rank
        self._tid = rank
        self._me = rec
        self._registry.set(self._keys.live(self.name), rec.encode())

    def new_incarnation(self, rank: Optional[int]) -> MemberRecord:
        """Count a new incarnation with a fresh worker; the record to claim (elastic worlds).

        Args:
            rank: This member's rank; None: its worker's sequence number (unique in the
                world, never 0).
        """
        self.incarnation = int(self._registry.add(self._keys.incarnations(self.name), 1))
        self._new_worker()
        self.rank = self._seq if rank is None else rank
        if rank is None and self._seq == 0:
            # Rank 0 is the store host's, given as rank=0; a member started at the same
            # moment could reach the counter first and take it too, and the usual
            # "if world.rank == 0" would make it a second learner. Its rank is then the
            # next sequence number, which no worker takes; its worker keeps id 0 (torch's
            # distributed autograd keeps a process's first id: a static rank 0 after it).
            self.rank = self._registry.add(self._keys.worker_ids(), 1) - 1
        return MemberRecord(self.name, self.incarnation, self.worker, self.rank, process_identity())

    def claimed(self, rec: MemberRecord) -> None:
        """``rec`` is this member's claim now (the caller won ``m/live/<name>``)."""
        self._me = rec

    def _new_worker(self) -> None:
        """Take a fresh RPC worker name and a torch id no live worker holds (each join
        attempt needs its own).

        Raises:
            RuntimeError: every id tried was claimed (the world has about as many live
                workers as the id space: see ``_transport.id_space``).
        """
        space = _transport.id_space()
        for _ in range(_SKIP_MAX):
            seq = self._registry.add(self._keys.worker_ids(), 1) - 1
            if not _transport.id_held(self._rpc_store, seq % space):
                break
        else:
            raise RuntimeError(f"{_SKIP_MAX} RPC worker ids in a row are held by workers of this world (its id "
                               f"space is {space:,}, {_transport.ID_SPACE_ENV}): too many live members")
        self._seq, self._tid = seq, seq % space
        self.note_seq(seq)
        # torch's dynamic join parses its worker list as "name-id," entries, so a worker
        # name must not contain "-"; the sequence number keeps every worker's name apart.
        self.worker = f"{self.name.replace('-', '_')}_{seq}"
        self._registry.set(self._keys.worker(self.worker), self.name)

    @property
    def _rpc_store(self) -> dist.Store:
        """The RPC agent group's store, on a connection of its own.

        Why its own: a join waits in the store for torch's membership token (a second at
        a time, for as long as other members' joins hold it) and a new agent's start
        blocks in it; a store client serves one request at a time, so on the world's
        connection those waits held up this member's heartbeat and log reads for as long,
        and a member renewing its agent missed the deaths posted meanwhile (issue 37).
        """
        with self._agent_store_lock:
            if self._agent_store is None:
                # (Held here too: a PrefixStore keeps only the C++ side of a store written
                # in Python alive, and its methods would then be gone.)
                timeout = getattr(self._store, "timeout", None) or datetime.timedelta(seconds=60)  # (not in stubs)
                self._agent_client = own_client(self._store, timeout) or self._store
                self._agent_store = dist.PrefixStore(self._keys.rpc_prefix(), self._agent_client)
            return self._agent_store

    def let_go(self) -> None:
        """Drop the agent group's connection (after the agent's shutdown): it closes now,
        not when a cycle holding this endpoint is collected."""
        with self._agent_store_lock:
            self._agent_store = self._agent_client = None

    def note_seq(self, seq: int) -> None:
        """A worker of the world got sequence number ``seq`` (this view saw it join or move)."""
        if seq > self._latest_seq:
            self._latest_seq = seq

    def aged(self) -> bool:
        """Whether this member's agent must be recycled before ids come round: a quarter
        of the id space has been handed out since its worker's (see the module's "why")."""
        handed = self._latest_seq - self._seq
        # (the id space is at least 16: fewer than 4 ids handed out need no environment read)
        return self._seq >= 0 and handed >= 4 and handed >= _transport.id_space() // 4

    def renamed(self) -> MemberRecord:
        """A fresh worker, and this member's claim rewritten to name it; returns the
        record before (what ``Claims.renewed`` moves the keys from)."""
        old = self.me
        self._new_worker()
        self._me = old.with_worker(self.worker)
        self._registry.compare_set(self._keys.live(self.name), old.encode(), self._me.encode())
        return old

    # --------------------------------------------------------------------- RPC
    def join(self, threads: int, timeout: float, deadline: float, default_timeout: float,
             transports: Optional[List[str]] = None, rename: Optional[Callable[[], None]] = None) -> None:
        """Join the world's dynamic RPC group (elastic worlds), pruning the dead first.

        A member that dies while this one joins makes torch's join fail (it calls every
        listed worker); the attempt is then undone and repeated under a fresh worker name
        until ``deadline``.

        Args:
            threads: RPC worker threads of the agent.
            timeout: Seconds for each call the join makes.
            deadline: ``time.monotonic()`` deadline of the whole join.
            default_timeout: The agent's default RPC timeout afterwards, in seconds.
            transports: TensorPipe's transports (kept for renewals); None: its default list.
            rename: Gives this member its fresh worker name before a retry; None:
                :meth:`renamed` alone. A member that claimed keys under its worker before
                joining (its rank) passes one that moves them too (``Claims.renewed``):
                left under the failed worker, freeing its current one at its death missed
                them, and its next incarnation waited out its whole timeout for the rank.

        Raises:
            RuntimeError, TimeoutError: the last attempt's error, when the deadline passed.
        """
        self._join_args = (threads, timeout, default_timeout, transports)
        while True:
            # A listed worker is stale when no live claim names it (its member was declared
            # gone, or came back as another incarnation) or its process is gone. The live
            # claims decide, not the event log: a member joins RPC before it posts "join".
            try:
                _transport.start_dynamic(self._rpc_store, self.worker, self._tid, threads,
                                         max(0.5, min(timeout, 5.0)), deadline, self.token_holder_dead,
                                         self.worker_dead, self.worker_freed, transports)
                _transport.set_default_timeout(default_timeout)
                self._listener = ListenerWatch(_transport.published_address(self._rpc_store, self.worker))
                if not self._joined:
                    self._joined, self.first_worker = True, self.worker
                return
            except RuntimeError as err:
                if deadline_left(deadline) < 1.0 or self._closing.is_set():
                    raise  # out of time, or this member is leaving: no more attempts
                log.warning("machinlike: member %r: RPC join attempt failed (%s); retrying", self.name, err)
                # A pause, not a synchronisation: what failed (a silent peer renewing its
                # agent, one dying) takes a monitor tick to change.
                self._closing.wait(tick_of(self._liveness))
            if rename is None:
                self.renamed()
            else:
                rename()

    @property
    def rpc_timeout(self) -> float:
        """The agent's default RPC timeout in seconds (a call under way ends within it)."""
        return self._join_args[2]

    def listener_closed(self) -> bool:
        """Whether this member's RPC listener is known closed (see ``_transport.listener``)."""
        return self._listener is not None and self._listener.alive() is False

    def renew(self, recycle: bool = False, why: Optional[str] = None) -> MemberRecord:
        """Give this member a new RPC agent (and worker name): its listener closed, its
        agent stopped answering (``why`` says so), or (``recycle``) the agent holds too
        many pipes to gone workers (see _transport.pipes) or is a quarter of the id space old.

        Its incarnation stays; the caller moves its registry keys (``Claims.renewed``)
        and tells the others. The old agent keeps serving the connections it has (calls
        under way complete) until :func:`_transport.reap_retired` shuts it down.

        Returns:
            The record before the renewal.

        Raises:
            RuntimeError, TimeoutError: the new agent could not join (logged: nobody can
                call this member any more).
        """
        old = self.me
        threads, timeout, default_timeout, transports = self._join_args
        if recycle and self.aged():
            log.info("machinlike: member %r: RPC agent %r is a quarter of the id space old; recycling it",
                     self.name, old.worker)
        elif recycle:
            log.info("machinlike: member %r: RPC agent %r holds pipes to %d gone workers; recycling it",
                     self.name, old.worker, self.pipes.dead())
        elif why is not None:
            log.warning("machinlike: member %r: %s; restarting its RPC agent", self.name, why)
        else:
            log.warning("machinlike: member %r: the RPC listener of %r closed (a peer vanished while "
                        "connecting, or something probed its port); restarting its RPC agent",
                        self.name, old.worker)
        self._listener = None
        self.renamed()  # the join retires the current agent once the new one listens
        try:
            with _transport.renewing():
                self.join(threads, timeout, time.monotonic() + max(10.0, 3 * timeout), default_timeout, transports)
        except (RuntimeError, TimeoutError) as err:
            log.error("machinlike: member %r could not renew its RPC agent (%s): nobody can call it any "
                      "more; stop this process (a launcher with max_restarts brings it back)", self.name, err)
            raise
        self.pipes.reset()
        if recycle:
            self.recycles += 1
        else:
            self.renewals += 1
        return old

    def rpc_address(self) -> Optional[str]:
        """The address this member's RPC agent listens on (None if unknown)."""
        return _transport.published_address(self._rpc_store, self.worker)

    def prune(self, worker: str, deadline: float) -> None:
        """Drop ``worker`` (a gone member's) from the dynamic RPC group, briefly and best effort."""
        try:
            _transport.prune_workers(self._rpc_store, self.worker, [worker],
                                     min(deadline, time.monotonic() + 0.5), self.token_holder_dead,
                                     self.worker_freed)
        except TimeoutError as err:  # whoever joins next prunes stale workers itself
            log.info("machinlike: %r stays listed in the RPC group for now: %s", worker, err)

    def forget(self, worker: str) -> None:
        """Delete gone worker ``worker``'s entry ``m/t/<worker>``: it then counts as dead
        and freed, so whoever prunes the RPC group's list next drops it, and its address
        with it (see :meth:`worker_freed`)."""
        self._registry.delete([self._keys.worker(worker)])

    def forget_retired(self, workers: List[str]) -> None:
        """Delete the store keys of this member's retired workers, now shut down: their
        entries ``m/t/<worker>``, addresses and token keys (a member that recycles for
        days would otherwise leave ~5 keys per recycling). The process's first agent is
        never shut down; the entry of this incarnation's first worker stays while it lives:
        a gradient server's pushes are tagged by it (see server/_churn)."""
        for worker in workers:
            if worker != self.first_worker and _transport.forget_retired(self._rpc_store, worker):
                self._registry.delete([self._keys.worker(worker)])

    def forget_group_keys(self, worker: str) -> None:
        """Delete the RPC group's keys of gone worker ``worker`` (its address, token keys and
        torch id claim) unless it is still listed (then whoever prunes it does)."""
        _transport.forget_retired(self._rpc_store, worker)

    def worker_freed(self, worker: str) -> bool:
        """Whether RPC worker ``worker``'s member is gone for good (its entry is deleted),
        not just moved to another worker (a retired worker keeps its entry)."""
        return not self._registry.get_or_empty(self._keys.worker(worker))

    # ------------------------------------------------------------ other workers
    def _claim_of(self, worker: str) -> Optional[MemberRecord]:
        """The live claim of RPC worker ``worker``'s member (read from the store); None when
        the worker's entry or the claim is gone."""
        member = self._registry.get_or_empty(self._keys.worker(worker))
        held = self._registry.get_or_empty(self._keys.live(member)) if member else ""
        return MemberRecord.decode(member, held) if held else None

    def worker_dead(self, worker: str) -> bool:
        """Whether RPC worker ``worker`` belongs to no live claim (read from the store)."""
        rec = self._claim_of(worker)
        return rec is None or rec.worker != worker or alive_here(rec.identity) is False

    def incarnation_dead(self, worker: str, incarnation: int) -> bool:
        """Whether incarnation ``incarnation`` of RPC worker ``worker``'s member holds no
        live claim (read from the store), whichever worker it answers as now."""
        rec = self._claim_of(worker)
        return rec is None or rec.incarnation != incarnation or alive_here(rec.identity) is False

    def token_holder_dead(self, token: str) -> bool:
        holder = _transport.token_holder(token)
        return holder is not None and holder != self.worker and self.worker_dead(holder)
