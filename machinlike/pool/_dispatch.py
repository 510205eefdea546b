"""The process engine's work: the backlog, the live workers, and moving tasks between them.

::

    submit ──> backlog (FIFO) ──pump──> worker with room (``_schedule.pick``)
                  ^                         │ frames batched, non-blocking writev
                  │ take back the newest    v
                  └── unstarted half ── busiest worker   (steal, when the backlog is empty)

    a task settles ──> its map function's count drops ──> DROP frames once final and 0
    closed and nothing left ──> STOP to every worker

The dispatcher runs in whichever thread holds the engine lock: a caller's (submitting
writes the first frames at once, with no hop through the manager thread) or the
manager's (after results, deaths and drained pipes). It owns ``backlog`` and ``workers``;
the policy is ``_schedule``'s, the worker's own bookkeeping its handle's.

Not thread-safe: every method is called with the engine lock (``PoolFlags.lock``) held.
"""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Deque, List, Optional, Tuple

from ._handle import WorkerHandle
from ._policy import Codec
from ._schedule import pick, pick_victim
from ._state import PoolFlags, PoolState
from ._task import Function, Task, discard

if TYPE_CHECKING:
    from ._supervisor import Supervisor

__all__ = ["Dispatcher"]

_STEAL_LOCK_WAIT = 0.1  # a worker holds its ledger lock for microseconds; longer means it died


