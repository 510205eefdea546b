"""Session: what a started World holds, and the undo of every step that started it.

``start_static`` and ``start_elastic`` fill one :class:`Session` step by step; each step
pushes its own undo onto the session's ``ExitStack`` as soon as it succeeded, so a
start-up that fails half-way, a ``stop``, and a World that is simply dropped all take
down exactly what was set up, in reverse order, once.

*static* (the default, machin's ``World(name, rank, world_size)``): a fixed set of ranks.
``World(...)`` returns only after the last step, on every rank, so no request can reach
a half-built world:

    step                                              undo
    open the store (host it on rank 0, or join)       -
    claim the RPC worker id = rank (torch keeps a     -
      process's first: another is refused here)
    choose the interface: set its environment         restore the environment
    exchange member names (duplicates refused)        -                (w/name/<rank>)
    bind the local tables and same-host settings,     unbind, free this process's segments
      start the same-host lane (init_rpc=True)          (the lane stops with RPC)
    init the default process group (collective=True)  destroy_process_group (pg prefix)
    init RPC over TensorPipe (init_rpc=True)          stop the lane, local RPC shutdown,
                                                        forget the URL
    ready barrier, then the liveness monitor          stop the monitor  (w/ready/<rank>)

*elastic* (``elastic=True``): members join a running world by its address and a name:

    open the store, choose the interface              restore the environment
    claim the name (a dead incarnation's claim is     -
      taken over)                       Membership.enter
    bind the local tables and same-host settings,     unbind
      start the same-host lane
    join the dynamic RPC group, pruning the dead      stop the lane, local RPC shutdown
      first                             Endpoint.join
    post "join", start the liveness monitor           stop the monitor

A step whose undo may run early (RPC's graceful shutdown and the process group's
destruction in a static ``stop``) is a :class:`Once`: the stack's later call does nothing.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch.distributed as dist

from ... import _descriptors
from .._calls import context as _context, cuda_ipc as _cuda_ipc, samehost as _samehost, serve as _serve
from .. import _transport
from .._transport import netif as _netif
from .._store import rendezvous as _rendezvous
from .._groups import RetiredGroups
from .._store import Keys, ServiceOwner, own_client, value_or_empty
from .._membership import process_identity
from .._groups import directory as _directory
from .._groups import GroupDirectory
from .._membership import HOLE_WAIT, Membership
from ..._deadline import deadline_left
from .rounds import agree_round
from .settings import Settings
from .strangers import check_sizes, give_back_seat, seat_held, stranger_error

__all__ = ["Session", "Once", "start_static", "start_elastic"]

log = logging.getLogger(__name__)


class Once:
    """An undo step that runs at most once, whether early (``stop``) or from the stack."""

    def __init__(self, undo: Callable[..., None]) -> None:
        self._undo = undo
        self._lock = threading.Lock()
        self._done = False

    def __call__(self, *args: Any) -> None:
        with self._lock:
            if self._done:
                return
            self._done = True
        self._undo(*args)


class Session:
    """One World's started state (see the module doc); built by the start functions.

    Attributes:
        settings: The World's validated arguments.
        rank: This process's rank (an elastic member's is known once it entered).
        incarnation: 1 for a member's first process, 2 for its first replacement, ...
        store: The world's store and who hosts it (None until opened).
        store_address: ``"tcp://host:port"`` of the store (None until opened).
        interface: The interface TensorPipe and gloo use here (None: their own guess).
        membership: The world's members and tables (None until the store is open).
        groups: This process's RpcGroups and what they use of the world (with ``membership``).
        rpc: The RPC shutdown step, None when RPC did not start: ``rpc(graceful, timeout)``.
        rpc_store: A static World's RPC agent's store: a connection of its own where one
            can be made, else ``store``'s (None until RPC starts). Why its own: torch's graceful shutdown waits in the store for
            the other ranks (a client serves one request at a time), and once it outlives
            the stop's time it goes on in the background; on the world's connection it held
            the stop's last store writes up to the store's timeout (2.5 s past the
            deadline, seen in ``stop(timeout=3)`` while a call was pending).
        process_group: The process group's destruction step, None when it did not start.
        retired_groups: Collective groups destroyed while the World runs, dropped at its
            stop, after the process group (see ``RetiredGroups``).
    """

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.rank = settings.rank
        self.incarnation = 1
        self.store: Optional[_rendezvous.StoreInfo] = None
        self.store_address: Optional[str] = None
        self.interface: Optional[str] = None
        self.membership: Optional[Membership] = None
        self.groups: Optional[GroupDirectory] = None
        #: What this member serves to incoming calls (served once the member entered).
        self.tables = _serve.LocalTables(settings.name)
        self.rpc: Optional[Once] = None
        self.rpc_store: Optional[dist.Store] = None
        self.lane: Optional[_transport.lane.Lane] = None  # this process's (shared by its Worlds)
        self.process_group: Optional[Once] = None
        self.retired_groups = RetiredGroups()
        self._undo = contextlib.ExitStack()

    def close(self) -> None:
        """Undo every step that ran, last first; the last error (if any) propagates after all ran."""
        self._undo.close()

    def transport_stats(self) -> Dict[str, Dict[str, int]]:
        """``World.transport_stats``: the same-host counters and this process's lane's."""
        out = _samehost.stats()
        if self.lane is not None:
            out["lane"] = self.lane.stats()
        return out

    @contextlib.contextmanager
    def network_hint(self) -> Iterator[None]:
        """Add to a start-up error what this host advertises (gloo and TensorPipe report
        an unreachable peer as a bare connection error)."""
        try:
            yield
        except RuntimeError as err:
            if hasattr(err, "add_note"):  # Python 3.11+
                err.add_note(_netif.describe(self.interface))
            raise


# ------------------------------------------------------------------------ steps
def _open(session: Session) -> _rendezvous.StoreInfo:
    s = session.settings
    if s.store is None:
        info = _rendezvous.open_store(s.rank, None if s.elastic else s.size, s.init_method, s.dist_timeout)
    else:
        base = s.store
        while isinstance(base, dist.PrefixStore):  # where the server is, for the interface choice
            base = base.underlying_store
        info = _rendezvous.StoreInfo(s.store, getattr(base, "host", "?"), getattr(base, "port", 0),
                                     False, "the launcher")
    session.store = info
    session.store_address = f"tcp://{info.host}:{info.port}"
    if info.server is not None:  # (the last undo step: the store's listener closes at the World's end)
        session._undo.callback(info.close_server)
    # TensorPipe reads its interface from the environment when RPC starts, gloo each
    # time a group is created, so the setting stays for the World's life and the
    # previous values come back at teardown (the next World may have another master).
    session.interface, env = _netif.plan_interface(s.interface, info.host, info.port)
    _netif.refuse_loopback_for_remote_master(env, info.host)
    for var, value in env.items():
        if os.environ.get(var) != value:
            session._undo.callback(_restore, var, os.environ.get(var))
            os.environ[var] = value
    log.debug("World %r: TensorPipe and gloo use %s (master %s:%s)", s.name, env or "their own guess",
              info.host, info.port)
    return info


def _restore(var: str, value: Optional[str]) -> None:
    if value is None:
        os.environ.pop(var, None)
    else:
        os.environ[var] = value


def _bind(session: Session, members: Membership) -> None:
    """Serve this member's tables to incoming calls, and its same-host settings and call
    context to outgoing ones (its name and incarnation are final here)."""
    s = session.settings
    keys, claims, tables = members.keys, members.claims, session.tables

    def resolve_service_owner(sid: str) -> Optional[str]:
        group, epoch, key = sid.split("/", 2)
        held = claims.owner(keys.service(group, epoch, key))
        return ServiceOwner.decode(held).worker if held else None

    tables.resolve_owner = resolve_service_owner
    # Results kept here for handles held elsewhere go with their holders (see _calls.results).
    # (a holder that joined since this view's last catch-up is live: see Roster.may_run)
    tables.results.bind_live(lambda holder: members.roster.may_run(*holder))

    def sweep() -> None:
        if len(tables.results):
            tables.results.sweep()

    members.on_departure = sweep
    samehost = _samehost.SameHost(s.same_host_shm, s.shm_threshold, s.shm_cache_bytes,
                                  members.roster.identity_of, s.cuda_ipc_cache_bytes)  # [shm hook]
    _serve.bind_tables(tables)
    _samehost.bind(samehost)
    if s.same_host_lane and s.rpc:
        # Before the agent starts: a peer may call as soon as this member is listed.
        session.lane = _transport.lane.start(s.rpc_threads)
    # A call of this process that timed out makes the monitor ask for a probe (AgentProbe).
    _context.bind(_context.CallContext(s.name, session.incarnation, members.roster, members.waits, s.rpc_timeout,
                                       members.monitor.call_timed_out))
    _directory.bind(session.groups)
    session._undo.callback(_unbind, session, samehost)
    members.subscribe(_cuda_ipc_departure)  # [cuda ipc hook] a peer's slabs go when it does
    session._undo.callback(members.unsubscribe, _cuda_ipc_departure)


def _budget(session: Session, info: _rendezvous.StoreInfo) -> _descriptors.Budget:
    """What this process's descriptors must cover: more a member where it hosts the store."""
    s = session.settings
    base = _descriptors.BASE if s.collective and not s.elastic else _descriptors.BASE_NO_GLOO
    if info.server is not None:
        return _descriptors.Budget(f"World {s.name!r}", _descriptors.PER_MEMBER_HOST, base,
                                   role="it hosts the store, and every member may call it")
    return _descriptors.Budget(f"World {s.name!r}", _descriptors.PER_MEMBER, base)


