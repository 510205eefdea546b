"""World start-up, static or elastic: ``World(...)`` returns only after the last step.

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
    join the dynamic RPC group, pruning the dead first          Endpoint.join            
    post "join", start the liveness monitor                     Membership.announce
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from typing import Iterator, Optional

import torch.distributed as dist

from . import _calls, _netif, _rendezvous, _samehost, _transport
from ._keys import Keys, ServiceOwner
from ._liveness import process_identity
from ._membership import Membership
from ._registry import deadline_left

__all__ = ["WorldStart"]

log = logging.getLogger(__name__)


class WorldStart:
    """The start-up of :class:`~machinlike.distributed.World` (a mixin it inherits).

    Holds no state of its own: what these methods set and use (``_membership``,
    ``_store_info``, ``store_address``, ``interface``, ``_saved_env``, ``_samehost``,
    ``_rpc_url``, ``_rpc_running``, ``_pg_running``, ...) is initialised in
    ``World.__init__``, which owns it and calls ``_start``.
    """

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
            self._start_elastic(info, Keys.elastic_world(restart), rpc_threads, deadline)
            return
        # A namespace per world incarnation: a store may outlive a world (torchrun's agent
        # store outlives restarted workers, and a process may build a new World on it), and
        # stale keys (gloo addresses, names, barriers) must not leak into the next one. The
        # k-th World of every rank on this store meets the k-th World of the others.
        keys = Keys.static_world(restart, info.store.add(Keys.static_counter(restart, self.rank), 1))
        self._membership = members = Membership(info.store, keys, info.owner, self.name, self.liveness, False)
        reg = members.registry
        ranks = [str(r) for r in range(self._size)]
        reg.set(keys.proc_prefix() + str(self.rank), process_identity())
        reg.set(keys.name_prefix() + str(self.rank), self.name)
        reg.wait_all(keys.name_prefix(), ranks, deadline_left(deadline), "World start-up: ranks", self.dist_timeout)
        names = reg.values(keys.name_prefix(), ranks)
        if len(set(names)) != len(names):
            clash = sorted({n for n in names if names.count(n) > 1})
            raise ValueError(f"member names must be unique; ranks {names} share {clash}")
        members.enter_static(self.rank, names, reg.values(keys.proc_prefix(), ranks))
        self._bind_tables()
        if self._collective_on:
            with self._network_hint():
                dist.init_process_group(
                    backend, store=dist.PrefixStore(keys.pg_prefix(), info.store), rank=self.rank,
                    world_size=self._size, timeout=datetime.timedelta(seconds=self.dist_timeout),
                )
            self._pg_running = True
        if self._rpc_on:
            self._rpc_url = _rendezvous.rpc_init_method(dist.PrefixStore(keys.rpc_prefix(), info.store), self.rank,
                                                        self._size)
            with self._network_hint():
                _transport.start_static(self.name, self.rank, self._size, self._rpc_url, rpc_threads,
                                        self.rpc_timeout)
            self._rpc_running = True
            members.tables.rrefs_stale = _transport.rrefs_bound_elsewhere()
        reg.set(keys.ready_prefix() + str(self.rank), "1")
        reg.wait_all(keys.ready_prefix(), ranks, deadline_left(deadline), "World start-up: ready barrier, ranks",
                     self.dist_timeout)
        members.monitor.start()

    def _start_elastic(self, info: _rendezvous.StoreInfo, keys: Keys, rpc_threads: int, deadline: float) -> None:
        self._membership = members = Membership(info.store, keys, info.owner, self.name, self.liveness, True)
        members.enter(None if self.rank < 0 else self.rank, deadline)
        self.rank, self.incarnation = members.endpoint.rank, members.endpoint.incarnation
        self._bind_tables()
        with self._network_hint():
            members.endpoint.join(rpc_threads, min(self.rpc_timeout, 10.0), deadline, self.rpc_timeout)
        self._rpc_running = True
        members.announce()

    def _bind_tables(self) -> None:
        tables = self.membership.tables
        tables.resolve_owner = self._resolve_service_owner
        _calls.bind_tables(tables)
        self._samehost = _samehost.SameHost(*self._shm_settings, self.membership.roster.identity_of)  # [shm hook]
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
        held = self.membership.claims.owner(self.membership.keys.service(group, epoch, key))
        return ServiceOwner.decode(held).worker if held else None
