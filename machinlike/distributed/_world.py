"""World: this process's membership in the distributed job (one per process).

Two kinds of world share this class:

*static* (the default, machin's ``World(name, rank, world_size)``): a fixed set of ranks.
``World(...)`` returns only after the last step below, on every rank, so no request can
reach a half-built world:

    open the store (host it on rank 0, or join)        _rendezvous.open_store
    exchange member names (duplicates refused)         store keys  mlk/<n>/w/name/<rank>
    init the default process group (collective=True)   store prefix  mlk/<n>/pg
    init RPC over TensorPipe (init_rpc=True)           rendezvous through the same store
    ready barrier, then the liveness monitor starts    store keys  mlk/<n>/w/ready/<rank>

*elastic* (``elastic=True``): members join a running world by its address and a name,
leave it, die and come back; no world size:

    open the store (host it when rank=0, or join)
    claim the name (a dead incarnation's claim is taken over)   Membership.enter
    join the dynamic RPC group, pruning the dead first          Membership.join_transport
    post "join", start the liveness monitor                     Membership.announce

``stop(timeout)`` never waits past its deadline. Static: a stop barrier (a lost member
wakes it at once), a graceful RPC shutdown only when every peer arrived, else a local one.
Elastic: free this member's keys, post "leave", stop RPC locally. Local teardown always
completes (``finally``), so a failed stop never keeps the process from building a new World.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import threading
import time
from typing import Any, Callable, Iterator, List, Optional, Sequence, Union

import torch.distributed as dist

from . import _calls, _checks, _netif, _rendezvous, _samehost, _state, _transport
from ._collective import CollectiveGroup
from ._liveness import process_identity
from ._membership import MemberEvent, Membership
from ._registry import deadline_left
from ._rpc_group import RpcGroup, create_group, open_group
from ._state import require_world

__all__ = ["World", "MemberEvent", "get_world", "is_world_initialized", "get_cur_rank", "get_cur_name"]

log = logging.getLogger(__name__)

_BACKENDS = ("gloo", "nccl", "mpi", "ucc")


class World:
    """This process's place in a distributed job: RPC, collectives and the group registry.

    Args:
        name: Member name, unique among live members (1-100 letters, digits, ``_:-``).
            None: ``str(rank)``.
        rank: This process's rank. None: the ``RANK`` environment variable (torchrun);
            in an elastic world, None picks a fresh unique rank, and ``rank=0`` makes this
            process host the store.
        world_size: Number of processes of a static world. None: ``WORLD_SIZE``. Must be
            None in an elastic world.
        init_method: ``"tcp://host:port"`` (rank 0 hosts the store there), ``"env://"``, or
            None: ``MASTER_ADDR``/``MASTER_PORT`` when set (torchrun), else 127.0.0.1:29500.
        backend: Backend of the default process group (``"gloo"``, ``"nccl"``, ``"mpi"``, ``"ucc"``).
        rpc_timeout: Default timeout of RPC calls, seconds.
        rpc_threads: RPC worker threads serving incoming calls.
        collective: Initialise the default process group (collectives). machin: ``init_dist``.
            Static worlds only (gloo's groups are fixed at creation).
        init_rpc: Initialise RPC (needed by RpcGroups and the servers).
        dist_timeout: Timeout of start-up, collectives and group creation, seconds.
        store: An existing ``TCPStore`` to use instead of ``init_method`` (e.g. the launcher's).
        interface: Network interface that TensorPipe (RPC) and gloo (collectives) use on
            this host, by name (``"eth0"``) or by one of its addresses. None:
            ``MACHINLIKE_SOCKET_IFNAME`` when set, else ``TP_SOCKET_IFNAME`` /
            ``GLOO_SOCKET_IFNAME`` each when set, else the interface this host reaches the
            master through (``lo`` for a loopback master). The chosen one is ``interface``.
        elastic: Join a world whose members come and go (see the module doc); static when False.
        liveness: Seconds within which a member that died without a word is detected
            (heartbeats through the store, and ``/proc`` for members on this host). None
            turns detection off. Default 2.
        init_dist: machin's name for ``collective`` (wins over it when given).
        dist_backend: machin's name for ``backend`` (wins over it when given).
        dist_init_method: machin's name for ``init_method``, used when that is None.
        rpc_init_method: machin's separate RPC rendezvous; there is one store, so it is
            used as ``init_method`` only when neither of the two above is given.
        same_host_shm: CPU tensors of RpcGroup calls between members on this host travel
            through shared memory (see the RPC tutorial). False: always through TensorPipe.
        shm_threshold: Bytes from which a tensor takes shared memory.
        shm_cache_bytes: Bound, in bytes, of this process's recycled segments and, again,
            of its cached mappings of peers' memory.

    Attributes:
        name: This process's member name.
        rank: This process's rank.
        incarnation: 1 for a member's first process, 2 for its first replacement, ...
        rpc_timeout: Default timeout of RPC calls, seconds.
        dist_timeout: Default timeout of start-up, barriers, collectives and group
            creation, seconds.
        interface: The interface TensorPipe uses on this host (None: its own guess from the
            hostname, when neither a setting nor the route to the master tells).
        elastic: Whether members may join and leave.
        store_address: ``"tcp://host:port"`` of the world's store: what a process passes as
            ``init_method`` to join an elastic world.

    Raises:
        ValueError, TypeError: invalid arguments (the message names the parameter), or
            (elastic) a live member already has ``name``.
        RuntimeError: this process already has a World.
        OSError: rank 0 cannot listen on the master address and port (both named).
        TimeoutError: the master (address and port named) cannot be reached, or some rank
            did not arrive, within ``dist_timeout``.
    """

    def __init__(
        self,
        name: Optional[str] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        *,
        init_method: Optional[str] = None,
        backend: str = "gloo",
        rpc_timeout: float = 60.0,
        rpc_threads: int = 16,
        collective: bool = True,
        init_rpc: bool = True,
        dist_timeout: float = 60.0,
        store: Optional[dist.Store] = None,
        interface: Optional[str] = None,
        elastic: bool = False,
        liveness: Optional[float] = 2.0,
        init_dist: Optional[bool] = None,
        dist_backend: Optional[str] = None,
        dist_init_method: Optional[str] = None,
        rpc_init_method: Optional[str] = None,
        same_host_shm: bool = True,
        shm_threshold: int = 1 << 20,
        shm_cache_bytes: int = 1 << 30,
    ) -> None:
        collective = collective if init_dist is None else bool(init_dist)
        backend = dist_backend or backend
        init_method = init_method or dist_init_method or rpc_init_method
        _checks.optional_str("init_method", init_method)
        if not isinstance(backend, str) or backend.lower() not in _BACKENDS:
            raise ValueError(f"backend={backend!r} is not a torch.distributed backend; use one of {list(_BACKENDS)}")
        self.elastic = bool(elastic)
        if self.elastic:
            if world_size is not None:
                raise ValueError(f"world_size={world_size!r}: an elastic world has no fixed size; pass "
                                 f"world_size=None (or elastic=False for a static world)")
            if rank is not None:
                _checks.positive_int("rank", rank, minimum=0)
            self.rank = rank if rank is not None else -1
            self._size = 0
            collective = False
        else:
            self.rank, self._size = _rendezvous.resolve_rank_and_size(rank, world_size)
        self.name = str(self.rank) if name is None else name
        if self.elastic and name is None and rank is None:
            raise ValueError("an elastic World needs a name (or a rank): World(name='actor-3', elastic=True, ...)")
        _checks.member_name(self.name)
        self.rpc_timeout = _checks.seconds("rpc_timeout", rpc_timeout)
        self.dist_timeout = _checks.seconds("dist_timeout", dist_timeout)
        self.liveness = None if liveness is None else _checks.seconds("liveness", liveness)
        _checks.positive_int("rpc_threads", rpc_threads)
        if store is not None and not isinstance(store, dist.Store):
            raise TypeError(f"store must be a torch.distributed.Store, not {type(store).__name__}")
        if self.elastic and not init_rpc:
            raise ValueError("an elastic World needs RPC (init_rpc=True): membership travels through it")
        interface = _netif.configured_interface(interface)
        self.incarnation = 1
        _samehost.check_settings(same_host_shm, shm_threshold, shm_cache_bytes)  # [shm hook]
        self._shm_settings = (same_host_shm, shm_threshold, shm_cache_bytes)
        self._samehost: Optional[_samehost.SameHost] = None
        self._collective_on = bool(collective)
        self._rpc_on = bool(init_rpc)
        self._stopped = False
        self._stop_lock = threading.Lock()
        self._collective_groups: List[CollectiveGroup] = []
        self._rpc_url: Optional[str] = None
        self._rpc_running = False
        self._pg_running = False
        self._membership: Optional[Membership] = None
        self._saved_env: dict = {}
        self.interface: Optional[str] = None

        with _state.lock:
            if _state.current is not None:
                raise RuntimeError(
                    f"this process already has a World ({_state.current.name!r}); stop() it before creating another"
                )
            _state.current = self
        try:
            self._start(init_method, backend, rpc_threads, store, interface)
        except BaseException:
            self._teardown_local()
            raise

    # ------------------------------------------------------------------- start-up
    def _open(self, init_method: Optional[str], store: Optional[dist.Store],
              interface: Optional[str]) -> _rendezvous.StoreInfo:
        if store is None:
            info = _rendezvous.open_store(self.rank, None if self.elastic else self._size, init_method,
                                          self.dist_timeout)
        else:
            base = store
            while isinstance(base, dist.PrefixStore):  # where the server is, for the interface choice
                base = base.underlying_store
            info = _rendezvous.StoreInfo(store, getattr(base, "host", "?"), getattr(base, "port", 0),
                                         False, "the launcher")
        self._store_info = info
        self.store_address = f"tcp://{info.host}:{info.port}"
        self._set_interface(interface, info.host, info.port)
        return info

    def _start(self, init_method: Optional[str], backend: str, rpc_threads: int,
               store: Optional[dist.Store], interface: Optional[str]) -> None:
        deadline = time.monotonic() + self.dist_timeout
        info = self._open(init_method, store, interface)
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        if self.elastic:
            self._start_elastic(info, f"mlk/{restart}/e/", rpc_threads, deadline)
            return
        # A namespace per world incarnation: a store may outlive a world (torchrun's agent
        # store outlives restarted workers, and a process may build a new World on it), and
        # stale keys (gloo addresses, names, barriers) must not leak into the next one. The
        # k-th World of every rank on this store meets the k-th World of the others.
        incarnation = info.store.add(f"mlk/{restart}/incarnation/{self.rank}", 1)
        ns = f"mlk/{restart}/{incarnation}/"
        self._membership = members = Membership(info.store, ns, info.owner, self.name, self.liveness, False)
        reg = members.registry
        ranks = [str(r) for r in range(self._size)]
        reg.set(f"{ns}w/proc/{self.rank}", process_identity())
        reg.set(f"{ns}w/name/{self.rank}", self.name)
        reg.wait_all(f"{ns}w/name/", ranks, deadline_left(deadline), "World start-up: ranks", self.dist_timeout)
        names = reg.values(f"{ns}w/name/", ranks)
        if len(set(names)) != len(names):
            clash = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"member names must be unique; ranks {names} share {clash}")
        members.enter_static(self.rank, names, reg.values(f"{ns}w/proc/", ranks))
        self._bind_tables()
        if self._collective_on:
            with self._network_hint():
                dist.init_process_group(
                    backend, store=dist.PrefixStore(f"{ns}pg", info.store), rank=self.rank,
                    world_size=self._size, timeout=datetime.timedelta(seconds=self.dist_timeout),
                )
            self._pg_running = True
        if self._rpc_on:
            self._rpc_url = _rendezvous.rpc_init_method(dist.PrefixStore(f"{ns}rpc", info.store), self.rank,
                                                        self._size)
            with self._network_hint():
                _transport.start_static(self.name, self.rank, self._size, self._rpc_url, rpc_threads,
                                        self.rpc_timeout)
            self._rpc_running = True
            members.tables.rrefs_stale = _transport.rrefs_bound_elsewhere()
        reg.set(f"{ns}w/ready/{self.rank}", "1")
        reg.wait_all(f"{ns}w/ready/", ranks, deadline_left(deadline), "World start-up: ready barrier, ranks",
                     self.dist_timeout)
        members.start_monitor()

    def _start_elastic(self, info: _rendezvous.StoreInfo, ns: str, rpc_threads: int, deadline: float) -> None:
        self._membership = members = Membership(info.store, ns, info.owner, self.name, self.liveness, True)
        members.enter(None if self.rank < 0 else self.rank, deadline)
        self.rank, self.incarnation = members.rank, members.incarnation
        self._bind_tables()
        with self._network_hint():
            members.join_transport(rpc_threads, min(self.rpc_timeout, 10.0), deadline, self.rpc_timeout)
        self._rpc_running = True
        members.announce()

    def _bind_tables(self) -> None:
        tables = self.membership.tables
        tables.resolve_owner = self._resolve_service_owner
        _calls.bind_tables(tables)
        self._samehost = _samehost.SameHost(*self._shm_settings, self.membership.identity_of)  # [shm hook]
        _samehost.bind(self._samehost)

    def _set_interface(self, interface: Optional[str], master_host: str, master_port: int) -> None:
        # TensorPipe reads its interface from the environment when RPC starts, gloo each
        # time a group is created, so the setting stays for the World's life and the
        # previous values come back at teardown (the next World may have another master).
        self.interface, settings = _netif.plan_interface(interface, master_host, master_port)
        _netif.refuse_loopback_for_remote_master(settings, master_host)
        for var, value in settings.items():
            if os.environ.get(var) != value:
                self._saved_env.setdefault(var, os.environ.get(var))
                os.environ[var] = value
        log.debug("World %r: TensorPipe and gloo use %s (master %s:%s)", self.name, settings or "their own guess",
                  master_host, master_port)

    @contextlib.contextmanager
    def _network_hint(self) -> Iterator[None]:
        # gloo and TensorPipe report an unreachable peer as a bare connection error.
        try:
            yield
        except RuntimeError as err:
            if hasattr(err, "add_note"):  # Python 3.11+
                err.add_note(_netif.describe(self.interface))
            raise

    def _resolve_service_owner(self, sid: str) -> Optional[str]:
        group, epoch, key = sid.split("/", 2)
        held = self.membership.owner(self.membership.key(f"rg/{group}/{epoch}/s/{key}"))
        return held[2:] if held else None

    # ------------------------------------------------------------------- accessors
    @property
    def membership(self) -> Membership:
        """This world's membership tables (live members, events, registry keys)."""
        if self._membership is None:
            raise RuntimeError(f"World {self.name!r} is not started")
        return self._membership

    @property
    def world_size(self) -> int:
        """Number of ranks of a static world; the number of live members of an elastic one."""
        return len(self.membership.members()) if self.elastic else self._size

    def get_members(self) -> List[str]:
        """Names of the live members of the world, sorted."""
        return self.membership.members()

    def get_incarnation(self, member: Optional[str] = None) -> Optional[int]:
        """The incarnation of live ``member`` (None: this process); None when it is not live."""
        return self.incarnation if member is None else self.membership.incarnation_of(member)

    def get_ranks(self) -> List[int]:
        """Ranks of the live members, sorted."""
        return self.membership.ranks()

    def on_member_change(self, callback: Callable[[MemberEvent], None]) -> None:
        """Call ``callback(event)`` on every join, leave and loss from now on.

        Callbacks run one at a time, in the world's event order, on this World's liveness
        thread: keep them short and do not make blocking calls to other members there
        (hand work to your own thread). An exception in a callback is logged and ignored.

        Args:
            callback: Takes a :class:`MemberEvent`.
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, not {type(callback).__name__}")
        self.membership.subscribe(callback)

    def remove_member_callback(self, callback: Callable[[MemberEvent], None]) -> None:
        """Stop calling ``callback`` (no error if it was not registered)."""
        self.membership.unsubscribe(callback)

    def wait_for_members(self, members: Union[int, Sequence[str]], timeout: Optional[float] = None, *,
                         gone: bool = False) -> List[str]:
        """Block until the named members (or at least ``members`` members) are live.

        Args:
            members: Names that must all be live, or a number of live members to reach.
            timeout: Seconds; None: ``dist_timeout``.
            gone: Wait for the opposite instead: none of the named members is live (they
                left or were lost).

        Returns:
            The live members at that moment, sorted.

        Raises:
            TimeoutError: not reached within ``timeout`` (names what was missing).
        """
        wait = _checks.seconds_or_none("timeout", timeout, self.dist_timeout)
        if isinstance(members, int) and not isinstance(members, bool):
            count = _checks.positive_int("members", members)
            return self.membership.wait_until(lambda live: len(live) >= count, wait)
        names = set(_checks.sequence_of_str("members", members))
        if gone:
            return self.membership.wait_until(lambda live: not names & set(live), wait)
        return self.membership.wait_until(lambda live: names <= set(live), wait)

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        kind = "elastic" if self.elastic else f"rank {self.rank}/{self._size}"
        return f"<World {self.name!r} {kind} {state}>"

    def __reduce__(self) -> Any:
        raise TypeError("a World belongs to its process and cannot be pickled; "
                        "call machinlike.distributed.get_world() in the other process")

    # ---------------------------------------------------------------------- groups
    def create_rpc_group(self, group_name: Optional[str] = None, members: Optional[Sequence[str]] = None,
                         timeout: Optional[float] = None, *, name: Optional[str] = None) -> RpcGroup:
        """Create an RpcGroup; every member must call this, non-members must not.

        Args:
            group_name: Group name (no ``/`` or ``,``), reusable after every member
                ``destroy()``-ed it. (``name=`` is accepted too.)
            members: Member names of the world; must include this process. Every member
                must pass the same names (in any order). None: an *open* group of whoever
                is in the world, now or later; each process that calls this joins it at
                once, without waiting for the others.
            timeout: Seconds to wait for all members. None: ``dist_timeout``.

        Returns:
            This process's handle of the group.

        Raises:
            TypeError: ``group_name`` is not a str or ``members`` not a sequence of str.
            ValueError: bad name, unknown or duplicate members, this process not among
                them, members that passed different lists, or the group already exists
                here.
            RuntimeError: the World was created with ``init_rpc=False``, or is stopped.
            TimeoutError: naming the members that never came.
            PeerLostError: a member left or died while it was awaited (named).
        """
        self._require_live()
        if name is not None:
            if group_name is not None:
                raise TypeError("pass the group's name once: group_name=... (machin) or name=...")
            group_name = name
        if group_name is None:
            raise TypeError("create_rpc_group() needs group_name")
        if not self._rpc_on:
            raise RuntimeError("this World was created with init_rpc=False; RpcGroups need RPC")
        wait = _checks.seconds_or_none("timeout", timeout, self.dist_timeout)
        if members is None:
            return open_group(self.membership, group_name)
        return create_group(self.membership, group_name, _checks.sequence_of_str("members", members), wait)

    def get_rpc_group(self, group_name: str) -> Optional[RpcGroup]:
        """The RpcGroup ``group_name``: this process's own, else a handle if it exists, else None.

        A handle of a group this process is not a member of can call its services and
        read its values, but cannot register or pair.

        Args:
            group_name: Group name.

        Returns:
            The group, or None when no group of that name exists in the world.
        """
        group = self.membership.groups.get(group_name)
        if group is not None:
            return group
        record = self.membership.owner(self.membership.key(f"rg/{group_name}/current"))
        if record is None:
            return None
        epoch, members = record.split("/", 1)
        return RpcGroup(group_name, None if members == "*" else members.split(","), epoch)

    def create_collective_group(self, ranks: Sequence[int], backend: Optional[str] = None,
                                timeout: Optional[float] = None) -> CollectiveGroup:
        """Create a collective group over ``ranks`` (global ranks); every process must call it.

        Every process of the world calls it, members or not, with the same ranks and in
        the same order as its other group creations (torch's rule for ``new_group``).

        Args:
            ranks: Global ranks of the members, distinct, in ``[0, world_size)``.
            backend: Backend of the group (``"gloo"``, ``"nccl"``). None: the World's.
            timeout: Timeout of the group's operations, seconds. None: ``dist_timeout``.

        Returns:
            The group; in a process outside ``ranks`` its ``is_member()`` is False.

        Raises:
            TypeError: ``ranks`` is not a sequence of int.
            ValueError: empty, duplicate or out-of-range ranks, or a non-positive timeout.
            RuntimeError: the World was created with ``collective=False`` or is elastic
                (gloo groups are fixed at creation), or is stopped.
        """
        self._require_live()
        if not self._collective_on:
            why = "is elastic (gloo groups have fixed members)" if self.elastic else "was created with collective=False"
            raise RuntimeError(f"this World {why}; collective groups need a static World with collective=True")
        group = CollectiveGroup.create(ranks, self.rank, self._size, backend,
                                       _checks.seconds_or_none("timeout", timeout, self.dist_timeout))
        self._collective_groups.append(group)
        return group

    def _require_live(self) -> None:
        if self._stopped:
            raise RuntimeError(f"World {self.name!r} has been stopped; create a new World")

    # -------------------------------------------------------------------- shutdown
    def stop(self, timeout: Optional[float] = None) -> None:
        """Leave the world.

        Static world: gracefully when every peer stops too, else locally. Waits at most
        ``timeout`` seconds for every member to call ``stop`` (a member known to be lost is
        not waited for). When all did, RPC shuts down gracefully (pending calls finish);
        otherwise, or when the graceful shutdown fails, locally.

        Elastic world: this member's services and values are withdrawn, the others see it
        leave, and RPC stops locally; the process hosting the store first waits (within
        ``timeout``) for the other members to leave, since they need the store.

        Safe to call twice; called on leaving a ``with World(...)`` block.

        Args:
            timeout: Seconds to wait for the peers. None: ``dist_timeout``.

        Raises:
            ValueError: ``timeout`` is not a positive number.
        """
        wait = _checks.seconds_or_none("timeout", timeout, self.dist_timeout)
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        deadline = time.monotonic() + wait
        try:
            if self._membership is not None:
                self._leave_elastic(deadline) if self.elastic else self._leave_static(deadline, wait)
        except Exception as err:  # the local teardown below still has to happen
            log.warning("World %r: stop did not complete (%s); tearing down locally", self.name, err)
        finally:
            self._teardown_local()

    def _leave_static(self, deadline: float, wait: float) -> None:
        members = self.membership
        everyone = False
        names = [str(r) for r in range(self._size)]
        order = members.names_by_rank()
        try:
            members.registry.set(members.key(f"w/stop/{self.rank}"), "1")
            members.wait_all(members.key("w/stop/"), names, order, deadline_left(deadline), "World.stop: ranks", wait)
            everyone = not self._rpc_running or members.members() == sorted(order)
        except (TimeoutError, ConnectionError) as err:
            log.warning("World %r stops without its peers: %s", self.name, err)
        members.close()
        if self._rpc_running:
            self._rpc_running = False
            if everyone:
                self._store_info.store.set_timeout(datetime.timedelta(seconds=max(deadline_left(deadline), 0.5)))
            _transport.shutdown(everyone, max(deadline_left(deadline), 0.5))
        if self._pg_running:
            self._pg_running = False
            dist.destroy_process_group()
        if not everyone:
            return
        try:
            members.registry.set(members.key(f"w/left/{self.rank}"), "1")
            if self._store_info.hosted_here:
                # Peers may still be talking to the store inside their own shutdown.
                members.wait_all(members.key("w/left/"), names[1:], order[1:], deadline_left(deadline),
                                 "World.stop: ranks leaving", wait)
        except (TimeoutError, ConnectionError) as err:
            log.warning("World %r closes its store before all peers left: %s", self.name, err)

    def _leave_elastic(self, deadline: float) -> None:
        members = self.membership
        for group in list(members.groups.values()):
            group.destroy()
        members.leave(deadline)
        if self._store_info.hosted_here:
            try:
                members.wait_until(lambda live: live in ([], [self.name]), deadline_left(deadline))
            except TimeoutError as err:
                log.warning("World %r closes the store while members remain: %s", self.name, err)

    def _teardown_local(self) -> None:
        self._stopped = True
        try:
            if self._membership is not None:
                self._membership.close()
            if self._rpc_url is not None:
                _rendezvous.forget_rpc_store(self._rpc_url)
            if self._rpc_running:
                self._rpc_running = False
                _transport.shutdown(False, 1.0)
            if self._pg_running:
                self._pg_running = False
                dist.destroy_process_group()
        finally:
            for var, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
            self._saved_env.clear()
            with _state.lock:
                if _state.current is self:
                    _calls.bind_tables(None)
                    _samehost.bind(None)  # [shm hook] then free this process's segments
                    if self._samehost is not None:
                        self._samehost.close()
                    _state.current = None

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.stop()


def get_world() -> Optional[World]:
    """This process's World, None if there is none (or it was stopped)."""
    return _state.current


def is_world_initialized() -> bool:
    """Whether this process has a running World."""
    return _state.current is not None


def get_cur_rank() -> int:
    """Rank of this process.

    Raises:
        RuntimeError: this process has no World.
    """
    return require_world().rank


def get_cur_name() -> str:
    """Member name of this process.

    Raises:
        RuntimeError: this process has no World.
    """
    return require_world().name