def _count_members(session: Session, members: Membership, budget: _descriptors.Budget) -> None:
    """Keep ``budget`` told how many members the elastic World has (it warns when this
    process could not open the descriptors they need)."""
    def count(event: Any) -> None:
        if event.kind != "move":
            budget.joined(1 if event.kind == "join" else -1)

    members.subscribe(count)
    session._undo.callback(members.unsubscribe, count)


def _cuda_ipc_departure(event: Any) -> None:
    if event.kind != "join":  # drops what dead or retired senders left opened here (no-op without CUDA)
        _cuda_ipc.forget_dead()


def _stop_lane(session: Session, drain: float) -> None:
    """This World's share of the process's lane ends (once); the last World's closes it,
    its calls under way answering within ``drain`` seconds."""
    if session.lane is not None:
        session.lane = None
        _transport.lane.stop(drain)


def _shutdown_rpc(session: Session, graceful: bool, timeout: float) -> None:
    """Stop serving calls: the lane's, then the agent's, within ``timeout`` seconds (the
    agent's shutdown takes at least its own second; see ``_transport.shutdown``)."""
    deadline = time.monotonic() + timeout
    _stop_lane(session, max(0.0, timeout))
    _transport.shutdown(graceful, max(0.0, deadline - time.monotonic()))


