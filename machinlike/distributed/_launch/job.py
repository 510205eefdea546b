"""The ranks of one :func:`launch` from the parent's side: their processes, result pipes,
restarts and chaos.

    start(r) ──► a process running rank_main(r), a pipe back
    collect: wait on every pipe and exit sentinel (no sleeps; the wait ends each second
             for the fence)
      report ok             ─► results[r]
      failure, restarts left ─► logged, recorded (exits), started again in place as r
      failure otherwise     ─► raised (or kept, with return_exceptions)
      every chaos seconds   ─► SIGKILL one non-essential rank that has run a whole period
      every second          ─► LossFence: a rank the world declared lost that still runs,
                               SIGKILLed after a grace (fence); its exit then goes as above
    timeout ─► each rank's stacks (stacks), TimeoutError

Why apart from ``local``: ``launch`` checks and prepares, this owns the processes' state.
"""

from __future__ import annotations

import logging
import os
import random
import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any, Dict, Iterable, List, Optional, Sequence, Set

import torch.distributed as dist

from ... import _mainguard
from ...exception import NoCollectivesError, ProcessExitedError, RemoteTraceback
from ...pickle import loads
from .exits import RankExits, exited
from .fence import FENCED, LossFence
from .rank_main import rank_main
from .stacks import StackFiles, timed_out
from .termination import deferred

__all__ = ["Job", "LaunchResult", "Restart"]

log = logging.getLogger("machinlike.distributed._launch.local")  # (the launcher's lines keep their logger)


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

def _chaos_victims(processes: List[Any], started: List[float], vital: Set[int], results: Dict[int, Any],
                   used: List[int], max_restarts: int, chaos: float) -> List[int]:
    # Only ranks that have run for a whole period: a rank killed while it is still
    # starting would use up its restarts without ever having worked.
    now = time.monotonic()
    return [r for r, p in enumerate(processes)
            if r not in vital and r not in results and used[r] < max_restarts and p is not None and p.is_alive()
            and now - started[r] >= chaos]


def _nth(n: int) -> str:
    return "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")


def _read(conn: Connection) -> Optional[tuple]:
    try:
        return loads(conn.recv_bytes())
    except EOFError:
        return None


