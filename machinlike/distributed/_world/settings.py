"""Settings: a World's arguments, checked once at the public boundary, then frozen.

``World(...)`` takes machin's keyword names and its own; :func:`settings` resolves the
aliases, reads torchrun's environment for a static world's rank and size, checks every
value (the message names the parameter and the fix) and returns one immutable
:class:`Settings`. Nothing downstream re-checks or mutates it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch.distributed as dist

from ... import _checks
from ...exception import NoCollectivesError
from .._transport import netif as _netif
from .._store import rendezvous as _rendezvous
from .._calls import samehost as _samehost

__all__ = ["Settings", "settings", "BACKENDS", "no_collectives"]

BACKENDS = _checks.BACKENDS


@dataclass(frozen=True)
class Settings:
    """A World's validated arguments (see :class:`~machinlike.distributed.World`).

    Attributes:
        rank: This process's rank; -1 in an elastic world that picks one at start-up.
        size: Ranks of a static world; 0 in an elastic one.
        interface: The interface the user asked for (None: choose one at start-up).
        collective: Whether the default process group starts (never in an elastic world).
    """

    name: str
    rank: int
    size: int
    elastic: bool
    init_method: Optional[str]
    backend: str
    rpc_timeout: float
    rpc_threads: int
    collective: bool
    rpc: bool
    dist_timeout: float
    store: Optional[dist.Store]
    interface: Optional[str]
    liveness: Optional[float]
    same_host_shm: bool
    shm_threshold: int
    shm_cache_bytes: int
    cuda_ipc_cache_bytes: int = 4 << 30
    same_host_lane: bool = True

    @property
    def rpc_transports(self) -> Optional[List[str]]:
        """TensorPipe's transports: TCP only when the lane carries same-host calls (shm
        polls); None: torch's default list."""
        return ["uv"] if self.same_host_lane else None


def no_collectives(s: Settings) -> NoCollectivesError:
    """Why a World of these settings makes no collective group, and what to do instead."""
    why = ("is elastic (gloo groups have fixed members; launch(max_restarts=...) makes its ranks an elastic "
           "World)" if s.elastic else "was created with collective=False (machin's init_dist=False)")
    fix = ": reduce through an RpcGroup or a PushPullGradServer instead, or launch without restarts" \
        if s.elastic else ""
    return NoCollectivesError(f"this World {why}; collective groups need a static World with collective=True{fix}")


def settings(name: Optional[str], rank: Optional[int], world_size: Optional[int], *, init_method: Optional[str],
             backend: str, rpc_timeout: float, rpc_threads: int, collective: bool, init_rpc: bool,
             dist_timeout: float, store: Optional[dist.Store], interface: Optional[str], elastic: bool,
             liveness: Optional[float], init_dist: Optional[bool], dist_backend: Optional[str],
             dist_init_method: Optional[str], rpc_init_method: Optional[str], same_host_shm: bool,
             shm_threshold: int, shm_cache_bytes: int, cuda_ipc_cache_bytes: int = 4 << 30,
             same_host_lane: bool = True) -> Settings:
    """``World``'s keywords, resolved and checked (see its docstring for each).

    Raises:
        ValueError, TypeError: an invalid argument (the message names it and the fix).
    """
    collective = collective if init_dist is None else bool(init_dist)
    backend = dist_backend or backend
    init_method = init_method or dist_init_method or rpc_init_method
    _checks.optional_str("init_method", init_method)
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not a torch.distributed backend; use one of {list(BACKENDS)}")
    elastic = _checks.boolean("elastic", elastic)
    if elastic:
        if world_size is not None:
            raise ValueError(f"world_size={world_size!r}: an elastic world has no fixed size; pass "
                             f"world_size=None (or elastic=False for a static world)")
        if rank is not None:
            _checks.positive_int("rank", rank, minimum=0)
        my_rank, size = (rank if rank is not None else -1), 0
        collective = False
    else:
        my_rank, size = _rendezvous.resolve_rank_and_size(rank, world_size)
    member = str(my_rank) if name is None else name
    if elastic and name is None and rank is None:
        raise ValueError("an elastic World needs a name (or a rank): World(name='actor-3', elastic=True, ...)")
    _checks.member_name(member)
    rpc_wait = _checks.seconds("rpc_timeout", rpc_timeout)
    dist_wait = _checks.seconds("dist_timeout", dist_timeout)
    bound = None if liveness is None else _checks.seconds("liveness", liveness)
    _checks.positive_int("rpc_threads", rpc_threads)
    if store is not None and not isinstance(store, dist.Store):
        raise TypeError(f"store must be a torch.distributed.Store, not {type(store).__name__}")
    if elastic and not init_rpc:
        raise ValueError("an elastic World needs RPC (init_rpc=True): membership travels through it")
    configured = _netif.configured_interface(interface)
    _samehost.check_settings(same_host_shm, shm_threshold, shm_cache_bytes)  # [shm hook]
    _samehost.check_cuda_ipc(cuda_ipc_cache_bytes)  # [cuda ipc hook]
    if not isinstance(same_host_lane, bool):
        raise TypeError(f"same_host_lane must be a bool, not {type(same_host_lane).__name__}")
    return Settings(
        name=member, rank=my_rank, size=size, elastic=elastic, init_method=init_method, backend=backend,
        rpc_timeout=rpc_wait, rpc_threads=rpc_threads, collective=bool(collective), rpc=bool(init_rpc),
        dist_timeout=dist_wait, store=store, interface=configured, liveness=bound, same_host_shm=same_host_shm,
        shm_threshold=shm_threshold, shm_cache_bytes=shm_cache_bytes, cuda_ipc_cache_bytes=cuda_ipc_cache_bytes,
        same_host_lane=same_host_lane,
    )
