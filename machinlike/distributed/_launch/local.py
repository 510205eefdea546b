"""The local launcher: N processes on this machine, a World in each, one function run.

With ``max_restarts`` the ranks form an *elastic* world and a rank that fails or dies is
started again in place (same name, next incarnation) while the others go on; a rank named
``essential`` still ends the run when it fails.

    parent                                   rank r (a warm-forkserver child)
    ------ (local: launch; job: Job)         -------------------------------- (rank_main)
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

import faulthandler
import logging
import os
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Union

from ... import _checks, _descriptors, _mainguard
from ..._procs import end_processes
from ..._warm import resolve_context
from ...pickle import dumps
from .._store import external_launcher, host_store
from .job import Job, LaunchResult, Restart
from .rank_fn import check_rank_call, check_rank_fn, check_world_kwargs, rank_names, run_rank_fn
from .termination import Termination

__all__ = ["launch", "LaunchResult", "Restart"]

log = logging.getLogger(__name__)

_LAUNCHER_BASE = 20  # launch()'s process before any rank (it imports torch, starts no agent)


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


def threads_per_rank(world_size: int) -> Optional[int]:
    """Torch threads for each of ``world_size`` ranks on this machine: the cores this
    process may run on, shared (at least 1 each); None when ``OMP_NUM_THREADS`` is set
    (the ranks then keep it).

    Why: torch starts as many threads as there are cores in every process, so N ranks on
    C cores run N*C threads that wait on each other: a learner beside 6 actors on 2 cores
    made 3-10 updates/s with 2 threads a rank, 110-120 with one (torchrun sets 1 too).
    """
    if os.environ.get("OMP_NUM_THREADS"):
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // world_size)


def _run_here(fn: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]],
              names: Optional[Sequence[str]], stop_timeout: float, world_kwargs: Dict[str, Any],
              asked: int, timeout: Optional[float], return_exceptions: bool) -> Any:
    """This rank's part of a launch run in place (under torchrun or srun): its value, or
    with ``return_exceptions`` what ``fn`` raised. ``timeout`` ends the process after
    dumping its stacks (exit code 1, faulthandler's C watchdog: it fires whatever the main
    thread is blocked in), which ends the job as the launcher's timeout would; cold trial
    32 found both ignored here, a run past its timeout going on for good."""
    from .._store import resolve_rank_and_size
    from .._world import World

    rank, size = resolve_rank_and_size(None, None)  # torchrun's RANK or srun's SLURM_PROCID
    if rank == 0 and size != asked:  # (said once, by rank 0: a job that asked for one size and got another)
        log.warning("launch(world_size=%d) runs in place under %s, whose %d processes are the ranks: the world "
                    "has %d", asked, external_launcher() or "torchrun", size, size)
    # (checked against the launcher's size: a list for another size failed in rank 1 alone)
    name = rank_names(names, size)[rank] if names is not None else None
    if timeout is not None:
        faulthandler.dump_traceback_later(timeout, exit=True)
    try:
        world = World(name, **world_kwargs)
        try:
            return run_rank_fn(fn, world, args, kwargs)  # (records what fn raised as the exit cause)
        except Exception as exc:
            if not return_exceptions:
                raise
            return exc
        finally:
            world.stop(stop_timeout)
    finally:
        if timeout is not None:
            faulthandler.cancel_dump_traceback_later()


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

    Each rank runs torch with ``max(1, cores // world_size)`` threads (``OMP_NUM_THREADS``,
    where set, wins): torch's default of a thread per core in every rank oversubscribes
    the machine.

    Args:
        fn: The function; lambdas and local functions work (sent by value, see
            :mod:`machinlike.pickle`). An ``async def`` function runs in an event loop
            of its rank (``asyncio.run``).
        world_size: Number of processes (ranks 0..world_size-1).
        args, kwargs: Extra arguments of ``fn`` (copied into each process).
        timeout: Seconds for the whole run once the ranks are started (their Worlds'
            start-up included); None waits as long as the ranks run (a rank that dies
            still ends the run at once). Not counted: this process's first start of the
            warm process server (ctx None), a second or three once per process.
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
            (``ValueError``): the cluster launcher owns the processes. ``timeout`` then
            ends this rank's process after dumping its stacks to stderr (exit code 1), and
            ``names`` must have the launcher's world size.
        max_restarts: How many times each rank may be restarted after it raised or died;
            0 (the default): the first failure ends the run. Above 0 the ranks form an
            elastic World (no default process group, so no collectives: a rank that asks
            for a collective group gets :class:`~machinlike.exception.NoCollectivesError`,
            which ends the run, for a restart would fail alike): a restarted rank
            rejoins under its name as the next incarnation (``world.incarnation``) while
            the others go on. There ``world.get_members()`` is who has joined so far:
            ``world.wait_for_members([...])`` first, or create open groups (no
            members list), where a static program passes ``get_members()``. Each restart
            is logged with its cause and listed in the result's ``restarts``.
        essential: Ranks (by rank or name) whose failure still ends the run, restarts or
            not (e.g. the learner). Once every one of them has returned, chaos stops and
            no rank is restarted: a rank that fails then gets its exception as its result
            (logged) where it would have been restarted.
        chaos: Fault injection: every ``chaos`` seconds, SIGKILL one running rank that is
            not essential, chosen at random (``chaos_seed``); it is restarted like any other
            failure, within ``max_restarts``. None: off.
        chaos_seed: Seed of the chaos victims' choice.
        **world_kwargs: Passed to :class:`World` (``rpc_timeout``, ``collective``, ...).

    Returns:
        ``fn``'s return value of each rank, in rank order (a :class:`LaunchResult`, whose
        ``restarts`` lists the restarts); under torchrun or srun, this rank's value only.
        A rank whose ``fn`` called ``sys.exit(0)`` returned None.

    Raises:
        ValueError, TypeError: bad arguments (named).
        Exception: the first failure of any rank that may not be restarted, with that
            rank's traceback as cause; the other ranks are killed.
        ProcessExitedError: such a rank died without reporting (names exit code / signal),
            or its ``fn`` called ``sys.exit(n)``, n != 0 (never a SystemExit here).
        TimeoutError: the run exceeded ``timeout`` (stacks of the ranks go to stderr).
    """
    _mainguard.check("launch(...)")
    check_rank_fn(fn)
    _checks.positive_int("world_size", world_size)
    if timeout is not None:
        _checks.seconds("timeout", timeout)
    _checks.seconds("stop_timeout", stop_timeout)
    _checks.boolean("return_exceptions", return_exceptions)
    _checks.positive_int("max_restarts", max_restarts, minimum=0)
    check_world_kwargs("launch()", world_kwargs)
    if torchrun if torchrun is not None else external_launcher() is not None:
        _refuse_restarts_in_place(max_restarts, chaos)
        check_rank_call(fn, args, kwargs)
        return LaunchResult([_run_here(fn, args, kwargs, names, stop_timeout, world_kwargs, world_size, timeout,
                                       return_exceptions)])
    names = rank_names(names, world_size)
    vital = _essential_ranks(essential, names)
    if chaos is not None:
        _checks.seconds("chaos", chaos)
        if max_restarts < 1 or len(vital) == world_size:
            raise ValueError(f"chaos={chaos!r} kills ranks that must come back: pass max_restarts >= 1 and "
                             f"leave at least one rank out of essential")
    if elastic := max_restarts > 0:
        world_kwargs = {k: v for k, v in world_kwargs.items() if k not in ("collective", "init_dist")}
    check_rank_call(fn, args, kwargs)  # (last: what the other checks say comes first)
    context = resolve_context(ctx, profile="train")  # ranks build optimizers: dynamo preloaded
    _mainguard.check_main_file("launch(...)", context.get_start_method())
    payload = dumps((fn, tuple(args), dict(kwargs or {})))
    # This process hosts the ranks' store and keeps pipes to each: its allowance of open
    # files first (``_descriptors`` says why); the ranks inherit it.
    _descriptors.raise_limit()
    budget = _descriptors.Budget("launch()", _descriptors.PER_RANK_LAUNCHER, base=_LAUNCHER_BASE,
                                 role="it hosts their store", unit="ranks")
    budget.refuse_beyond_hard(world_size, "world_size")
    budget.check(world_size)
    store = host_store("127.0.0.1", world_size, world_kwargs.get("dist_timeout", 60.0))
    log.info("machinlike.launch: the world's store is at tcp://127.0.0.1:%d; watch it with "
             "python -m machinlike status tcp://127.0.0.1:%d", store.port, store.port)
    threads = threads_per_rank(world_size)
    if threads is not None:
        log.info("machinlike.launch: each of the %d ranks runs torch with %d thread(s), this machine's cores "
                 "shared among them (OMP_NUM_THREADS sets another count)", world_size, threads)
    job = Job(context, names, store, payload, world_kwargs, stop_timeout, elastic, threads)
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
