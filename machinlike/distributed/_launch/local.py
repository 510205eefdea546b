"""The local launcher: N processes on this machine, a World in each, one function run.

With ``max_restarts`` the ranks form an *elastic* world and a rank that fails or dies is
started again in place (same name, next incarnation) while the others go on; a rank named
``essential`` still ends the run when it fails.

    parent                                   rank r (a warm-forkserver child)
    ------                                   --------------------------------
    host the store on 127.0.0.1:0  ───────►  connect; World(name, r, n, store=...)
    wait on result pipes + sentinels         result = fn(world, *args, **kwargs)
         ◄───────────────────────────────── send (ok, result | exception)   then world.stop()
    first failure: kill the other ranks, re-raise it (remote traceback as __cause__)
    a rank that dies without a result: ProcessExitedError naming its exit code / signal
    each failure: how it ended into the world's store, m/exit/<name> (exits.RankExits)
    timeout: each running rank's stacks, one at a time under its name (stacks), kill, raise TimeoutError

Nothing here sleeps or polls: the parent blocks in ``multiprocessing.connection.wait``.
"""

from __future__ import annotations

import os
import signal
import time
from multiprocessing.connection import Connection, wait
import logging
import random
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Set, Union

import torch.distributed as dist

from ... import _checks, _descriptors, _mainguard
from ..._lifeline import watch_parent
from ..._procs import end_processes
from ..._warm import resolve_context
from ...exception import ExceptionWithTraceback, ProcessExitedError
from ...pickle import dumps, loads
from .._store import external_launcher, host_store
from .exits import RankExits, exited
from .rank_fn import check_rank_fn, run_rank_fn
from .stacks import StackFiles, arm, timed_out
from .termination import Termination, deferred

