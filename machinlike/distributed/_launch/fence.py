"""LossFence: a rank the world declared lost whose process lives on is killed by ``launch``.

    every TICK s of collect's wait   the world's store (hosted by launch, in this process)
      read the event log's new       m/evn, m/e/<seq> (static: the namespace of rank 0's
      positions                        World counter; elastic: mlk/0/e/)
      a "lost" entry whose record    remember (rank, pid, when seen)
        names a rank's current pid
      still alive GRACE s later?     SIGKILL: its exit sentinel then restarts it or ends
                                     the run, as any death does (``Job.collect``)

Why: a member is declared lost when its heartbeat stays silent for the loss bound: its
process was stopped (SIGSTOP, a debugger), is stuck in native code holding the GIL, or
starved. The world goes on without it, but ``launch`` waited for that process's report or
exit, which a stopped process never gives: the run hung, with no restart and with the
other ranks' results held (cold trial 28). The world has already cut the member off (its
calls fail from then on), so ending its process loses nothing; the grace lets a member
that merely stalled report its own exception first, the better account of what happened.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any, Collection, Dict, List, Optional, Tuple

import torch.distributed as dist

from .._membership import LogTail, pid_in
from .._store import Keys, LogEntry, value_or_empty
from .exits import RESTART_ROOT

__all__ = ["LossFence", "FENCED"]

log = logging.getLogger("machinlike.distributed._launch.local")  # (the launcher's lines keep their logger)

#: What a fenced rank's ProcessExitedError says after its exit status.
FENCED = ("the world declared it lost (its heartbeat went silent: the process was stopped, stuck or starved) "
          "while the process lived on, so launch killed it")


class LossFence:
    """Finds the ranks the world declared lost whose processes live on, and kills them.

    Args:
        store: The world's store, as ``launch`` hosts it.
        names: The member name of each rank.
        elastic: Whether the ranks form an elastic world (else a static one).
        grace: Seconds a rank declared lost may still report or exit by itself.
    """

    #: Seconds between reads of the event log (what collect's wait is cut to).
    TICK = 1.0

    def __init__(self, store: dist.Store, names: List[str], elastic: bool, grace: float = 3.0) -> None:
        self._store = store
        self._names = names
        self._elastic = elastic
        self._grace = grace
        self._tail: Optional[LogTail] = None  # the world's log, once there is a world
        self._read_at = -float("inf")  # when the log was last read (monotonic)
        self._doomed: Dict[int, Tuple[int, float]] = {}  # rank -> (pid declared lost, when seen)
        self.fenced: Dict[int, int] = {}  # pid -> rank, of the processes this killed

    def check(self, processes: List[Any], reported: Collection[int] = ()) -> None:
        """Read the log's new entries (at most once a ``TICK``); kill each rank whose
        process was declared lost ``grace`` seconds ago and still runs, unless it is in
        ``reported`` (its result is in: it is stopping). Best effort: a store error is
        logged at debug level and read again at the next tick."""
        now = time.monotonic()
        if now - self._read_at < self.TICK / 2:
            return
        self._read_at = now
        try:
            self._read(processes)
        except Exception as err:  # the store is going (the run ends) or slow: the next tick reads again
            log.debug("launch: could not read the world's losses: %s", err)
        for rank, (pid, seen) in list(self._doomed.items()):
            process = processes[rank]
            if process is None or process.pid != pid or not process.is_alive() or rank in reported:
                del self._doomed[rank]  # it ended, or was restarted, by itself
            elif now - seen >= self._grace:
                del self._doomed[rank]
                log.warning("launch: rank %d (%r), pid %d, was declared lost by the world %.1f s ago and its "
                            "process still runs (stopped, stuck or starved): killing it", rank, self._names[rank],
                            pid, now - seen)
                self.fenced[pid] = rank
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass  # (it ended meanwhile: its sentinel tells)

    def _read(self, processes: List[Any]) -> None:
        if self._tail is None:
            keys = Keys.elastic_world(RESTART_ROOT) if self._elastic else None
            if keys is None:  # static: the namespace of the World rank 0 built
                world = value_or_empty(self._store, Keys.static_counter(RESTART_ROOT, 0))
                if not world:
                    return
                keys = Keys.static_world(RESTART_ROOT, int(world))
            self._tail = LogTail(lambda key: value_or_empty(self._store, key), keys)
        for entry in self._tail.new():
            if entry.kind == "lost":
                self._note(entry, processes)

    def _note(self, entry: LogEntry, processes: List[Any]) -> None:
        rec = entry.record
        rank = rec.rank
        if not (0 <= rank < len(self._names)) or self._names[rank] != rec.member:
            return
        process = processes[rank]
        if process is not None and process.pid == pid_in(rec.identity) and process.is_alive():
            self._doomed.setdefault(rank, (process.pid, time.monotonic()))
