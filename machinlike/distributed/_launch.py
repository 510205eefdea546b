"""The local launcher: N processes on this machine, a World in each, one function run.

    parent                                   rank r (a warm-forkserver child)
    ------                                   --------------------------------
    host the store on 127.0.0.1:0  ───────►  connect; World(name, r, n, store=...)
    wait on result pipes + sentinels         result = fn(world, *args, **kwargs)
         ◄───────────────────────────────── send (ok, result | exception)   then world.stop()
    first failure: kill the other ranks, re-raise it (remote traceback as __cause__)
    a rank that dies without a result: ProcessExitedError naming its exit code / signal
    timeout: dump every rank's stacks (SIGUSR1 + faulthandler), kill, raise TimeoutError

Nothing here sleeps or polls: the parent blocks in ``multiprocessing.connection.wait``.
"""

from __future__ import annotations

import datetime
import faulthandler
import os
import signal
import socket
import time
from multiprocessing.connection import Connection, wait
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch.distributed as dist

from .._lifeline import watch_parent
from .._warm import resolve_context
from ..exception import ExceptionWithTraceback, ProcessExitedError
from ..pickle import dumps, loads
from ._rendezvous import external_launcher

__all__ = ["launch"]

_RESERVED = {"rank", "world_size", "store", "init_method", "name"}


def _rank_main(rank: int, world_size: int, name: str, port: int, payload: bytes,
               world_kwargs: Dict[str, Any], conn: Connection, stop_timeout: float) -> None:
    watch_parent()
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from ._rendezvous import connect_store
    from ._world import World

    world = None
    try:
        fn, args, kwargs = loads(payload)
        store = connect_store("127.0.0.1", port, world_kwargs.get("dist_timeout", 60.0))
        world = World(name, rank, world_size, store=store, **world_kwargs)
        message = (True, fn(world, *args, **kwargs))
    except BaseException as exc:  # reported to the parent, which decides what to raise
        message = (False, ExceptionWithTraceback(exc, where=f"rank {rank} ({name!r})"))
    try:
        data = dumps(message)
    except Exception as exc:
        data = dumps((False, ExceptionWithTraceback(
            TypeError(f"rank {rank} returned a result that cannot be pickled: {exc}"),
            where=f"rank {rank} ({name!r})")))
    conn.send_bytes(data)
    conn.close()
    if world is not None:
        world.stop(stop_timeout)


def _run_here(fn: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]],
              names: Optional[Sequence[str]], stop_timeout: float, world_kwargs: Dict[str, Any]) -> Any:
    from ._rendezvous import resolve_rank_and_size
    from ._world import World

    rank = resolve_rank_and_size(None, None)[0]  # torchrun's RANK or srun's SLURM_PROCID
    name = str(names[rank]) if names is not None else None
    world = World(name, **world_kwargs)
    try:
        return fn(world, *args, **(kwargs or {}))
    finally:
        world.stop(stop_timeout)


def _host_store(world_size: int, timeout: float) -> dist.TCPStore:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen(1024)
    port = sock.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, world_size, True, datetime.timedelta(seconds=timeout),
                         wait_for_workers=False, master_listen_fd=sock.detach())


