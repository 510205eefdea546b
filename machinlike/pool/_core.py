"""The process pool engine's façade: private channels, one manager thread, a stealing scheduler.

Data flow::

    caller threads (apply_async, map_async, the imap feeder)
      │ encode with the Codec (dill + tensor policy), in the caller's thread
      ▼
    backlog ── FIFO, under the pool lock ──pump──> least-loaded worker with room
                                                    │ (frames batched, non-blocking writev)
                     ┌──────────────────────────────┘
                     ▼
    worker i's task pipe: [INSTALL f] TASK TASK ... [DROP f] [STOP] ──> worker i
    worker i's result pipe <── READY, then one frame per task, in channel order ──┘

    manager thread "machinlike-pool-N-manager":
      poll([wake-up pipe, result pipes, worker sentinels, full task pipes])
        result frames ─> match worker i's oldest task ─> decode, settle, callbacks
        sentinel      ─> bury worker i: drain its pipe; tasks it had started fail with
                         WorkerLostError (exit code / signal, phase); tasks it had not
                         started go back to the front of the backlog; the supervisor
                         starts a replacement in its slot (same context)
        then: pump the backlog, steal for idle workers, stop workers once closed & done

Why per-worker channels: the pool always knows which tasks a worker holds. With one
shared task queue a dead worker takes an unknown task with it (the standard pool then
hangs; loky marks the whole executor broken), and a worker killed while holding the
queue's lock blocks every other one.

Scheduling: a single call goes only to a worker's channel holding fewer than ``window``
unfinished tasks, a map's chunk to one holding fewer than ``map_window``; the rest wait
in the backlog and go, oldest first, to the least-loaded worker with room. When the
backlog is empty and a worker is idle, it takes back the newest unstarted half of the
tasks of the worker with the most (see ``_ledger``: claims and take-backs are atomic under
that worker's lock), so no worker idles while another has a backlog.

Post-crash state: the pool keeps serving. A dead worker fails only the task it had
started and is replaced. The pool is *broken* (every pending and future task fails with
BrokenPoolError) only when no worker can run: the initializer raised, a slot's worker
died three times in a row before becoming ready, or a worker could not be started.

Shutdown: ``close()`` stops each worker with a STOP frame once all work is done;
``terminate()`` fails everything pending (PoolTerminatedError) and ends the workers:
SIGTERM, a grace period, then SIGKILL. Garbage collection and interpreter exit terminate.

Who owns what (each part in its own module, handed its collaborators)::

    ProcessCore (this façade: the public side, called from any thread)
      ├─ PoolFlags    _state       the engine lock, RUN/CLOSE/TERMINATE/BROKEN, open feeds
      ├─ Wakeup       _wakeup      the self-pipe and its sleeping/woken handshake
      ├─ Supervisor   _supervisor  starting workers, start-up strikes, replacements
      ├─ Dispatcher   _dispatch    backlog + live workers; pump/steal (policy: _schedule)
      │    └─ WorkerHandle _handle  one worker: channels, tasks, Life, Ledger (_ledger)
      ├─ Watch        _watch       the poll set: fd -> role
      └─ Manager      _manager     the thread: frames, deaths, outcomes, breaking
"""

from __future__ import annotations

import itertools
import threading
from multiprocessing.context import BaseContext
from typing import Any, Callable, Iterable, List, Optional, Sequence, Tuple

from .._procs import end_processes
from ._dispatch import Dispatcher
from ._errors import PoolTerminatedError
from ._handle import WorkerHandle
from ._manager import TERM_GRACE, Manager
from ._policy import Codec
from ._result import Job
from ._state import PoolFlags, PoolState
from ._supervisor import Supervisor
from ._cuda_shares import pickled_counters
from ._task import Function, Task, fail_tasks, fail_unsent, release_cuda
from ._wakeup import Wakeup
from ._watch import Watch
from ._wire import TASK_CALL, TASK_MAP

__all__ = ["ProcessCore"]

_JOIN_WAIT = 10.0  # seconds terminate() waits for the manager thread to finish
_counter = itertools.count(1)