class Dispatcher:
    """Backlog, live workers and the scheduling actions (see the module docstring).

    Args:
        window: Unfinished tasks a worker's channel may hold.
        map_window: The same for a map's chunks (at least ``window``); None: ``window``.
            Why apart: one task at a time per worker (plus the next) keeps single calls
            starting in submission order, but bounds a map of small chunks by the round
            trip to the parent (``Pool.imap`` at chunksize 64 ran at 0.42 of stdlib's
            spawn Pool at a window of 2, 0.96 at 32).
        maxtasks: Tasks a worker runs before it is retired; None: no limit.
        codec: Releases what dropped payloads hold in shared memory.
        supervisor: Told to start a successor when a worker is retired by ``maxtasks``.
    """

    def __init__(self, window: int, maxtasks: Optional[int], codec: Codec, supervisor: "Supervisor",
                 map_window: Optional[int] = None) -> None:
        self.window = window
        self.map_window = max(window, map_window or window)
        self._maxtasks = maxtasks
        self._codec = codec
        self._supervisor = supervisor
        self.backlog: Deque[Task] = deque()
        self.workers: List[WorkerHandle] = []  # live ones, in start order
        self._rotation = 0  # where the next pick starts scanning: equal loads take turns
        self.unsent: List[Tuple[Task, BaseException]] = []  # see take_unsent

    # ------------------------------------------------------------------ workers

    def add(self, w: WorkerHandle) -> None:
        self.workers.append(w)

    def remove(self, w: WorkerHandle) -> None:
        """Forget a dead worker; a successor waiting for it may now take tasks."""
        if w in self.workers:
            self.workers.remove(w)
        for other in self.workers:
            other.predecessor_ended(w)

    def release_workers(self) -> List[WorkerHandle]:
        """Hand every live worker to the caller, which ends them (terminate, break)."""
        workers, self.workers = self.workers, []
        for w in workers:
            w.abandon()
        return workers

    # ------------------------------------------------------------------ work

    def busy(self) -> bool:
        """Whether a worker holds a task."""
        return any(w.inflight for w in self.workers)

    def holds_work(self, flags: PoolFlags) -> bool:
        """Whether anything is queued, held by a worker, or still to be fed."""
        return bool(self.backlog) or bool(flags.feeds_open) or self.busy()

    def submit(self, tasks: List[Task], function: Optional[Function], final: bool) -> None:
        if function is not None:
            function.outstanding += len(tasks)
            if final:
                function.final = True
        self.backlog.extend(tasks)
        self.pump()
        if function is not None:
            self.maybe_drop(function)

    def take_unsent(self) -> List[Tuple[Task, BaseException]]:
        """Tasks whose sending failed since the last call, with why (deliver them with
        ``_task.fail_unsent`` once the lock is let go)."""
        unsent, self.unsent = self.unsent, []
        return unsent

    def requeue(self, tasks: List[Task]) -> None:
        """Put tasks no worker started back at the front, in their order."""
        self.backlog.extendleft(reversed(tasks))

    def take_all(self) -> List[Task]:
        """Remove and return every task, queued or held (terminate, break)."""
        tasks = list(self.backlog)
        self.backlog.clear()
        for w in self.workers:
            tasks.extend(w.inflight)
            w.inflight.clear()
        return tasks

    def settled(self, task: Task) -> None:
        """A task's outcome is in (or it was given up): count it off its function."""
        function = task.function
        if function is not None:
            function.outstanding -= 1
            self.maybe_drop(function)

    def maybe_drop(self, function: Function) -> None:
        if not function.droppable():
            return
        for w in function.holders:
            if not w.is_dead():
                w.drop(function)
                w.flush()
        function.release_unloaded(self._codec)
        function.holders.clear()
        function.kept = []

    # ------------------------------------------------------------------ scheduling

    def pump(self) -> None:
        """Send backlog tasks, oldest first, to the least-loaded workers with room."""
        backlog = self.backlog
        if not backlog:
            return
        window, widest, maxtasks = self.window, self.map_window, self._maxtasks
        candidates = [w for w in self.workers if w.takes_tasks()]
        loads = [len(w.inflight) for w in candidates]
        if not candidates or min(loads) >= (window if backlog[0].function is None else widest):
            return  # every channel is full for the oldest task: the common case while a backlog waits
        # only a worker below its window can have room: skip the ledger read for the others
        capacities = [w.capacity(widest, maxtasks) if load < widest else 0 for w, load in zip(candidates, loads)]
        touched = set()
        while backlog:
            if backlog[0].function is None and widest > window:  # a single call: the narrow window
                i = pick(loads, [min(c, window - n) for c, n in zip(capacities, loads)], self._rotation)
            else:
                i = pick(loads, capacities, self._rotation)
            if i is None:
                break  # (a call waits for room, and what was submitted after it waits too)
            task = backlog.popleft()
            if task.job._is_done():  # a map that already failed, an abandoned imap
                self.settled(task)
                discard([task], self._codec)
                continue
            w = candidates[i]
            try:
                self._assign(w, task)
            except Exception as exc:
                # A map's function holding CUDA tensors is pickled again per worker, and
                # that failed (it did not the first time): nothing was sent. Its task fails
                # with the error, outside the lock (take_unsent), and nothing else does.
                self.settled(task)
                self.unsent.append((task, exc))
                continue
            loads[i] += 1
            capacities[i] -= 1
            self._rotation = (i + 1) % len(candidates)
            touched.add(w)
        for w in touched:
            w.flush()

    def _assign(self, w: WorkerHandle, task: Task) -> None:
        w.assign(task)
        if self._maxtasks and w.assigned >= self._maxtasks and w.retire():
            # retire after this task; its replacement starts now, so capacity stays
            self._supervisor.replace_later(w.slot, w)

    def steal(self) -> None:
        """Give idle workers the newest unstarted tasks of the busiest ones."""
        if self.backlog:
            return
        # Only a worker that is ready can run a task sooner than its current holder; a
        # starting one stealing from another starting one would just shuffle the task.
        idle = [w for w in self.workers if w.is_ready() and not w.inflight and w.takes_tasks()]
        for thief in idle:
            workers = self.workers
            unstarted = [0 if w.is_dead() else w.unstarted() for w in workers]
            i = pick_victim(unstarted, workers.index(thief))
            if i is None:
                return
            taken = workers[i].take_back_unstarted(_STEAL_LOCK_WAIT)
            if not taken:
                continue  # it held its lock too long (it is dying), or started them meanwhile
            self.requeue(taken)
            self.pump()

    def stop_when_done(self, flags: PoolFlags) -> None:
        """Once closed and every task is done, queue STOP for every worker."""
        if flags.state is not PoolState.CLOSE or self.backlog or flags.feeds_open or self.busy():
            return
        for w in self.workers:
            if w.retire():
                w.flush()