def _unbind(session: Session, samehost: _samehost.SameHost) -> None:
    _stop_lane(session, 1.0)  # (a start that failed before RPC: its calls need the tables)
    _directory.bind(None)
    _context.bind(None)
    _serve.bind_tables(None)
    _samehost.bind(None)  # [shm hook] then free this process's segments
    samehost.close()


def _membership(session: Session, info: _rendezvous.StoreInfo, keys: Keys) -> Membership:
    s = session.settings
    members = session.membership = Membership(info.store, keys, info.owner, s.name, s.liveness, s.elastic)
    # Its thread starts last; stopping it is the first undo (see the step list).
    session._undo.callback(members.close)
    # The owner look-ups' own store connection opens while this member joins, not at its
    # first call (a store host may take seconds to answer a new connection).
    members.registry.warm()
    groups = session.groups = GroupDirectory(members, session.tables, s.rpc_timeout, s.dist_timeout)
    session._undo.callback(groups.close)
    return members


# ---------------------------------------------------------------------- start-up
def start_static(session: Session) -> None:
    """Start a static World (the steps in the module doc)."""
    s = session.settings
    deadline = time.monotonic() + s.dist_timeout
    info = _open(session)
    _budget(session, info).check(s.size)  # (warns only)
    if s.rpc:  # after the store (a wrong address or environment is named first), before the others wait
        _transport.claim_worker_id(s.rank)
    # Under torchrun, the round its ranks agree on (see rounds: its restart count is no round).
    restart = agree_round(info.store, s.rank, s.size, deadline, f"{info.host}:{info.port}") \
        if os.environ.get("TORCHELASTIC_RUN_ID") else "0"
    # A namespace per world incarnation (see Keys.static_counter).
    mine = info.store.add(Keys.static_counter(restart, s.rank), 1)
    keys = Keys.static_world(restart, mine)
    members = _membership(session, info, keys)
    reg = members.registry
    ranks = [str(r) for r in range(s.size)]
    reg.set(keys.proc_prefix() + str(s.rank), process_identity())
    reg.set(keys.size_prefix() + str(s.rank), str(s.size))  # before the name: whoever sees a name sees it
    reg.set(keys.name_prefix() + str(s.rank), s.name)
    held = seat_held(info, restart, s.rank, mine) if mine > 1 else None
    if held is not None:  # (at once: waiting out dist_timeout for ranks of another job helps nobody)
        give_back_seat(info, keys, restart, s.rank)
        raise held
    try:
        reg.wait_all(keys.name_prefix(), ranks, deadline_left(deadline), "World start-up: ranks", s.dist_timeout)
    except TimeoutError as err:
        if mine > 1:  # the world before this one on the store, when its size was another
            try:
                check_sizes(reg, info, Keys.static_world(restart, mine - 1), s.rank, s.size, ["0"], remove=False)
            except ValueError:
                give_back_seat(info, keys, restart, s.rank)
                raise
        stranger = stranger_error(info, restart, s.rank, s.size, mine)
        if stranger is not None:
            give_back_seat(info, keys, restart, s.rank)
            raise stranger
        raise TimeoutError(f"{err}: this static world has world_size={s.size} ranks (0 to {s.size - 1}), each "
                           f"started with init_method tcp://{info.host}:{info.port}; start the missing ones, pass the "
                           f"world_size you start, or a larger dist_timeout if they start slowly") from None
    check_sizes(reg, info, keys, s.rank, s.size, ranks)
    names = reg.values(keys.name_prefix(), ranks)
    if len(set(names)) != len(names):
        clash = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"member names must be unique; ranks {names} share {clash}")
    members.enter_static(s.rank, names, reg.values(keys.proc_prefix(), ranks))
    _bind(session, members)
    if s.collective:
        with session.network_hint():
            dist.init_process_group(
                s.backend, store=dist.PrefixStore(keys.pg_prefix(), info.store), rank=s.rank,
                world_size=s.size, timeout=datetime.timedelta(seconds=s.dist_timeout),
            )
        session._undo.callback(session.retired_groups.release)  # runs after the destruction below
        session.process_group = Once(dist.destroy_process_group)
        session._undo.callback(session.process_group)
    if s.rpc:
        # (what is left of the start's time: its connect, then torch's rendezvous in it)
        session.rpc_store = own_client(info.store, datetime.timedelta(seconds=max(deadline_left(deadline), 1.0))) \
            or info.store
        url = _rendezvous.rpc_init_method(dist.PrefixStore(keys.rpc_prefix(), session.rpc_store), s.rank, s.size)
        # (after the agent's shutdown: its connection closes at stop, not when a cycle
        # holding the session is collected)
        session._undo.callback(setattr, session, "rpc_store", None)
        session._undo.callback(_rendezvous.forget_rpc_store, url)
        with session.network_hint():
            _transport.start_static(s.name, s.rank, s.size, url, s.rpc_threads, s.rpc_timeout, s.rpc_transports,
                                    _static_channels(members, names))
        session.rpc = Once(functools.partial(_shutdown_rpc, session))
        session._undo.callback(session.rpc, False, 1.0)
    reg.set(keys.ready_prefix() + str(s.rank), "1")
    reg.wait_all(keys.ready_prefix(), ranks, deadline_left(deadline), "World start-up: ready barrier, ranks",
                 s.dist_timeout)
    members.start_liveness()
    session._undo.callback(members.close)


