"""One process worker as the pool sees it: its channels, its tasks, its life.

::

    STARTING ──READY frame──> READY
       │                        │
       ├──────────┬─────────────┤
       │          │             │ a task called sys.exit (EXITING frame), or a frame
       │          │             │ out of order: it takes no more tasks
       │          │             v
       │          │          EXITING
       │          v             │
       └─────> RETIRING <───────┘  STOP queued (closed pool done, or maxtasksperchild)
                  │
     any ─────────┴──sentinel──> DEAD   (bury(): split its tasks into lost / requeued)

A handle owns its worker's channels (task pipe written through an :class:`OutBuffer`,
result pipe read by a :class:`FrameReader`), the tasks it holds in channel order, and its
:class:`~machinlike.pool._ledger.Ledger`. Only its own methods change its life.

Not thread-safe: the engine calls it with the engine lock held (or from the manager
thread alone, for the result reader).
"""

from __future__ import annotations

import enum
import os
from collections import deque
from typing import Any, Deque, List, Optional, Tuple

from ._cuda_shares import CudaCounter, read_counter, release_unheld
from ._ledger import RING, Ledger
from ._schedule import capacity, steal_count
from ._task import Function, Task
from ._wire import DROP, INSTALL, STOP, FrameReader, OutBuffer

__all__ = ["Life", "WorkerHandle"]

# CUDA references a worker holds are read again (those given back forgotten) from this many.
_PRUNE_FIRST = 64


class Life(enum.Enum):
    """Where a worker is in its life (see the module docstring)."""

    STARTING = "starting"
    READY = "ready"
    RETIRING = "retiring"
    EXITING = "exiting"
    DEAD = "dead"