__all__ = ["launch", "LaunchResult", "Restart"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Restart:
    """One restart of a rank by :func:`launch`.

    Attributes:
        rank: The rank that was restarted.
        name: Its member name.
        cause: Why: the exception it raised (with its type) or how its process ended.
        incarnation: The incarnation the restart started (2 for the first restart).
    """

    rank: int
    name: str
    cause: str
    incarnation: int


class LaunchResult(list):
    """The per-rank results of :func:`launch` (a list), plus the restarts it made.

    Attributes:
        restarts: Every :class:`Restart`, in the order they happened.
    """

    def __init__(self, results: Iterable[Any] = (), restarts: Sequence[Restart] = ()) -> None:
        super().__init__(results)
        self.restarts: List[Restart] = list(restarts)


_LAUNCHER_BASE = 20  # launch()'s process before any rank (it imports torch, starts no agent)
_RESERVED = {"rank", "world_size", "store", "init_method", "name"}


def _ignore_interrupt(signum: int, frame: Any) -> None:
    """A rank's SIGINT: nothing (the launcher ends the ranks)."""


def _rank_main(rank: int, world_size: int, name: str, port: int, payload: bytes,
               world_kwargs: Dict[str, Any], conn: Connection, stop_timeout: float, elastic: bool,
               stacks: Optional[str]) -> None:
    watch_parent()
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
        message = (True, run_rank_fn(fn, world, args, kwargs))
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


def _refuse_restarts_in_place(max_restarts: int, chaos: Optional[float]) -> None:
    # Under torchrun or srun the launcher started this process: there is nothing here to
    # kill or restart, and a run without what was asked for would look like a success.
    launcher = external_launcher() or "torchrun"
    if chaos is not None:
        raise ValueError(f"chaos={chaos!r} needs launch() to start the ranks itself, but {launcher} started this "
                         f"one: run the script without {launcher} (launch() then spawns the ranks), or pass "
                         f"chaos=None")
    if max_restarts:
        hint = ("torchrun's --max-restarts restarts the whole worker group" if launcher == "torchrun" else
                "srun restarts nothing; --kill-on-bad-exit ends the step when a task fails")
        raise ValueError(f"max_restarts={max_restarts!r} needs launch() to start the ranks itself, but {launcher} "
                         f"started this one ({hint}): pass max_restarts=0 here, or run without {launcher}")


def _run_here(fn: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]],
              names: Optional[Sequence[str]], stop_timeout: float, world_kwargs: Dict[str, Any],
              asked: int) -> Any:
    from .._store import resolve_rank_and_size
    from .._world import World

    rank, size = resolve_rank_and_size(None, None)  # torchrun's RANK or srun's SLURM_PROCID
    if rank == 0 and size != asked:  # (said once, by rank 0: a job that asked for one size and got another)
        log.warning("launch(world_size=%d) runs in place under %s, whose %d processes are the ranks: the world "
                    "has %d", asked, external_launcher() or "torchrun", size, size)
    name = str(names[rank]) if names is not None else None
    world = World(name, **world_kwargs)
    try:
        return run_rank_fn(fn, world, args, kwargs)  # (records what fn raised as the exit cause)
    finally:
        world.stop(stop_timeout)


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
    max_restarts: int = 0,
    essential: Sequence[Union[int, str]] = (),
    chaos: Optional[float] = None,
    chaos_seed: int = 0,
    **world_kwargs: Any,
) -> LaunchResult:
    """Run ``fn(world, *args, **kwargs)`` in ``world_size`` local processes, a World in each.

    Args:
        fn: The function; lambdas and local functions work (sent by value, see
            :mod:`machinlike.pickle`). An ``async def`` function runs in an event loop
            of its rank (``asyncio.run``).
        world_size: Number of processes (ranks 0..world_size-1).
        args, kwargs: Extra arguments of ``fn`` (copied into each process).
        timeout: Seconds for the whole run; None waits as long as the ranks run (a rank
            that dies still ends the run at once).
        names: Member names per rank. None: ``"0"``, ``"1"``, ...
        ctx: Multiprocessing context; None: the warm forkserver (torch preloaded).
        stop_timeout: Seconds each rank's ``World.stop`` waits for its peers at the end
            (once every rank returned, each stops and ends by itself, for 2 s at most: a
            stop still serving calls, or a thread its function left running, is then
            ended as before); also the grace
            the ranks get when this process is sent SIGTERM (a scheduler's stop or
            preemption): while ``launch`` runs, SIGTERM is passed on to the ranks
            (a rank's own handler may save a checkpoint and return), those still running
            after ``stop_timeout`` are killed, and then this process ends by the signal,
            as it would have at once (a second SIGTERM: at once). Only where SIGTERM has
            its default disposition and ``launch`` runs in the main thread. The ranks
            ignore SIGINT (the programs they run do not): a Ctrl-C raises
            ``KeyboardInterrupt`` here, and the ranks are ended (SIGTERM, then SIGKILL after
            two seconds).
        return_exceptions: Keep going when a rank fails or dies: its slot in the result
            list holds the exception (as ``asyncio.gather`` does). False: the first failure
            ends the run.
        torchrun: Whether this process is one rank started by a cluster launcher
            (torchrun, or srun with more than one task), which then runs ``fn`` itself,
            with a World built from the launcher's environment, instead of starting
            processes; ``world_size`` is then the launcher's. None: detect it
            (``TORCHELASTIC_RUN_ID``, or an srun step of several tasks). This is what lets
            one script run all these ways; ``max_restarts`` and ``chaos`` are then refused
            (``ValueError``): the cluster launcher owns the processes.
        max_restarts: How many times each rank may be restarted after it raised or died;
            0 (the default): the first failure ends the run. Above 0 the ranks form an
            elastic World (no default process group, so no collectives): a restarted rank
            rejoins under its name as the next incarnation (``world.incarnation``) while
            the others go on. There ``world.get_members()`` is who has joined so far:
            ``world.wait_for_members([...])`` first, or create open groups (no
            members list), where a static program passes ``get_members()``. Each restart
            is logged with its cause and listed in the result's ``restarts``.
        essential: Ranks (by rank or name) whose failure still ends the run, restarts or
            not (e.g. the learner).
        chaos: Fault injection: every ``chaos`` seconds, SIGKILL one running rank that is
            not essential, chosen at random (``chaos_seed``); it is restarted like any other
            failure, within ``max_restarts``. None: off.
        chaos_seed: Seed of the chaos victims' choice.
        **world_kwargs: Passed to :class:`World` (``rpc_timeout``, ``collective``, ...).

    Returns:
        ``fn``'s return value of each rank, in rank order (a :class:`LaunchResult`, whose
        ``restarts`` lists the restarts); under torchrun or srun, this rank's value only.

    Raises:
        ValueError, TypeError: bad arguments (named).
        Exception: the first failure of any rank that may not be restarted, with that
            rank's traceback as cause; the other ranks are killed.
        ProcessExitedError: such a rank died without reporting (names exit code / signal).
        TimeoutError: the run exceeded ``timeout`` (stacks of the ranks go to stderr).
    """
    _mainguard.check("launch(...)")
    check_rank_fn(fn)
    _checks.positive_int("world_size", world_size)
    if timeout is not None:
        _checks.seconds("timeout", timeout)
    _checks.positive_int("max_restarts", max_restarts, minimum=0)
    reserved = _RESERVED & set(world_kwargs)
    if reserved:
        raise TypeError(f"launch() sets {sorted(reserved)} itself; do not pass them")
    if torchrun if torchrun is not None else external_launcher() is not None:
        _refuse_restarts_in_place(max_restarts, chaos)
        return LaunchResult([_run_here(fn, args, kwargs, names, stop_timeout, world_kwargs, world_size)])
    names = [str(r) for r in range(world_size)] if names is None else [str(n) for n in names]
    if len(names) != world_size:
        raise ValueError(f"names has {len(names)} entries; world_size is {world_size}")
    vital = _essential_ranks(essential, names)
    if chaos is not None:
        _checks.seconds("chaos", chaos)
        if max_restarts < 1 or len(vital) == world_size:
            raise ValueError(f"chaos={chaos!r} kills ranks that must come back: pass max_restarts >= 1 and "
                             f"leave at least one rank out of essential")
    if elastic := max_restarts > 0:
        world_kwargs = {k: v for k, v in world_kwargs.items() if k not in ("collective", "init_dist")}
    context = resolve_context(ctx, profile="train")  # ranks build optimizers: dynamo preloaded
    _mainguard.check_main_file("launch(...)", context.get_start_method())
    payload = dumps((fn, tuple(args), dict(kwargs or {})))
    # This process hosts the ranks' store and keeps pipes to each: its allowance of open
    # files first (``_descriptors`` says why); the ranks inherit it.
    _descriptors.raise_limit()
    _descriptors.Budget("launch()", _descriptors.PER_RANK_LAUNCHER, base=_LAUNCHER_BASE,
                        role="it hosts their store").check(world_size)
    store = host_store("127.0.0.1", world_size, world_kwargs.get("dist_timeout", 60.0))
    log.info("machinlike.launch: the world's store is at tcp://127.0.0.1:%d; watch it with "
             "python -m machinlike status 127.0.0.1:%d", store.port, store.port)
    job = _Job(context, names, store, payload, world_kwargs, stop_timeout, elastic)
    linger = 0.0  # (a failure, a timeout, a signal: the ranks are ended at once)
    with Termination() as termination:  # SIGTERM here: the ranks get stop_timeout to finish
        try:
            for rank in range(world_size):
                job.start(rank)
            results = job.collect(timeout, return_exceptions, max_restarts, vital, chaos, chaos_seed)
            # Every rank returned and is in its World.stop: it ends by itself (a SIGTERM now
            # would cut the stop short). Its result pipe closes once the stop is over, then
            # its exit gets EXIT_S; a stop still waiting for calls served after 2 s,
            # or a thread its function left running, is SIGTERM's.
            linger = 0.0 if any(isinstance(r, BaseException) for r in results) else min(stop_timeout, 2.0)
            return results
        finally:
            grace = stop_timeout if termination.requested else 2.0
            end_processes([p for p in job.processes if p is not None], grace=grace, reap=5.0, linger=linger,
                          done={p: job.reader_of[r] for r, p in enumerate(job.processes) if p is not None})
            for reader in job.readers:
                reader.close()
            job.stacks.close()
            del store