def _static_channels(members: Membership, names: List[str]) -> Optional[List[str]]:
    """TensorPipe's channels for a static World: the elastic list where every rank runs on
    this host (each rank decides alike, from the identities all exchanged), else torch's
    default list (its multi-lane TCP channel carries large tensors between hosts)."""
    here = members.roster.on_this_host
    return list(_transport.ELASTIC_CHANNELS) if all(here(name) for name in names) else None


def _refuse_a_static_store(store: dist.Store, restart: str, where: str) -> None:
    """Raise ValueError when ``store`` holds a static world and no elastic one: an elastic
    World joined it into a world of its own, alone, seen by nobody (cold trial 28)."""
    if value_or_empty(store, Keys.static_counter(restart, 0)) and not value_or_empty(
            store, Keys.elastic_world(restart).log_count()):
        raise ValueError(f"the store at {where} is a static world's (fixed ranks: World(name, rank, world_size), "
                         f"or launch without max_restarts), which an elastic World cannot join: start that job "
                         f"elastic (launch(..., max_restarts=...), or World(..., elastic=True) in every member), or "
                         f"give this World a store of its own")


def start_elastic(session: Session) -> None:
    """Join (or, with ``rank=0``, found) an elastic world (the steps in the module doc)."""
    s = session.settings
    deadline = time.monotonic() + s.dist_timeout
    info = _open(session)
    # On a torchrun job's own store, the round its workers agree on (see rounds), as a
    # static World's: every worker of the round takes part, by torchrun's RANK and
    # WORLD_SIZE. A World on a store of its own (init_method, store) keeps one namespace:
    # it outlives torchrun's restarts, and the restarted workers rejoin it.
    job_store = os.environ.get("TORCHELASTIC_RUN_ID") and s.init_method is None and s.store is None
    restart = agree_round(info.store, *_rendezvous.resolve_rank_and_size(None, None), deadline,
                          f"{info.host}:{info.port}") if job_store else "0"
    _refuse_a_static_store(info.store, restart, f"{info.host}:{info.port}")
    members = _membership(session, info, Keys.elastic_world(restart))
    _count_members(session, members, _budget(session, info))
    members.enter(None if s.rank < 0 else s.rank, deadline)
    session.rank, session.incarnation = members.endpoint.rank, members.endpoint.incarnation
    _bind(session, members)
    with session.network_hint():
        members.join_rpc(s.rpc_threads, min(s.rpc_timeout, 10.0), deadline, s.rpc_timeout, s.rpc_transports)
    session._undo.callback(members.endpoint.let_go)  # (after the agent's shutdown, below)
    session.rpc = Once(functools.partial(_shutdown_rpc, session))
    session._undo.callback(session.rpc, False, 1.0)
    if info.hosted_here:
        members.note_store_host()
    members.announce()
    session._undo.callback(members.close)
    _see_itself(members, deadline)