class ProcessCore:
    """The engine behind the process pools (see the module docstring).

    Args:
        processes: Number of workers.
        initializer: Called in each worker before its first task.
        initargs: Arguments for ``initializer``.
        contexts: One context object per worker slot (None entries without contexts).
        has_context: Whether functions receive their worker's context first.
        maxtasks: Tasks (chunks) a worker runs before it is replaced; None: no limit.
        daemon: Daemon flag of the worker processes.
        codec: The tensor policy.
        ctx: Multiprocessing context that starts the workers.
        window: Unfinished tasks a worker's channel may hold.
        map_window: The same for a map's chunks; None: ``window`` (``Dispatcher`` says why).
        label: Pool kind for names, e.g. ``"pool"``.

    Raises:
        pickle.PicklingError, TypeError: the initializer, its arguments or a context
            cannot be pickled.
        OSError: a worker could not be started.
    """

    def __init__(
        self, *, processes: int, initializer: Optional[Callable[..., Any]], initargs: tuple,
        contexts: Sequence[Any], has_context: bool, maxtasks: Optional[int], daemon: bool,
        codec: Codec, ctx: BaseContext, window: int, label: str,
        map_window: Optional[int] = None,
    ) -> None:
        self.processes = processes
        self.name = f"machinlike-{label}{next(_counter)}"
        self._codec = codec
        self._function_ids = itertools.count(1)
        # The parts, each owning its state; the flags' lock guards all the engine's.
        self._flags = PoolFlags()
        self._wakeup = Wakeup()
        self._supervisor = Supervisor(
            name=self.name, processes=processes, initializer=initializer, initargs=initargs, contexts=contexts,
            has_context=has_context, daemon=daemon, codec=codec, ctx=ctx,
        )
        self._dispatch = Dispatcher(window, maxtasks, codec, self._supervisor, map_window)
        self._watch = Watch(self._wakeup.fd)
        self._manager = Manager(self.name, self._flags, self._dispatch, self._supervisor, self._watch,
                                self._wakeup, codec)
        try:
            for slot in range(processes):
                self._manager.adopt(self._supervisor.launch(slot))
        except BaseException:
            started = self._dispatch.release_workers()
            end_processes([w.process for w in started], 0.0, close=True)
            for w in started:
                w.close_channels()
            self._wakeup.close()
            raise
        self._manager.start()

    # ================================================================== what callers see

    @property
    def state(self) -> PoolState:
        return self._flags.state

    @property
    def replaced(self) -> int:
        """Workers started to replace dead or retired ones."""
        return self._supervisor.replaced

    @property
    def _workers(self) -> List[WorkerHandle]:
        """The live workers (tests read their pids and processes)."""
        return self._dispatch.workers

    def ahead(self) -> int:
        """How many chunks an imap may keep in flight beyond what was consumed."""
        return self.processes * (self._dispatch.map_window + 1)

    def check_running(self) -> None:
        """Raise unless new work is accepted.

        Raises:
            BrokenPoolError: the pool is broken.
            ValueError: the pool was closed or terminated.
        """
        self._flags.check_running()

    def delivers_in_this_thread(self) -> bool:
        return self._manager.is_current()

    def function(self, func: Callable[..., Any]) -> Function:
        """Pickle a map's function once.

        Raises:
            pickle.PicklingError, TypeError: it cannot be pickled.
        """
        codec = self._codec
        data, kept = codec.dumps_tracked(func, multi_load=True)
        kept, counters = pickled_counters(kept)
        if not counters:
            return Function(next(self._function_ids), data, kept)
        # CUDA tensors: one pickle per worker it is installed on (see _cuda_shares); this
        # one for the first
        return Function(next(self._function_ids), data, kept, lambda: codec.dumps_tracked(func, multi_load=True),
                        counters)

    def call(self, job: Job, func: Callable[..., Any], args: tuple, kwds: Optional[dict]) -> None:
        """Queue ``func(*args, **kwds)``; an encoding error fails ``job`` at once."""
        try:
            payload, kept = self._codec.dumps_tracked((func, args, kwds))
        except Exception as exc:
            job._failed(0, 1, exc)
            return
        kept, counters = pickled_counters(kept)
        self._enqueue([Task(job, 0, 1, TASK_CALL, 0, None, payload, bool(kept), counters)], None, False)

    def map(self, job: Optional[Job], function: Function, star: bool, chunks: Iterable[Tuple[int, list]], final: bool) -> None:
        """Queue chunks ``(start, items)`` of ``job``; ``final``: no more will come."""
        tasks: List[Task] = []
        if job is None:  # an imap's last call: no chunks, only "final"
            self._enqueue(tasks, function, final)
            return
        encode = self._codec.dumps_tracked
        flag = 1 if star else 0
        for start, items in chunks:
            try:
                payload, kept = encode(items)
            except Exception as exc:
                job._failed(start, len(items), exc)
                continue
            kept, counters = pickled_counters(kept)
            tasks.append(Task(job, start, len(items), TASK_MAP, flag, function, payload, bool(kept), counters))
        self._enqueue(tasks, function, final)

    def feed_opened(self) -> None:
        with self._flags.lock:
            self._flags.feeds_open += 1

    def feed_closed(self) -> None:
        flags = self._flags
        with flags.lock:
            flags.feeds_open -= 1
            wake = flags.state is PoolState.CLOSE and self._wake_needed()
        if wake:
            self._wakeup.wake()

    def close(self) -> None:
        with self._flags.lock:
            self._flags.close()
            wake = self._wake_needed()
        if wake:
            self._wakeup.wake()

    def terminate(self) -> None:
        """Fail what is pending, end the workers (SIGTERM, grace, SIGKILL), stop the
        manager. Idempotent; safe from a callback and from a finalizer."""
        with self._flags.lock:
            first = self._flags.terminate()  # a broken pool has ended its workers already
            tasks = self._dispatch.take_all()
            workers = self._dispatch.release_workers()  # terminate() owns their processes now
            wake = self._wake_needed(force=True)
        if wake:
            self._wakeup.wake()
        if first:
            fail_tasks(tasks, PoolTerminatedError("the pool was terminated before this task finished"), self._codec,
                       cuda=False)
            end_processes([w.process for w in workers], TERM_GRACE, close=True)
            release_cuda(tasks)  # (every worker has ended: what none of them gave back)
            for w in workers:
                w.release_cuda()
        thread = self._manager.thread
        if thread is not None and thread.ident != threading.get_ident():
            thread.join(_JOIN_WAIT)
        if thread is None or not thread.is_alive():
            for w in workers:
                w.close_channels()

    def join(self, timeout: Optional[float]) -> None:
        """Wait for the manager thread (hence every worker) to finish.

        Raises:
            ValueError: the pool is still running.
            RuntimeError: called from one of the pool's callbacks.
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if self._flags.state is PoolState.RUN:
            raise ValueError("Pool is still running: call close() or terminate() before join()")
        if self.delivers_in_this_thread():
            raise RuntimeError("cannot join a pool from one of its own callbacks")
        thread = self._manager.thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                with self._flags.lock:
                    busy = [w.name for w in self._dispatch.workers if w.inflight]
                    queued = len(self._dispatch.backlog)
                raise TimeoutError(
                    f"the pool did not finish within {timeout:g} s: {queued} task(s) queued, "
                    f"worker(s) still busy: {busy or 'none'}"
                )

    # ================================================================== internals

    def _enqueue(self, tasks: List[Task], function: Optional[Function], final: bool) -> None:
        flags = self._flags
        with flags.lock:
            if flags.ended():
                refused: Optional[BaseException] = flags.broken() if flags.state is PoolState.BROKEN else \
                    PoolTerminatedError("the pool was terminated before this task was queued")
            else:
                refused = None
                self._dispatch.submit(tasks, function, final)
            wake = self._wake_needed()
            unsent = self._dispatch.take_unsent()
        if wake:
            self._wakeup.wake()
        if refused is not None:
            fail_tasks(tasks, refused, self._codec)
        if unsent:
            fail_unsent(unsent, self._codec)

    def _wake_needed(self, force: bool = False) -> bool:
        """Whether this caller must wake the sleeping manager (engine lock held)."""
        if not self._wakeup.sleeping():
            return False
        if force or self._flags.state is not PoolState.RUN or self._supervisor.pending() \
                or self._watch.stale(self._dispatch.workers):
            return self._wakeup.claim()
        return False
