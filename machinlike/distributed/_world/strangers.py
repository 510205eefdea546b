"""The static world's start-up refusals: a rank that came to a store where another world
runs (a stranger), or with another ``world_size``, and the undoing of its marks there.

    start_static ── counts its worlds on the store (mine) ──► seat_held? ─ yes ─► refused at once
                 waits for the other ranks ── timed out ──► check_sizes / stranger_error
                 every refusal ──► give_back_seat: the count and start-up keys undone

Why a module of its own: what tells a stranger from a late rank reads the store's record of
the world before this one; the session's start-up steps only ask.
"""

from __future__ import annotations

from typing import List, Optional

import torch.distributed as dist

from .._membership import alive_here, pid_in, process_identity
from .._store import rendezvous as _rendezvous
from .._store import Keys, Registry

__all__ = ["check_sizes", "give_back_seat", "seat_held", "stranger_error"]


def check_sizes(reg: Registry, info: _rendezvous.StoreInfo, keys: Keys, rank: int, size: int,
                 ranks: List[str], remove: bool = True) -> None:
    """Refuse a static world whose ranks were started with different ``world_size``s
    (``ranks``' sizes as recorded in ``keys``' namespace; ``remove``: this rank's own
    start-up keys there are deleted first).

    Why: a process started as rank ``r`` with a larger ``world_size`` than a running
    world's is the first World of rank ``r`` on that store, so it lands in the running
    world's namespace, finds every rank it waits for there, and then waited 40 s in
    gloo's rendezvous for ranks that never come ("connectFullMesh failed"). With a
    smaller rank it lands in a namespace of its own and times out; the previous world's
    rank 0 then tells the size it had.

    Raises:
        ValueError: some rank asked for another size (named, with the fix).
    """
    sizes = reg.values_or_empty(keys.size_prefix(), ranks)
    other = {int(r): int(n) for r, n in zip(ranks, sizes) if n and int(n) != size}
    if not other:
        return
    if remove:
        reg.delete([keys.proc_prefix() + str(rank), keys.size_prefix() + str(rank), keys.name_prefix() + str(rank)])
    theirs = sorted(set(other.values()))
    raise ValueError(
        f"World start-up: rank {rank} was started with world_size={size}, but ranks {sorted(other)} of the static "
        f"world at {info.host}:{info.port} were started with world_size={theirs[0] if len(theirs) == 1 else theirs} "
        f"(a running world, or ranks started with different sizes): every rank of a static world passes the same "
        f"world_size; to add a process to a running world, join it as World(name, elastic=True, init_method=...), "
        f"or start every rank of a new static world on a fresh address")


def stranger_error(info: _rendezvous.StoreInfo, restart: str, rank: int, size: int, mine: int) -> Optional[TimeoutError]:
    """The error for a process that came to a *running* static world as rank ``rank``:
    every other rank started exactly one World fewer on this store than this one, and
    that previous World started complete (all its ranks ready); None otherwise (then the
    others are merely late, or never came)."""
    try:
        others = [info.store.add(Keys.static_counter(restart, r), 0) for r in range(size) if r != rank]
        if not others or any(n != mine - 1 for n in others):
            return None
        previous = Keys.static_world(restart, mine - 1)
        if not info.store.check([previous.ready_prefix() + str(r) for r in range(size)]):
            return None
    except (RuntimeError, dist.DistNetworkError):  # the store went away too: the first error stands
        return None
    return TimeoutError(
        f"World start-up: rank {rank} of the static world at {info.host}:{info.port} was taken already "
        f"(that world is running, or ran, on this store) and no other rank came to start another: a static "
        f"world cannot admit a new process; join a running world as World(name, elastic=True, "
        f"init_method=...), or start every rank of a new static world on a fresh address")


def give_back_seat(info: _rendezvous.StoreInfo, keys: Keys, restart: str, rank: int) -> None:
    """Undo a refused stranger's marks on the running world's store: its rank's count of
    worlds (else that job's next World on the store would wait for this rank a world
    ahead) and its start-up keys."""
    seat = str(rank)
    try:
        info.store.add(Keys.static_counter(restart, rank), -1)
        for prefix in (keys.proc_prefix(), keys.size_prefix(), keys.name_prefix()):
            info.store.delete_key(prefix + seat)
    except (RuntimeError, dist.DistNetworkError):  # the store went away: nothing left to undo
        pass


def seat_held(info: _rendezvous.StoreInfo, restart: str, rank: int, mine: int) -> Optional[RuntimeError]:
    """The error for a process that came as rank ``rank`` to a store where the static
    world before this one has that rank held, running, by another live process of this
    host (two jobs given one port: the second's rank 0 could not listen, its other ranks
    reached the first job's store); None otherwise (then ``stranger_error`` may tell,
    once the start-up timed out)."""
    previous = Keys.static_world(restart, mine - 1)
    seat = str(rank)
    try:
        if not info.store.check([previous.proc_prefix() + seat, previous.size_prefix() + seat]) \
                or info.store.check([previous.stop_prefix() + seat]):  # (stopping, or stopped: it was let go)
            return None
        holder = info.store.get(previous.proc_prefix() + seat).decode()
        size = int(info.store.get(previous.size_prefix() + seat).decode())
        # Running: every rank of that world was ready (a world whose start failed holds nobody's seat).
        if not info.store.check([previous.ready_prefix() + str(r) for r in range(size)]):
            return None
    except (RuntimeError, ValueError, dist.DistNetworkError):  # the store went away: the start's own wait tells
        return None
    if holder == process_identity() or alive_here(holder) is not True:
        return None
    return RuntimeError(
        f"World start-up: rank {rank} of the static world at {info.host}:{info.port} is held by process "
        f"{pid_in(holder)} of this host, in a world that is running: a static world cannot admit a "
        f"new process. To join that world, start it and this process as World(name, elastic=True, "
        f"init_method=...); if this process belongs to another job that was given the same port (MASTER_PORT, "
        f"or init_method's), give each job a port of its own")
