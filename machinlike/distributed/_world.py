"""World: this process's membership in the distributed job (one per process).

Start-up, in order; ``World(...)`` returns only after the last step, on every rank, so no
request can reach a half-built world:

    open the store (host it on rank 0, or join)        _rendezvous.open_store
    exchange member names (duplicates refused)         store keys  mlk/<n>/w/name/<rank>
                                                       (<n>: restart count / incarnation)
    bind the local service tables                      incoming RPCs can find them
    init the default process group (collective=True)   store prefix  mlk/<n>/pg
    init RPC over TensorPipe (init_rpc=True)           rendezvous through the same store
    ready barrier                                      store keys  mlk/<n>/w/ready/<rank>

``stop(timeout)`` runs the same way backwards and never waits past its deadline: a stop
barrier; a graceful RPC shutdown only when every peer arrived, else a local one.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import logging
import os
import threading
import time
import warnings
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, TypeVar

import torch.distributed as dist
from torch.distributed import rpc

from . import _calls, _netif, _rendezvous, _samehost, _state
from ._collective import CollectiveGroup
from ._liveness import alive_here, process_identity
from ._registry import Registry, deadline_left
from ._rpc_group import RpcGroup, check_group_name
from ._state import require_world

__all__ = ["World", "get_world", "is_world_initialized", "get_cur_rank", "get_cur_name"]

log = logging.getLogger(__name__)
F = TypeVar("F", bound=Callable[..., Any])



def _positive(param: str, value: Optional[float]) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{param}={value!r} must be a positive number of seconds")
    return float(value)


def _check_name(name: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, not {type(name).__name__}")
    if not name or len(name) >= 128 or not all(c.isalnum() or c in "_:-" for c in name):
        raise ValueError(
            f"name={name!r} is not a valid member name: use 1-127 letters, digits, '_', ':' or '-'"
        )


def _require_live(method: F) -> F:
    @functools.wraps(method)
    def wrapper(self: "World", *args: Any, **kwargs: Any) -> Any:
        if self._stopped:
            raise RuntimeError(f"World {self.name!r} has been stopped; create a new World")
        return method(self, *args, **kwargs)

    return wrapper  # type: ignore[return-value]


class World:
    """This process's place in a distributed job: RPC, collectives and the group registry.

    Args:
        name: Member name, unique in the world (letters, digits, ``_:-``). None: ``str(rank)``.
        rank: This process's rank. None: the ``RANK`` environment variable (torchrun).
        world_size: Number of processes. None: ``WORLD_SIZE``.
        init_method: ``"tcp://host:port"`` (rank 0 hosts the store there), ``"env://"``, or
            None: ``MASTER_ADDR``/``MASTER_PORT`` when set (torchrun), else 127.0.0.1:29500.
        backend: Backend of the default process group (``"gloo"``, ``"nccl"``).
        rpc_timeout: Default timeout of RPC calls, seconds.
        rpc_threads: RPC worker threads serving incoming calls.
        collective: Initialise the default process group (collectives). machin: ``init_dist``.
        init_rpc: Initialise RPC (needed by RpcGroups and the servers).
        dist_timeout: Timeout of start-up, collectives and group creation, seconds.
        store: An existing ``TCPStore`` to use instead of ``init_method`` (e.g. the launcher's).
        interface: Network interface that TensorPipe (RPC) and gloo (collectives) use on
            this host, by name (``"eth0"``) or by one of its addresses. None:
            ``MACHINLIKE_SOCKET_IFNAME`` when set, else ``TP_SOCKET_IFNAME`` /
            ``GLOO_SOCKET_IFNAME`` each when set, else the interface this host reaches the
            master through (``lo`` for a loopback master). The chosen one is ``interface``.
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
        rank: This process's rank, in ``[0, world_size)``.
        world_size: Number of processes in the world.
        rpc_timeout: Default timeout of RPC calls, seconds.
        dist_timeout: Default timeout of start-up, barriers, collectives and group
            creation, seconds.
        interface: The interface TensorPipe uses on this host (None: its own guess from the
            hostname, when neither a setting nor the route to the master tells).

    Raises:
        ValueError, TypeError: invalid arguments (the message names the parameter).
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
        self.rank, self.world_size = _rendezvous.resolve_rank_and_size(rank, world_size)
        self.name = str(self.rank) if name is None else name
        _check_name(self.name)
        self.rpc_timeout = _positive("rpc_timeout", rpc_timeout)
        self.dist_timeout = _positive("dist_timeout", dist_timeout)
        if isinstance(rpc_threads, bool) or not isinstance(rpc_threads, int) or rpc_threads < 1:
            raise ValueError(f"rpc_threads={rpc_threads!r} must be a positive int")
        if store is not None and not isinstance(store, dist.Store):
            raise TypeError(f"store must be a torch.distributed.Store, not {type(store).__name__}")
        interface = _netif.configured_interface(interface)
        _samehost.check_settings(same_host_shm, shm_threshold, shm_cache_bytes)  # [shm hook]
        self._shm_settings = (same_host_shm, shm_threshold, shm_cache_bytes)
        self._samehost: Optional[_samehost.SameHost] = None
        self._collective_on = bool(collective)
        self._rpc_on = bool(init_rpc)
        self._stopped = False
        self._stop_lock = threading.Lock()
        self._groups: Dict[str, RpcGroup] = {}
        self._group_epochs: Dict[str, int] = {}
        self._collective_groups: List[CollectiveGroup] = []
        self._rpc_url: Optional[str] = None
        self._rpc_running = False
        self._pg_running = False
        self._members: List[str] = []
        self._identities: Dict[str, str] = {}
        self._saved_env: Dict[str, Optional[str]] = {}
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
    def _start(self, init_method: Optional[str], backend: str, rpc_threads: int,
               store: Optional[dist.Store], interface: Optional[str]) -> None:
        deadline = time.monotonic() + self.dist_timeout
        if store is None:
            info = _rendezvous.open_store(self.rank, self.world_size, init_method, self.dist_timeout)
        else:
            base = store
            while isinstance(base, dist.PrefixStore):  # where the server is, for the interface choice
                base = base.underlying_store
            info = _rendezvous.StoreInfo(store, getattr(base, "host", "?"), getattr(base, "port", 0),
                                         False, "the launcher")
        self._store_info = info
        self._set_interface(interface, info.host, info.port)
        # A namespace per world incarnation: a store may outlive a world (torchrun's agent
        # store outlives restarted workers, and a process may build a new World on it), and
        # stale keys (gloo addresses, names, barriers) must not leak into the next one. The
        # k-th World of every rank on this store meets the k-th World of the others.
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        incarnation = info.store.add(f"mlk/{restart}/incarnation/{self.rank}", 1)
        self._ns = f"mlk/{restart}/{incarnation}/"
        self._registry = Registry(info.store, info.owner)
        ranks = [str(r) for r in range(self.world_size)]
        self._registry.set(f"{self._ns}w/proc/{self.rank}", process_identity())
        self._registry.set(f"{self._ns}w/name/{self.rank}", self.name)
        self._registry.wait_all(f"{self._ns}w/name/", ranks, deadline_left(deadline),
                                "World start-up: ranks", self.dist_timeout)
        names = self._registry.values(f"{self._ns}w/name/", ranks)
        self._identities = dict(zip(names, self._registry.values(f"{self._ns}w/proc/", ranks)))
        if len(set(names)) != len(names):
            clash = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"member names must be unique; ranks {names} share {clash}")
        self._members = sorted(names)
        self._tables = _calls.LocalTables(self.name)
        self._tables.resolve_owner = self._resolve_service_owner
        _calls.bind_tables(self._tables)
        self._samehost = _samehost.SameHost(*self._shm_settings, lambda m: self._identities.get(m))  # [shm hook]
        _samehost.bind(self._samehost)
        if self._collective_on:
            with self._network_hint():
                dist.init_process_group(
                    backend, store=dist.PrefixStore(f"{self._ns}pg", info.store), rank=self.rank,
                    world_size=self.world_size, timeout=datetime.timedelta(seconds=self.dist_timeout),
                )
            self._pg_running = True
        if self._rpc_on:
            self._rpc_url = _rendezvous.rpc_init_method(
                dist.PrefixStore(f"{self._ns}rpc", info.store), self.rank, self.world_size)
            options = rpc.TensorPipeRpcBackendOptions(
                num_worker_threads=rpc_threads, rpc_timeout=self.rpc_timeout,
                init_method=self._rpc_url)
            with warnings.catch_warnings(), self._network_hint():
                # torch's TensorPipe start-up goes through a c10d path it deprecated itself;
                # the warning concerns torch's code, not the caller's.
                warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
                rpc.init_rpc(self.name, rank=self.rank, world_size=self.world_size,
                             rpc_backend_options=options)
            self._rpc_running = True
        self._registry.set(f"{self._ns}w/ready/{self.rank}", "1")
        self._registry.wait_all(f"{self._ns}w/ready/", ranks, deadline_left(deadline),
                                "World start-up: ready barrier, ranks", self.dist_timeout)

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
        held = self._registry.owner(f"{self._ns}rg/{group}/{epoch}/s/{key}")
        return held[2:] if held else None

    # ------------------------------------------------------------------- accessors
    def get_members(self) -> List[str]:
        """Names of all members of the world, sorted."""
        return list(self._members)

    def get_ranks(self) -> List[int]:
        """All ranks of the world, sorted."""
        return list(range(self.world_size))

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        return f"<World {self.name!r} rank {self.rank}/{self.world_size} {state}>"

    def __reduce__(self) -> Any:
        raise TypeError("a World belongs to its process and cannot be pickled; "
                        "call machinlike.distributed.get_world() in the other process")

    # ---------------------------------------------------------------------- groups
    @_require_live
    def create_rpc_group(self, name: str, members: Sequence[str], timeout: Optional[float] = None) -> RpcGroup:
        """Create an RpcGroup; every member must call this, non-members must not.

        Args:
            name: Group name (no ``/`` or ``,``), reusable after every member
                ``destroy()``-ed it.
            members: Member names of the world; must include this process. Every member
                must pass the same names (in any order).
            timeout: Seconds to wait for all members. None: ``dist_timeout``.

        Returns:
            This process's handle of the group.

        Raises:
            TypeError: ``name`` is not a str or ``members`` not a sequence of str.
            ValueError: bad name, unknown or duplicate members, this process not among
                them, members that passed different lists, or the group already exists
                here.
            RuntimeError: the World was created with ``init_rpc=False``, or is stopped.
            TimeoutError: naming the members that never came.
        """
        if not self._rpc_on:
            raise RuntimeError("this World was created with init_rpc=False; RpcGroups need RPC")
        check_group_name(name)
        if isinstance(members, str) or not all(isinstance(m, str) for m in members):
            raise TypeError(f"members must be a sequence of member names (str), not {members!r}")
        members = sorted(members)
        unknown = [m for m in members if m not in self._members]
        if unknown or len(set(members)) != len(members) or not members:
            raise ValueError(
                f"members={members!r} must be distinct names of world members "
                f"({self._members}); unknown: {unknown}"
            )
        if self.name not in members:
            raise ValueError(f"this process ({self.name!r}) is not in members={members}; only members create the group")
        if name in self._groups:
            raise ValueError(f"RpcGroup {name!r} already exists here; destroy() it before creating it again")
        wait = self.dist_timeout if timeout is None else _positive("timeout", timeout)
        epoch = self._group_epochs.get(name, 0)
        self._group_epochs[name] = epoch + 1
        prefix = f"{self._ns}rg/{name}/{epoch}/join/"
        self._registry.set(prefix + self.name, ",".join(members))
        self._registry.wait_all(prefix, members, wait, f"creating RpcGroup {name!r}: members")
        listed = self._registry.values(prefix, members)
        odd = [m for m, v in zip(members, listed) if v != ",".join(members)]
        if odd:
            raise ValueError(f"members of RpcGroup {name!r} disagree: {odd} passed other member lists")
        self._registry.set(f"{self._ns}rg/{name}/current", f"{epoch}/{','.join(members)}")
        group = RpcGroup(name, members, epoch)
        self._groups[name] = group
        return group

    def get_rpc_group(self, name: str) -> Optional[RpcGroup]:
        """The RpcGroup ``name``: this process's own, else a handle if it exists, else None.

        A handle of a group this process is not a member of can call its services and
        read its values, but cannot register or pair.

        Args:
            name: Group name.

        Returns:
            The group, or None when no group of that name exists in the world.
        """
        group = self._groups.get(name)
        if group is not None:
            return group
        record = self._registry.owner(f"{self._ns}rg/{name}/current")
        if record is None:
            return None
        epoch, members = record.split("/", 1)
        return RpcGroup(name, members.split(","), int(epoch))

    def _forget_group(self, group: RpcGroup) -> None:
        if self._groups.get(group.get_group_name()) is group:
            del self._groups[group.get_group_name()]

    @_require_live
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
            RuntimeError: the World was created with ``collective=False``, or is stopped.
        """
        if not self._collective_on:
            raise RuntimeError("this World was created with collective=False; collective groups need it")
        group = CollectiveGroup.create(ranks, self.rank, self.world_size, backend,
                                       self.dist_timeout if timeout is None else _positive("timeout", timeout))
        self._collective_groups.append(group)
        return group

    # -------------------------------------------------------------------- shutdown
    def stop(self, timeout: Optional[float] = None) -> None:
        """Leave the world: gracefully when every peer stops too, else locally.

        Waits at most ``timeout`` seconds (None: ``dist_timeout``) for every member to call
        ``stop``. When all did and are still alive, RPC shuts down gracefully (pending calls
        finish); otherwise, or when the graceful shutdown fails, locally. Each phase of the
        graceful shutdown is bounded by what is left of ``timeout``, so only a peer that
        dies in the middle of it can delay ``stop`` to about twice ``timeout``. Safe to call
        twice; called on leaving a ``with World(...)`` block.

        Args:
            timeout: Seconds to wait for the peers. None: ``dist_timeout``.

        Raises:
            ValueError: ``timeout`` is not a positive number.
        """
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        wait = self.dist_timeout if timeout is None else _positive("timeout", timeout)
        deadline = time.monotonic() + wait
        everyone = False
        try:
            ranks = [str(r) for r in range(self.world_size)]
            self._registry.set(f"{self._ns}w/stop/{self.rank}", "1")
            self._registry.wait_all(f"{self._ns}w/stop/", ranks, deadline_left(deadline),
                                    "World.stop: ranks", wait)
            # A peer may have reached stop and died since; the graceful shutdown would
            # wait for it far longer than torch's timeout promises.
            everyone = not self._rpc_running or self._peers_alive(deadline)
        except (TimeoutError, ConnectionError) as err:
            log.warning("World %r stops without its peers: %s", self.name, err)
        if self._rpc_running:
            self._shutdown_rpc(everyone, deadline)
        if self._pg_running:
            self._pg_running = False
            dist.destroy_process_group()
        if everyone and self._store_info.hosted_here:
            # Peers may still be talking to the store inside their own shutdown.
            try:
                self._registry.set(f"{self._ns}w/left/{self.rank}", "1")
                self._registry.wait_all(f"{self._ns}w/left/", [str(r) for r in range(1, self.world_size)],
                                        deadline_left(deadline), "World.stop: ranks leaving", wait)
            except (TimeoutError, ConnectionError) as err:
                log.warning("World %r closes its store before all peers left: %s", self.name, err)
        elif everyone:
            try:
                self._registry.set(f"{self._ns}w/left/{self.rank}", "1")
            except ConnectionError:
                pass
        self._teardown_local()

    def _peers_alive(self, deadline: float) -> bool:
        remote = []
        for member, identity in self._identities.items():
            if member == self.name:
                continue
            local = alive_here(identity)
            if local is False:
                log.warning("World %r stops without member %r, whose process is gone", self.name, member)
                return False
            if local is None:
                remote.append(member)
        limit = max(0.1, min(deadline_left(deadline), 5.0))
        pending = [(m, rpc.rpc_async(m, _calls._ping, timeout=limit)) for m in remote]
        for member, fut in pending:
            try:
                fut.wait()
            except RuntimeError as err:
                log.warning("World %r stops without member %r, which does not answer: %s", self.name, member, err)
                return False
        return True

    def _shutdown_rpc(self, everyone: bool, deadline: float) -> None:
        if everyone:
            left = max(deadline_left(deadline), 0.5)
            try:
                self._store_info.store.set_timeout(datetime.timedelta(seconds=left))
                rpc.shutdown(graceful=True, timeout=left)
                self._rpc_running = False
                return
            except Exception as err:  # the local shutdown below still has to happen
                log.warning("World %r: graceful RPC shutdown failed (%s); shutting down locally", self.name, err)
        self._rpc_running = False
        try:
            rpc.shutdown(graceful=False)
        except RuntimeError as err:  # torch already tore the agent down in the failed attempt
            log.debug("local RPC shutdown: %s", err)

    def _teardown_local(self) -> None:
        self._stopped = True
        if self._rpc_url is not None:
            _rendezvous.forget_rpc_store(self._rpc_url)
        if self._rpc_running:
            self._rpc_running = False
            rpc.shutdown(graceful=False)
        if self._pg_running:
            self._pg_running = False
            dist.destroy_process_group()
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
