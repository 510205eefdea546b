"""What each rank of :func:`launch` runs in its process: its World, ``fn``, its report.

    connect to the launcher's store ─► World(name, r, n | elastic) ─► fn(world, *args, **kwargs)
    send (ok, result | exception) on the result pipe ─► World.stop ─► close the pipe (the launcher
    waits for that close, then for the exit)

Why a module of its own: the parent's side (``job``) and the public call (``local``) never
run here, and a forkserver child imports only what its target needs.
"""

from __future__ import annotations

import os
import signal
from multiprocessing.connection import Connection
from typing import Any, Dict, Optional

import torch

from ..._lifeline import watch_parent
from ...exception import ExceptionWithTraceback
from ...pickle import dumps, loads
from .rank_fn import run_rank_fn
from .stacks import arm

__all__ = ["rank_main"]


def _ignore_interrupt(signum: int, frame: Any) -> None:
    """A rank's SIGINT: nothing (the launcher ends the ranks)."""


def rank_main(rank: int, world_size: int, name: str, port: int, payload: bytes,
              world_kwargs: Dict[str, Any], conn: Connection, stop_timeout: float, elastic: bool,
              stacks: Optional[str], threads: Optional[int] = None) -> None:
    """Rank ``rank``'s whole life: ``payload`` (the pickled ``(fn, args, kwargs)``) run in a
    World on the store at 127.0.0.1:``port``; the outcome sent on ``conn``; stacks written
    to the file ``stacks`` when the launcher asks (SIGUSR2, see ``stacks``). ``threads``:
    torch's intra-op threads here (and ``OMP_NUM_THREADS`` for the rank's own children);
    None: as inherited."""
    watch_parent()
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (forked, not spawned: not the launcher's handler)
    # Ctrl-C is the launcher's to handle (a terminal sends it to every process of the
    # group): it ends every rank (SIGTERM). A rank of its own raised KeyboardInterrupt in
    # fn, and a second Ctrl-C (or timeout(1) passing one on) printed each rank's traceback.
    # A handler that does nothing, not SIG_IGN: a program fn runs (exec) gets the default back.
    signal.signal(signal.SIGINT, _ignore_interrupt)
    arm(stacks)
    from .._store import connect_store
    from .._world import World

    world = None
    me = os.getpid()
    try:
        fn, args, kwargs = loads(payload)
        store = connect_store("127.0.0.1", port, world_kwargs.get("dist_timeout", 60.0))
        if elastic:
            world = World(name, rank, store=store, elastic=True, **world_kwargs)
        else:
            world = World(name, rank, world_size, store=store, **world_kwargs)
        message = (True, run_rank_fn(fn, world, args, kwargs, reported_as=f"rank {rank} ({name!r})"))
    except BaseException as exc:  # reported to the parent, which decides what to raise
        if os.getpid() != me:
            raise  # (a child fn forked, ending: the report and the World are its parent's)
        # (fn's exception was recorded as the exit cause in run_rank_fn, before this report:
        # a parent that ends the run kills this rank)
        message = (False, ExceptionWithTraceback(exc, where=f"rank {rank} ({name!r})"))
    if os.getpid() != me:
        return  # (a child fn forked returned: the same)
    try:
        data = dumps(message)
    except Exception as exc:
        data = dumps((False, ExceptionWithTraceback(
            TypeError(f"rank {rank} returned a result that cannot be pickled: {exc}"),
            where=f"rank {rank} ({name!r})")))
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (a handler of the function's was for its run)
    conn.send_bytes(data)
    if world is not None:
        world.stop(stop_timeout)
    conn.close()  # (after the stop: the launcher waits for it, then for this process's exit)