def _chaos_victims(processes: List[Any], started: List[float], vital: Set[int], results: Dict[int, Any],
                   used: List[int], max_restarts: int, chaos: float) -> List[int]:
    # Only ranks that have run for a whole period: a rank killed while it is still
    # starting would use up its restarts without ever having worked.
    now = time.monotonic()
    return [r for r, p in enumerate(processes)
            if r not in vital and r not in results and used[r] < max_restarts and p is not None and p.is_alive()
            and now - started[r] >= chaos]


def _essential_ranks(essential: Sequence[Union[int, str]], names: List[str]) -> Set[int]:
    if isinstance(essential, (str, int)):
        essential = [essential]
    vital = set()
    for entry in essential:
        if isinstance(entry, int) and not isinstance(entry, bool) and 0 <= entry < len(names):
            vital.add(entry)
        elif isinstance(entry, str) and entry in names:
            vital.add(names.index(entry))
        else:
            raise ValueError(f"essential={list(essential)!r}: {entry!r} is neither a rank in [0, {len(names)}) "
                             f"nor a name in {names}")
    return vital


def _read(conn: Connection) -> Optional[tuple]:
    try:
        return loads(conn.recv_bytes())
    except EOFError:
        return None


class _Job:
    """The ranks' processes and result pipes; starts (and restarts) rank ``r`` in place."""

    def __init__(self, context: Any, names: List[str], store: dist.TCPStore, payload: bytes,
                 world_kwargs: Dict[str, Any], stop_timeout: float, elastic: bool) -> None:
        self.context = context
        self.names = names
        self.port = store.port
        self.payload = payload
        self.world_kwargs = world_kwargs
        self.stop_timeout = stop_timeout
        self.elastic = elastic
        self.processes: List[Any] = [None] * len(names)
        self.readers: List[Connection] = []
        self.reader_of: List[Any] = [None] * len(names)
        self.started: List[float] = [0.0] * len(names)
        self.stacks = StackFiles()  # where a rank writes its stacks when the run times out
        self.exits = RankExits(store, names, elastic)  # how each failed rank ended, into the world's store

    def start(self, rank: int) -> None:
        reader, writer = self.context.Pipe(duplex=False)
        # Not daemonic, so that a rank may start pools and processes of its own; it
        # still cannot outlive this call (killed in launch's finally) or its parent
        # (watch_parent in _rank_main).
        process = self.context.Process(
            target=_rank_main, name=f"rank {rank} ({self.names[rank]!r})", daemon=False,
            args=(rank, len(self.names), self.names[rank], self.port, self.payload, self.world_kwargs, writer,
                  self.stop_timeout, self.elastic, self.stacks.path(rank)))
        with deferred():  # (an interrupted start left a half-sent rank behind: see deferred)
            process.start()
            self.processes[rank] = process
        writer.close()
        self.started[rank] = time.monotonic()
        self.readers.append(reader)
        self.reader_of[rank] = reader

    def collect(self, timeout: Optional[float], return_exceptions: bool, max_restarts: int,
                vital: Set[int], chaos: Optional[float] = None, chaos_seed: int = 0) -> LaunchResult:
        deadline = None if timeout is None else time.monotonic() + timeout
        rng = random.Random(chaos_seed)
        next_kill = None if chaos is None else time.monotonic() + chaos
        results: Dict[int, Any] = {}
        restarts: List[Restart] = []
        used = [0] * len(self.names)
        waiting: Dict[Any, tuple] = {}

        def watch(rank: int) -> None:
            waiting[self.reader_of[rank]] = ("report", rank)
            waiting[self.processes[rank].sentinel] = ("exit", rank)

        for rank in range(len(self.names)):
            watch(rank)
        while waiting:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if next_kill is not None:
                to_kill = max(0.0, next_kill - time.monotonic())
                left = to_kill if left is None else min(left, to_kill)
            ready = wait(list(waiting), timeout=left)
            if next_kill is not None and time.monotonic() >= next_kill:
                assert chaos is not None  # an invariant: next_kill is set only with chaos
                next_kill = time.monotonic() + chaos
                self._chaos_kill(rng, vital, results, used, max_restarts, chaos)
                continue
            if not ready:
                timed_out(self.processes, results, timeout, self.stacks)
            for handle in ready:
                if handle not in waiting:
                    continue  # dropped with its rank's restart in this same round
                kind, rank = waiting.pop(handle)
                report = None
                if kind == "report":
                    report = _read(handle)  # type: ignore[arg-type]  # a "report" handle is a Connection
                elif rank not in results:
                    # The process ended; its report may still sit in the pipe.
                    reader = self.reader_of[rank]
                    if waiting.pop(reader, None) is not None and reader.poll():
                        report = _read(reader)
                    if report is None:
                        report = (False, exited(self.processes[rank]))
                if report is None:
                    continue  # the pipe closed first; the exit sentinel decides
                ok, value = report
                if not ok:
                    self.exits.record(rank, self.processes[rank].pid, value)
                # (a rank stopped by the main-module guard would stop again when restarted)
                stopped = isinstance(value, ProcessExitedError) and value.exitcode == _mainguard.EXIT_CODE
                if not ok and rank not in vital and used[rank] < max_restarts and not stopped:
                    used[rank] += 1
                    cause = f"{type(value).__name__}: {value}"
                    log.warning("launch: restarting rank %d (%r), restart %d of %d, after %s", rank,
                                self.names[rank], used[rank], max_restarts, cause)
                    restarts.append(Restart(rank, self.names[rank], cause, used[rank] + 1))
                    for stale in (self.reader_of[rank], self.processes[rank].sentinel):
                        waiting.pop(stale, None)
                    old = self.processes[rank]
                    if old.is_alive():
                        old.kill()
                    old.join(5.0)
                    self.start(rank)
                    watch(rank)
                    continue
                if not ok and not return_exceptions:
                    raise value
                results[rank] = value
                # A rank that reported is done: its exit is expected, not a failure.
                waiting.pop(self.processes[rank].sentinel, None)
        return LaunchResult((results[rank] for rank in range(len(self.names))), restarts)

    def _chaos_kill(self, rng: random.Random, vital: Set[int], results: Dict[int, Any], used: List[int],
                    max_restarts: int, chaos: float) -> None:
        victims = _chaos_victims(self.processes, self.started, vital, results, used, max_restarts, chaos)
        if victims:
            rank = rng.choice(victims)
            log.warning("launch: chaos kills rank %d (%r)", rank, self.names[rank])
            self.exits.chaos(self.processes[rank].pid)
            try:
                os.kill(self.processes[rank].pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it ended on its own meanwhile; its sentinel reports it