def _kill_all(processes: Sequence[Any], grace: float = 2.0) -> None:
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
            p.join(5.0)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    *,
    timeout: Optional[float] = None,
    names: Optional[Sequence[str]] = None,
    ctx: Any = None,
    stop_timeout: float = 30.0,
    return_exceptions: bool = False,
    torchrun: Optional[bool] = None,
    **world_kwargs: Any,
) -> List[Any]:
    """Run ``fn(world, *args, **kwargs)`` in ``world_size`` local processes, a World in each.

    Args:
        fn: The function; lambdas and local functions work (sent by value, see
            :mod:`machinlike.pickle`).
        world_size: Number of processes (ranks 0..world_size-1).
        args, kwargs: Extra arguments of ``fn`` (copied into each process).
        timeout: Seconds for the whole run; None waits as long as the ranks run (a rank
            that dies still ends the run at once).
        names: Member names per rank. None: ``"0"``, ``"1"``, ...
        ctx: Multiprocessing context; None: the warm forkserver (torch preloaded).
        stop_timeout: Seconds each rank's ``World.stop`` waits for its peers at the end.
        return_exceptions: Keep going when a rank fails or dies: its slot in the result
            list holds the exception (as ``asyncio.gather`` does). False: the first failure
            ends the run.
        torchrun: Whether this process is one rank started by a cluster launcher
            (torchrun, or srun with more than one task), which then runs ``fn`` itself,
            with a World built from the launcher's environment, instead of starting
            processes; ``world_size`` is then the launcher's. None: detect it
            (``TORCHELASTIC_RUN_ID``, or an srun step of several tasks). This is what lets
            one script run all these ways.
        **world_kwargs: Passed to :class:`World` (``rpc_timeout``, ``collective``, ...).

    Returns:
        ``fn``'s return value of each rank, in rank order; under torchrun or srun, a list holding
        this rank's value only.

    Raises:
        Exception: the first failure of any rank, with that rank's traceback as cause; the
            other ranks are killed.
        ProcessExitedError: a rank died without reporting (names exit code / signal).
        TimeoutError: the run exceeded ``timeout`` (stacks of the ranks go to stderr).
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds or None")
    reserved = _RESERVED & set(world_kwargs)
    if reserved:
        raise TypeError(f"launch() sets {sorted(reserved)} itself; do not pass them")
    if torchrun if torchrun is not None else external_launcher() is not None:
        return [_run_here(fn, args, kwargs, names, stop_timeout, world_kwargs)]
    names = [str(r) for r in range(world_size)] if names is None else [str(n) for n in names]
    if len(names) != world_size:
        raise ValueError(f"names has {len(names)} entries; world_size is {world_size}")
    context = resolve_context(ctx, profile="train")  # ranks build optimizers: dynamo preloaded
    payload = dumps((fn, tuple(args), dict(kwargs or {})))
    store = _host_store(world_size, world_kwargs.get("dist_timeout", 60.0))
    processes, readers = [], []
    try:
        for rank in range(world_size):
            reader, writer = context.Pipe(duplex=False)
            # Not daemonic, so that a rank may start pools and processes of its own; it
            # still cannot outlive this call (killed in the finally below) or its parent
            # (watch_parent in _rank_main).
            process = context.Process(
                target=_rank_main, name=f"rank {rank} ({names[rank]!r})", daemon=False,
                args=(rank, world_size, names[rank], store.port, payload, world_kwargs, writer, stop_timeout))
            process.start()
            writer.close()
            processes.append(process)
            readers.append(reader)
        return _collect(processes, readers, timeout, return_exceptions)
    finally:
        _kill_all(processes)
        for reader in readers:
            reader.close()
        del store


def _read(conn: Connection) -> Optional[tuple]:
    try:
        return loads(conn.recv_bytes())
    except EOFError:
        return None


def _collect(processes: List[Any], readers: List[Connection], timeout: Optional[float],
             return_exceptions: bool) -> List[Any]:
    deadline = None if timeout is None else time.monotonic() + timeout
    results: Dict[int, Any] = {}
    waiting: Dict[Any, tuple] = {}
    for rank, (process, reader) in enumerate(zip(processes, readers)):
        waiting[reader] = ("report", rank)
        waiting[process.sentinel] = ("exit", rank)
    while waiting:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready = wait(list(waiting), timeout=left)
        if not ready:
            _timed_out(processes, results, timeout)
        for handle in ready:
            kind, rank = waiting.pop(handle)
            report = None
            if kind == "report":
                report = _read(handle)
            elif rank not in results:
                # The process ended; its report may still sit in the pipe.
                reader = readers[rank]
                if waiting.pop(reader, None) is not None and reader.poll():
                    report = _read(reader)
                if report is None:
                    p = processes[rank]
                    p.join()
                    report = (False, ProcessExitedError(p.name, p.pid, p.exitcode,
                                                        "it ended without reporting a result"))
            if report is not None:
                ok, value = report
                if not ok and not return_exceptions:
                    raise value
                results[rank] = value
    return [results[rank] for rank in range(len(processes))]


def _timed_out(processes: List[Any], results: Dict[int, Any], timeout: Optional[float]) -> None:
    stuck = [p for rank, p in enumerate(processes) if p.is_alive()]
    for p in stuck:
        try:
            os.kill(p.pid, signal.SIGUSR1)  # faulthandler in the rank prints its stacks
        except ProcessLookupError:
            pass
    for p in stuck:
        p.join(1.0)  # give faulthandler a moment to write; the processes are killed anyway
    names = ", ".join(p.name for p in stuck)
    raise TimeoutError(f"launch: {names} did not finish within {timeout:g} s "
                       f"({len(results)} of {len(processes)} ranks reported); their stacks were dumped to stderr")