def _see_itself(members: Membership, deadline: float) -> None:
    """Wait, until ``deadline``, for this member's own view to list it.

    Why: the first catch-up stops below a position whose post is still being written (many
    members joining at once; such a hole is skipped after ``HOLE_WAIT``), and a World that
    returned before it saw its own join told its first ``register`` in an open group "not
    a member" (CI once: 16 members joining on 2 cores).

    Raises:
        PeerLostError: the others declared it lost meanwhile.
        TimeoutError: not listed by ``deadline`` (at least ``HOLE_WAIT`` and half a second
            from now; the log could not be read).
    """
    name, roster = members.name, members.roster
    # (at least past the hole's skip: a start that used its timeout up to here is not
    # failed for a hole that every reader skips a second later)
    deadline = max(deadline, time.monotonic() + HOLE_WAIT + 0.5)
    while name not in roster.members():
        if roster.cut_off is not None:
            raise roster.cut_off
        if deadline_left(deadline) <= 0:
            raise TimeoutError(f"World start-up: member {name!r} posted its join, but did not read it back from "
                               f"the world's log within the start's timeout (dist_timeout)")
        members.catch_up()
        with contextlib.suppress(TimeoutError):  # (the liveness tick may deliver it first)
            roster.wait_until(lambda live: name in live, min(0.05, deadline_left(deadline)))