class WorkerHandle:
    """The pool's side of one worker process.

    Args:
        slot: Worker slot (its context and start-up strikes belong to the slot).
        name: Name for errors, e.g. ``"pool worker 0"``.
        process: The started ``multiprocessing`` process.
        task_conn: Writing end of its task pipe (set non-blocking here).
        result_conn: Reading end of its result pipe (set non-blocking here).
        ledger: Its claim/take-back ledger.
    """

    __slots__ = (
        "slot", "name", "process", "pid", "sentinel", "task_conn", "result_conn", "task_fd", "result_fd",
        "reader", "out", "ledger", "inflight", "next_seq", "assigned", "life", "started_up", "successor_of",
        "want_write", "cuda_held", "_prune_at",
    )

    def __init__(self, slot: int, name: str, process: Any, task_conn: Any, result_conn: Any, ledger: Ledger) -> None:
        self.slot = slot
        self.name = name
        self.process = process
        self.pid: int = process.pid
        self.sentinel: int = process.sentinel
        self.task_conn, self.result_conn = task_conn, result_conn
        self.task_fd, self.result_fd = task_conn.fileno(), result_conn.fileno()
        self.reader = FrameReader(self.result_fd)
        self.out = OutBuffer()
        self.ledger = ledger
        self.inflight: Deque[Task] = deque()  # in channel order: the oldest is running or next
        self.next_seq = 0
        self.assigned = 0  # tasks given over its life (maxtasksperchild)
        self.life = Life.STARTING
        self.started_up = False  # it said READY (a fact, whatever its life is now)
        # A replacement started while its predecessor finishes its last tasks takes no
        # task before that one has exited: a pool never runs more than `processes`.
        self.successor_of: Optional["WorkerHandle"] = None
        self.want_write = False  # frames are buffered that the pipe did not take
        # CUDA references of what reached it, until it gives them back (see _cuda_shares)
        self.cuda_held: List[CudaCounter] = []
        self._prune_at = _PRUNE_FIRST
        os.set_blocking(self.task_fd, False)
        os.set_blocking(self.result_fd, False)

    # ------------------------------------------------------------------ life

    def takes_tasks(self) -> bool:
        return (self.life is Life.STARTING or self.life is Life.READY) and self.successor_of is None

    def is_ready(self) -> bool:
        return self.life is Life.READY

    def is_dead(self) -> bool:
        return self.life is Life.DEAD

    def follow(self, predecessor: "WorkerHandle") -> None:
        """Take no task before ``predecessor`` (retiring, still busy) has ended."""
        if not predecessor.is_dead():
            self.successor_of = predecessor

    def predecessor_ended(self, predecessor: "WorkerHandle") -> None:
        if self.successor_of is predecessor:
            self.successor_of = None

    def abandon(self) -> None:
        """The pool ends it without accounting for its tasks (terminate, break)."""
        self.life = Life.DEAD

    def mark_ready(self) -> None:
        """Its READY frame arrived."""
        self.started_up = True
        if self.life is Life.STARTING:
            self.life = Life.READY

    def mark_exiting(self) -> None:
        """It is ending on its own (sys.exit in a task, or it must be killed): no more tasks."""
        if self.life is Life.STARTING or self.life is Life.READY:
            self.life = Life.EXITING

    def retire(self) -> bool:
        """Queue STOP after what it holds (not flushed); False if it was retiring or dead."""
        if self.life is Life.RETIRING or self.life is Life.DEAD:
            return False
        self.life = Life.RETIRING
        self.out.push(STOP, 0, 0, 0)
        return True

    def kill(self) -> None:
        """SIGKILL it now (its sentinel then reports the death)."""
        self.mark_exiting()
        try:
            self.process.kill()
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------------ tasks

    def capacity(self, window: int, maxtasks: Optional[int]) -> int:
        """How many more tasks it may take now (see ``_schedule.capacity``)."""
        return capacity(len(self.inflight), window, self.next_seq - self.ledger.started(), RING,
                        self.assigned, maxtasks)

    def assign(self, task: Task) -> None:
        """Queue ``task`` in its channel (not flushed), installing its function first."""
        function = task.function
        extra = 0
        if function is not None:
            extra = function.id
            if self not in function.holders:
                data, counters = function.install_payload(self)
                function.holders.add(self)
                self.cuda_held.extend(counters)
                self.out.push(INSTALL, 0, 0, extra, data)
        task.seq = self.next_seq
        self.next_seq += 1
        self.inflight.append(task)
        self.assigned += 1
        self.out.push(task.kind, task.star, task.seq, extra, task.payload)

    def hold_cuda(self, task: Task) -> None:
        """``task`` reached it (its outcome is in): its CUDA references are the worker's to
        give back, until it ends. Those it gave back already are forgotten, now and then."""
        if not task.cuda:
            return
        held = self.cuda_held
        held.extend(task.cuda)
        task.cuda = ()
        if len(held) >= self._prune_at:
            held[:] = [c for c in held if read_counter(c)]
            self._prune_at = max(_PRUNE_FIRST, 2 * len(held))

    def release_cuda(self) -> None:
        """(it has ended) Give back the CUDA references it was handed and did not."""
        held, self.cuda_held = self.cuda_held, []
        if held:
            release_unheld(held)

    def drop(self, function: Function) -> None:
        """Queue the frame that uninstalls ``function`` (not flushed)."""
        self.out.push(DROP, 0, 0, function.id)

    def settle(self, seq: int) -> Optional[Task]:
        """The task a result frame numbered ``seq`` answers (its oldest); None if out of order."""
        inflight = self.inflight
        if not inflight or inflight[0].seq != seq:
            return None
        return inflight.popleft()

    def flush(self) -> None:
        """Write what the task pipe takes now; the rest waits for it to drain."""
        if self.life is Life.DEAD:
            return
        try:
            done = self.out.flush(self.task_fd)
        except OSError:  # the worker is gone; its sentinel will tell
            self.out.clear()
            done = True
        self.want_write = not done

    def unstarted(self) -> int:
        """How many of its tasks a thief may take now (see :meth:`_stealable`)."""
        return len(self._stealable(self.ledger.started()))

    def _stealable(self, started: int) -> List[Task]:
        """Its unstarted tasks a thief may take: all of them behind a running task; with
        none running, all but the oldest, which a ready worker is reading in now. Taking
        that one would only send it twice, and while a large frame was still being
        written two idle workers passed it back and forth for good."""
        unstarted = [t for t in self.inflight if t.seq > started]
        if unstarted and unstarted[0] is self.inflight[0] and self.is_ready():
            del unstarted[0]
        return unstarted

    def take_back_unstarted(self, wait: float) -> List[Task]:
        """Take back the newest half of its unstarted tasks, atomically with its claims.

        Args:
            wait: Seconds to wait for its ledger's lock (longer: it died holding it).

        Returns:
            The tasks taken back, oldest first (none if the lock was not had in time).
        """
        taken: List[Task] = []

        def choose(started: int) -> List[int]:
            unstarted = self._stealable(started)
            taken.extend(unstarted[len(unstarted) - steal_count(len(unstarted)):])
            return [t.seq for t in taken]

        if self.ledger.take_back(choose, wait) is None or not taken:
            return []
        for _ in taken:
            self.inflight.pop()  # unstarted tasks are the newest: at the right end
        self.assigned -= len(taken)
        return taken

    # ------------------------------------------------------------------ end

    def bury(self, reap: bool) -> Tuple[List[Task], List[Task]]:
        """Account for its death (its result pipe drained first).

        Args:
            reap: Close the process object (reaped: frees its descriptors); False while
                ``terminate()`` owns the process.

        Returns:
            (tasks it had started, which are lost; tasks it had not, to run elsewhere).
        """
        self.life = Life.DEAD
        if reap:
            self.process.close()
        self.close_channels()
        started = self.ledger.started()
        lost = [t for t in self.inflight if t.seq <= started]
        requeue = [t for t in self.inflight if t.seq > started]
        self.inflight.clear()
        return lost, requeue

    def phase(self) -> int:
        return self.ledger.phase()

    def close_channels(self) -> None:
        self.task_conn.close()
        self.result_conn.close()
        self.ledger.release()  # (no take-back once its channels are closed)