class Job:
    """The ranks' processes and result pipes; starts (and restarts) rank ``r`` in place."""

    def __init__(self, context: Any, names: List[str], store: dist.TCPStore, payload: bytes,
                 world_kwargs: Dict[str, Any], stop_timeout: float, elastic: bool,
                 threads: Optional[int] = None) -> None:
        self.context = context
        self.names = names
        self.port = store.port
        self.payload = payload
        self.world_kwargs = world_kwargs
        self.stop_timeout = stop_timeout
        self.elastic = elastic
        self.threads = threads  # torch threads per rank; None: as inherited
        self.processes: List[Any] = [None] * len(names)
        self.readers: List[Connection] = []
        self.reader_of: List[Any] = [None] * len(names)
        self.started: List[float] = [0.0] * len(names)
        self.stacks = StackFiles()  # where a rank writes its stacks when the run times out
        self.exits = RankExits(store, names, elastic)  # how each failed rank ended, into the world's store
        self.fence = LossFence(store, names, elastic)  # kills a rank declared lost that lives on

    def start(self, rank: int) -> None:
        reader, writer = self.context.Pipe(duplex=False)
        # Not daemonic, so that a rank may start pools and processes of its own; it
        # still cannot outlive this call (killed in launch's finally) or its parent
        # (watch_parent in _rank_main).
        process = self.context.Process(
            target=rank_main, name=f"rank {rank} ({self.names[rank]!r})", daemon=False,
            args=(rank, len(self.names), self.names[rank], self.port, self.payload, self.world_kwargs, writer,
                  self.stop_timeout, self.elastic, self.stacks.path(rank), self.threads))
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
        ended = False  # every essential rank has reported

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
            # (cut to the fence's tick: a rank declared lost while its process lives on
            # never reports nor exits by itself)
            left = LossFence.TICK if left is None else min(left, LossFence.TICK)
            ready = wait(list(waiting), timeout=left)
            self.fence.check(self.processes, results.keys())
            if next_kill is not None and time.monotonic() >= next_kill:
                assert chaos is not None  # an invariant: next_kill is set only with chaos
                next_kill = time.monotonic() + chaos
                self._chaos_kill(rng, vital, results, used, max_restarts, chaos)
                continue
            if not ready and deadline is not None and time.monotonic() >= deadline:
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
                        report = (False, self._exited(rank))
                if report is None:
                    continue  # the pipe closed first; the exit sentinel decides
                ok, value = report
                if not ok:
                    self.exits.record(rank, self.processes[rank].pid, value)
                # (a rank stopped by the main-module guard, or refused a collective group by
                # its elastic World, would fail alike when restarted)
                stopped = isinstance(value, NoCollectivesError) or (
                    isinstance(value, ProcessExitedError) and value.exitcode == _mainguard.EXIT_CODE)
                restartable = not ok and rank not in vital and used[rank] < max_restarts and not stopped
                if restartable and ended:
                    # Its restart would join a world whose essential ranks are gone (and wait
                    # for them): the failure is kept as its result instead of ending the run.
                    log.warning("launch: rank %d (%r) failed after every essential rank finished; not restarted: "
                                "%s: %s", rank, self.names[rank], type(value).__name__, value)
                    restartable, ok = False, True
                if restartable:
                    used[rank] += 1
                    cause = f"{type(value).__name__}: {value}"
                    # With the rank's own traceback: the run may go on, and then nothing else
                    # would show where it failed (cold trial 11).
                    where = value.__cause__
                    log.warning("launch: restarting rank %d (%r), restart %d of %d, after %s%s", rank,
                                self.names[rank], used[rank], max_restarts, cause,
                                f"\n{where.tb_text.rstrip()}" if isinstance(where, RemoteTraceback) else "")
                    restarts.append(Restart(rank, self.names[rank], cause, used[rank] + 1))
                    for stale in (self.reader_of[rank], self.processes[rank].sentinel):
                        waiting.pop(stale, None)
                    old = self.processes[rank]
                    if old.is_alive():
                        old.kill()
                    old.join(5.0)
                    self._let_go(rank)
                    self.start(rank)
                    watch(rank)
                    continue
                if not ok and not return_exceptions:
                    if max_restarts and not restartable and not stopped and rank not in vital:
                        # (the restarts' history would be lost with the run: say it here; cold trial 28)
                        value.add_note(f"launch: rank {rank} ({self.names[rank]!r}) failed for the {used[rank] + 1}"
                                       f"{_nth(used[rank] + 1)} time: its max_restarts={max_restarts} restarts were "
                                       f"used up ({len(restarts)} restarts in this run)")
                    raise value
                results[rank] = value
                # A rank that reported is done: its exit is expected, not a failure.
                waiting.pop(self.processes[rank].sentinel, None)
                if vital and not ended and vital <= results.keys():
                    ended, next_kill = True, None  # the run's point is over: no more chaos, no restarts
                    if chaos is not None or max_restarts:
                        log.info("launch: every essential rank finished: no more chaos kills or restarts")
        return LaunchResult((results[rank] for rank in range(len(self.names))), restarts)

    def _let_go(self, rank: int) -> None:
        """Close the descriptors of rank ``rank``'s ended process (its result pipe, its
        sentinel) before its restart: they were kept, one pipe per restart, and a crash
        loop or chaos filled the launcher's table (cold trial 28)."""
        reader = self.reader_of[rank]
        self.readers.remove(reader)
        reader.close()
        try:
            self.processes[rank].close()
        except ValueError:  # (still running after its kill and 5 s: its sentinel stays open)
            pass

    def _exited(self, rank: int) -> ProcessExitedError:
        """The error of rank ``rank``'s process, which ended without a report."""
        error = exited(self.processes[rank])
        if self.fence.fenced.pop(error.pid or 0, None) is not None:
            error = ProcessExitedError(error.name, error.pid, error.exitcode, FENCED)
        elif self.exits.by_chaos(error.pid):  # (a Restart's cause tells an injected kill from a real one)
            error = ProcessExitedError(error.name, error.pid, error.exitcode, "launch(chaos=...) killed it")
        return error

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
