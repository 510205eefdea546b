"""The process pool engine: private channels, one manager thread, a stealing scheduler.

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
                         started go back to the front of the backlog; a replacement
                         starts in its slot (same context)
        then: pump the backlog, steal for idle workers, stop workers once closed & done

Why per-worker channels: the pool always knows which tasks a worker holds. With one
shared task queue a dead worker takes an unknown task with it (the standard pool then
hangs; loky marks the whole executor broken), and a worker killed while holding the
queue's lock blocks every other one.

Scheduling: a worker's channel holds at most ``window`` unfinished tasks; the rest wait
in the backlog and go, oldest first, to the least-loaded worker with room. When the
backlog is empty and a worker is idle, it takes back the newest unstarted half of the
tasks of the worker with the most (see ``_worker``: claims and take-backs are atomic under
that worker's lock), so no worker idles while another has a backlog.

Post-crash state: the pool keeps serving. A dead worker fails only the task it had
started and is replaced. The pool is *broken* (every pending and future task fails with
BrokenPoolError) only when no worker can run: the initializer raised, a slot's worker
died three times in a row before becoming ready, or a worker could not be started.

Shutdown: ``close()`` stops each worker with a STOP frame once all work is done;
``terminate()`` fails everything pending (PoolTerminatedError) and ends the workers:
SIGTERM, a grace period, then SIGKILL. Garbage collection and interpreter exit terminate.
"""

from __future__ import annotations

import itertools
import os
import select
import threading
import time
from collections import deque
from multiprocessing import connection as _mp_connection
from multiprocessing.context import BaseContext
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Sequence, Set, Tuple

from .. import _reductions
from ..exception import RemoteTraceback, WorkerLostError
from ..pickle import dumps as _plain_dumps
from ._errors import BrokenPoolError, PoolTerminatedError
from ._policy import Codec
from ._wire import (
    DONE,
    DROP,
    EXITING,
    FAILED,
    INIT_FAILED,
    INSTALL,
    PARTIAL,
    READY,
    STOP,
    TASK_CALL,
    TASK_MAP,
    FrameReader,
    OutBuffer,
)
from . import _worker

__all__ = ["ProcessCore", "RUN", "CLOSE", "TERMINATE", "BROKEN"]

RUN, CLOSE, TERMINATE, BROKEN = "running", "closed", "terminated", "broken"

_LOST = -1  # settlement kind for tasks of a dead worker (payload: the error)
_STARTUP_RETRIES = 3
_TERM_GRACE = 1.0  # seconds between SIGTERM and SIGKILL
_KILL_WAIT = 10.0  # seconds to wait for SIGKILLed processes to be reaped
_STEAL_LOCK_WAIT = 0.1  # a worker holds its lock for microseconds; longer means it died

_WAKE, _RESULT, _SENTINEL, _TASK = range(4)
_counter = itertools.count(1)


class _Function:
    """A map's function, pickled once, installed on the workers that run its chunks."""

    __slots__ = ("id", "data", "kept", "outstanding", "final", "holders")

    def __init__(self, function_id: int, data: bytes, kept: list) -> None:
        self.id = function_id
        self.data = data
        self.kept = kept  # shared storages named by `data`: alive until every load
        self.outstanding = 0
        self.final = False
        self.holders: Set["_Worker"] = set()


class _Task:
    __slots__ = ("job", "start", "count", "kind", "star", "function", "payload", "shares", "seq")

    def __init__(
        self, job: Any, start: int, count: int, kind: int, star: int,
        function: Optional[_Function], payload: bytes, shares: bool,
    ) -> None:
        self.job = job
        self.start = start
        self.count = count
        self.kind = kind
        self.star = star
        self.function = function
        self.payload = payload
        self.shares = shares
        self.seq = -1


class _Worker:
    __slots__ = (
        "slot", "name", "process", "pid", "sentinel", "task_conn", "result_conn", "task_fd",
        "result_fd", "reader", "out", "inflight", "next_seq", "lock", "shared", "assigned",
        "stopping", "exiting", "ready", "want_write", "polled_write", "dead", "result_open", "successor_of",
    )

    def __init__(self, slot: int, name: str) -> None:
        self.slot = slot
        self.name = name
        self.inflight: Deque[_Task] = deque()
        self.out = OutBuffer()
        self.next_seq = 0
        self.assigned = 0
        self.stopping = False  # STOP queued: takes no more tasks
        self.exiting = False  # a task called sys.exit: takes no more tasks
        self.ready = False
        self.want_write = False
        self.polled_write = False
        self.dead = False
        self.result_open = True
        # A replacement started while its predecessor finishes its last tasks takes no
        # task before that one has exited: a pool never runs more than `processes`.
        self.successor_of: Optional["_Worker"] = None

    def takes_tasks(self) -> bool:
        return not (self.stopping or self.exiting or self.successor_of is not None)

    def started(self) -> int:
        return self.shared[0]

    def unstarted(self) -> int:
        started = self.shared[0]
        return sum(1 for task in self.inflight if task.seq > started)

    def close_channels(self) -> None:
        self.task_conn.close()
        self.result_conn.close()


def _discard(tasks: Iterable[_Task], codec: Codec) -> None:
    """Release what undelivered payloads hold in shared memory (loading drops it)."""
    for task in tasks:
        if task.shares:
            try:
                codec.loads(task.payload)
            except Exception:  # best effort: the payload's owner is gone anyway
                pass
        task.payload = b""


def _end_processes(processes: Sequence[Any], grace: float) -> None:
    """SIGTERM, wait up to ``grace`` s, SIGKILL what is left, reap everything."""
    alive = [p for p in processes if p.exitcode is None]
    for p in alive:
        try:
            p.terminate()
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace
    pending = {p.sentinel: p for p in alive}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        for sentinel in _mp_connection.wait(list(pending), remaining):
            pending.pop(sentinel, None)
    for p in pending.values():
        try:
            p.kill()
        except (OSError, ValueError):
            pass
    for p in processes:
        try:
            p.join(_KILL_WAIT)
            p.close()
        except ValueError:  # still running after SIGKILL (uninterruptible sleep): leave it
            pass


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
    ) -> None:
        self.processes = processes
        self.number = next(_counter)
        self.name = f"machinlike-{label}{self.number}"
        self._initializer = initializer
        self._initargs = initargs
        self._contexts = list(contexts)
        self._has_context = has_context
        self._maxtasks = maxtasks
        self._daemon = daemon
        self._codec = codec
        self._ctx = ctx
        self._window = window
        self._lock = threading.Lock()
        self._state = RUN
        self._broken_error: Optional[BaseException] = None
        self._backlog: Deque[_Task] = deque()
        self._workers: List[_Worker] = []
        self._rotation = 0
        self._feeds_open = 0
        self._spawn_queue: List[Tuple[int, Optional[_Worker]]] = []  # (slot, retiring predecessor)
        self._startup_failures = [0] * processes
        self._function_ids = itertools.count(1)
        self._init_failure: Optional[Tuple[_Worker, Any]] = None
        self._fatal: Optional[BaseException] = None
        self._sleeping = False
        self._woken = False
        self._poller = select.poll()
        self._roles: Dict[int, Tuple[int, Optional[_Worker]]] = {}
        self._wake_lock = threading.Lock()  # the wake-up fds are closed once, never written after
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller.register(self._wake_r, select.POLLIN)
        self._roles[self._wake_r] = (_WAKE, None)
        # Share mode needs torch's shared-memory manager anyway: start it once here, so
        # that workers connect to it instead of each starting one (~0.3 s apiece).
        self._primer = _reductions.manager_primer(start=codec.shares_cpu)
        self.replaced = 0  # workers started to replace dead or retired ones
        self._thread: Optional[threading.Thread] = None
        try:
            for slot in range(processes):
                self._adopt(self._launch(slot))
        except BaseException:
            _end_processes([w.process for w in self._workers], 0.0)
            for w in self._workers:
                w.close_channels()
            self._close_wake()
            raise
        self._thread = threading.Thread(target=self._run, name=f"{self.name}-manager", daemon=True)
        self._thread.start()

    # ================================================================== public side

    @property
    def state(self) -> str:
        return self._state

    def ahead(self) -> int:
        """How many chunks an imap may keep in flight beyond what was consumed."""
        return self.processes * (self._window + 1)

    def check_running(self) -> None:
        """Raise unless new work is accepted.

        Raises:
            BrokenPoolError: the pool is broken.
            ValueError: the pool was closed or terminated.
        """
        state = self._state
        if state is RUN:
            return
        if state is BROKEN:
            raise self._broken()
        raise ValueError(f"Pool not running: it was {state} (close() or terminate() was called)")

    def delivers_in_this_thread(self) -> bool:
        thread = self._thread
        return thread is not None and thread.ident == threading.get_ident()

    def function(self, func: Callable[..., Any]) -> _Function:
        """Pickle a map's function once.

        Raises:
            pickle.PicklingError, TypeError: it cannot be pickled.
        """
        data, kept = self._codec.dumps_tracked(func, multi_load=True)
        return _Function(next(self._function_ids), data, kept)

    def call(self, job: Any, func: Callable[..., Any], args: tuple, kwds: Optional[dict]) -> None:
        """Queue ``func(*args, **kwds)``; an encoding error fails ``job`` at once."""
        try:
            payload, kept = self._codec.dumps_tracked((func, args, kwds))
        except Exception as exc:
            job._failed(0, 1, exc)
            return
        self._enqueue([_Task(job, 0, 1, TASK_CALL, 0, None, payload, bool(kept))], None, False)

    def map(self, job: Any, function: _Function, star: bool, chunks: Iterable[Tuple[int, list]], final: bool) -> None:
        """Queue chunks ``(start, items)`` of ``job``; ``final``: no more will come."""
        tasks = []
        encode = self._codec.dumps_tracked
        flag = 1 if star else 0
        for start, items in chunks:
            try:
                payload, kept = encode(items)
            except Exception as exc:
                job._failed(start, len(items), exc)
                continue
            tasks.append(_Task(job, start, len(items), TASK_MAP, flag, function, payload, bool(kept)))
        self._enqueue(tasks, function, final)

    def feed_opened(self) -> None:
        with self._lock:
            self._feeds_open += 1

    def feed_closed(self) -> None:
        with self._lock:
            self._feeds_open -= 1
            wake = self._state is CLOSE and self._wake_locked()
        if wake:
            self._wake()

    def close(self) -> None:
        with self._lock:
            if self._state is RUN:
                self._state = CLOSE
            wake = self._wake_locked()
        if wake:
            self._wake()

    def terminate(self) -> None:
        """Fail what is pending, end the workers (SIGTERM, grace, SIGKILL), stop the
        manager. Idempotent; safe from a callback and from a finalizer."""
        with self._lock:
            # a broken pool has ended its workers already
            first = self._state is not TERMINATE and self._state is not BROKEN
            if first:
                self._state = TERMINATE
            tasks = self._take_all_tasks()
            workers, self._workers = self._workers, []  # terminate() owns their processes now
            wake = self._wake_locked(force=True)
        if wake:
            self._wake()
        if first:
            self._fail_tasks(tasks, PoolTerminatedError("the pool was terminated before this task finished"))
            _end_processes([w.process for w in workers], _TERM_GRACE)
        thread = self._thread
        if thread is not None and thread.ident != threading.get_ident():
            thread.join(_KILL_WAIT)
        if thread is None or not thread.is_alive():
            self._release_channels(workers)

    def join(self, timeout: Optional[float]) -> None:
        """Wait for the manager thread (hence every worker) to finish.

        Raises:
            ValueError: the pool is still running.
            RuntimeError: called from one of the pool's callbacks.
            TimeoutError: not finished within ``timeout`` seconds.
        """
        if self._state is RUN:
            raise ValueError("Pool is still running: call close() or terminate() before join()")
        if self.delivers_in_this_thread():
            raise RuntimeError("cannot join a pool from one of its own callbacks")
        thread = self._thread
        if thread is not None:
            thread.join(timeout)
            if thread.is_alive():
                with self._lock:
                    busy = [w.name for w in self._workers if w.inflight]
                    queued = len(self._backlog)
                raise TimeoutError(
                    f"the pool did not finish within {timeout:g} s: {queued} task(s) queued, "
                    f"worker(s) still busy: {busy or 'none'}"
                )

    # ================================================================== submission

    def _enqueue(self, tasks: List[_Task], function: Optional[_Function], final: bool) -> None:
        with self._lock:
            if self._state is TERMINATE or self._state is BROKEN:
                refused: Optional[BaseException] = self._broken() if self._state is BROKEN else \
                    PoolTerminatedError("the pool was terminated before this task was queued")
            else:
                refused = None
                if function is not None:
                    function.outstanding += len(tasks)
                    if final:
                        function.final = True
                self._backlog.extend(tasks)
                self._pump()
                if function is not None:
                    self._maybe_drop(function)
            wake = self._wake_locked()
        if wake:
            self._wake()
        if refused is not None:
            self._fail_tasks(tasks, refused)

    # ================================================================== scheduling (lock held)

    def _room(self, w: _Worker) -> bool:
        if len(w.inflight) >= self._window:
            return False
        if w.next_seq - w.shared[0] >= _worker.RING - 1:
            return False  # the revocation ring must cover every unread frame
        return not (self._maxtasks and w.assigned >= self._maxtasks)

    def _pump(self) -> None:
        backlog = self._backlog
        if not backlog:
            return
        candidates = [w for w in self._workers if w.takes_tasks()]
        if not candidates:
            return
        count = len(candidates)
        touched = set()
        while backlog:
            best = None
            best_load = self._window
            rotation = self._rotation
            for k in range(count):
                w = candidates[(rotation + k) % count]
                load = len(w.inflight)
                if load < best_load and self._room(w):
                    best, best_load = w, load
                    if load == 0:
                        break
            if best is None:
                break
            task = backlog.popleft()
            if task.job._is_done():  # a map that already failed, an abandoned imap
                self._task_settled(task)
                _discard([task], self._codec)
                continue
            self._assign(best, task)
            self._rotation = (candidates.index(best) + 1) % count
            touched.add(best)
        for w in touched:
            self._flush(w)

    def _assign(self, w: _Worker, task: _Task) -> None:
        function = task.function
        extra = 0
        if function is not None:
            extra = function.id
            if w not in function.holders:
                function.holders.add(w)
                w.out.push(INSTALL, 0, 0, extra, function.data)
        task.seq = w.next_seq
        w.next_seq += 1
        w.inflight.append(task)
        w.assigned += 1
        w.out.push(task.kind, task.star, task.seq, extra, task.payload)
        if self._maxtasks and w.assigned >= self._maxtasks and not w.stopping:
            # retire after this task; its replacement starts now, so capacity stays
            w.stopping = True
            w.out.push(STOP, 0, 0, 0)
            self._spawn_queue.append((w.slot, w))

    def _flush(self, w: _Worker) -> None:
        if w.dead:
            return
        try:
            done = w.out.flush(w.task_fd)
        except OSError:  # the worker is gone; its sentinel will tell
            w.out.clear()
            done = True
        w.want_write = not done

    def _steal(self) -> None:
        """Give idle workers the newest unstarted tasks of the busiest ones."""
        if self._backlog:
            return
        # Only a worker that is ready can run a task sooner than its current holder; a
        # starting one stealing from another starting one would just shuffle the task.
        idle = [w for w in self._workers if w.ready and not w.inflight and w.takes_tasks()]
        for thief in idle:
            victim, best = None, 0
            for w in self._workers:
                if w is thief or w.dead:
                    continue
                unstarted = w.unstarted()
                if unstarted > best:
                    victim, best = w, unstarted
            if victim is None:
                return
            if not victim.lock.acquire(True, _STEAL_LOCK_WAIT):
                continue  # it holds its lock only for microseconds: it is dying
            try:
                started = victim.shared[0]
                unstarted_tasks = [t for t in victim.inflight if t.seq > started]
                taken = unstarted_tasks[len(unstarted_tasks) // 2:]  # the newest half, rounded up
                for task in taken:
                    victim.shared[2 + task.seq % _worker.RING] = task.seq
            finally:
                victim.lock.release()
            if not taken:
                continue
            for _ in taken:
                victim.inflight.pop()  # unstarted tasks are the newest: at the right end
            victim.assigned -= len(taken)
            self._backlog.extendleft(reversed(taken))
            self._pump()

    def _task_settled(self, task: _Task) -> None:
        function = task.function
        if function is not None:
            function.outstanding -= 1
            self._maybe_drop(function)

    def _maybe_drop(self, function: _Function) -> None:
        if function.outstanding or not function.final:
            return
        for w in function.holders:
            if not w.dead:
                w.out.push(DROP, 0, 0, function.id)
                self._flush(w)
        function.holders.clear()
        function.kept = []

    def _stop_when_done(self) -> None:
        if self._state is not CLOSE or self._backlog or self._feeds_open:
            return
        if any(w.inflight for w in self._workers):
            return
        for w in self._workers:
            if not w.stopping:
                w.stopping = True
                w.out.push(STOP, 0, 0, 0)
                self._flush(w)

    def _take_all_tasks(self) -> List[_Task]:
        tasks = list(self._backlog)
        self._backlog.clear()
        for w in self._workers:
            tasks.extend(w.inflight)
            w.inflight.clear()
        return tasks

    # ================================================================== waking the manager

    def _wake_locked(self, force: bool = False) -> bool:
        """Whether the manager must be woken (called with the lock held)."""
        if self._woken or not self._sleeping:
            return False
        if force or self._state is not RUN or any(w.want_write != w.polled_write for w in self._workers) \
                or self._spawn_queue:
            self._woken = True
            return True
        return False

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w < 0:
                return  # the manager has finished
            try:
                os.write(self._wake_w, b"\0")
            except OSError:  # full: a wake-up is pending anyway
                pass

    # ================================================================== workers

    def _launch(self, slot: int) -> _Worker:
        """Start a worker process for ``slot`` (no lock held: it takes milliseconds)."""
        ctx = self._ctx
        codec = self._codec
        w = _Worker(slot, f"pool worker {slot}")
        init = codec.dumps((self._initializer, self._initargs, self._contexts[slot], self._has_context))
        primer = None if self._primer is None else _plain_dumps(self._primer, copy_tensor=False)
        task_r, task_w = ctx.Pipe(duplex=False)
        result_r, result_w = ctx.Pipe(duplex=False)
        w.lock = ctx.Lock()
        w.shared = ctx.RawArray("q", [-1] * (2 + _worker.RING))
        w.shared[1] = _worker.IDLE
        process = ctx.Process(
            target=_worker.main,
            args=(task_r, result_w, w.lock, w.shared, codec, slot, init, primer),
            name=f"{self.name}-worker{slot}",
            daemon=self._daemon,
        )
        try:
            process.start()
        finally:
            task_r.close()
            result_w.close()
        w.process = process
        w.pid = process.pid
        w.sentinel = process.sentinel
        w.task_conn, w.result_conn = task_w, result_r
        w.task_fd, w.result_fd = task_w.fileno(), result_r.fileno()
        os.set_blocking(w.task_fd, False)
        os.set_blocking(w.result_fd, False)
        w.reader = FrameReader(w.result_fd)
        return w

    def _adopt(self, w: _Worker) -> None:
        """Register a started worker (manager thread, or the constructor before it)."""
        self._poller.register(w.result_fd, select.POLLIN)
        self._poller.register(w.sentinel, select.POLLIN)
        self._roles[w.result_fd] = (_RESULT, w)
        self._roles[w.sentinel] = (_SENTINEL, w)
        self._workers.append(w)

    def _bury(self, w: _Worker, out: list) -> None:
        """Account for a worker that has ended (lock held, its pipe drained)."""
        if w.dead:
            return
        w.dead = True
        if w in self._workers:
            self._workers.remove(w)
        for other in self._workers:
            if other.successor_of is w:
                other.successor_of = None
        for fd in (w.result_fd, w.sentinel, w.task_fd):
            if self._roles.pop(fd, None) is not None:
                try:
                    self._poller.unregister(fd)
                except KeyError:
                    pass
        terminating = self._state is TERMINATE
        exitcode = None if terminating else w.process.exitcode
        if not terminating:
            w.process.close()  # reaped; frees its descriptors
        w.close_channels()
        started = w.shared[0]
        phase = _worker.PHASES.get(w.shared[1], "")
        requeue = []
        for task in w.inflight:
            if task.seq > started:
                requeue.append(task)
                continue
            error = WorkerLostError(w.name, w.pid, exitcode, phase)
            self._task_settled(task)
            out.append((task, _LOST, error, w))
        w.inflight.clear()
        self._backlog.extendleft(reversed(requeue))
        if terminating or self._state is BROKEN:
            return
        if not w.ready and not w.exiting:
            if self._init_failure is not None:
                return  # the pool breaks below, with the initializer's error
            self._startup_failures[w.slot] += 1
            if self._startup_failures[w.slot] >= _STARTUP_RETRIES:
                cause = WorkerLostError(w.name, w.pid, exitcode, "while starting, for the third time in a row")
                self._fatal = cause
                return
        if w.stopping:
            return  # retired: its replacement was queued when it got STOP
        work_left = self._backlog or self._feeds_open or any(x.inflight for x in self._workers)
        if self._state is RUN or work_left:
            self._spawn_queue.append((w.slot, None))

    def _spawn_queued(self) -> None:
        """Start the queued replacements (manager thread, no lock held)."""
        with self._lock:
            slots, self._spawn_queue = self._spawn_queue, []
        for slot, predecessor in slots:
            try:
                w = self._launch(slot)
            except Exception as exc:
                self._break(exc)
                return
            with self._lock:
                if self._state is TERMINATE or self._state is BROKEN:
                    late = True
                else:
                    late = False
                    if predecessor is not None and not predecessor.dead:
                        w.successor_of = predecessor
                    self._adopt(w)
                    self.replaced += 1
                    if self._state is CLOSE and not (
                        self._backlog or self._feeds_open or any(x.inflight for x in self._workers)
                    ):
                        w.stopping = True
                        w.out.push(STOP, 0, 0, 0)
                        self._flush(w)
                    self._pump()
            if late:
                _end_processes([w.process], 0.0)
                w.close_channels()

    def _release_channels(self, workers: Iterable[_Worker]) -> None:
        for w in workers:
            w.close_channels()

    # ================================================================== the manager thread

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            self._break(exc)
        finally:
            with self._lock:
                workers = list(self._workers)
            self._release_channels(workers)
            self._close_wake()

    def _loop(self) -> None:
        poller = self._poller
        while True:
            with self._lock:
                if self._finished():
                    return
                for w in self._workers:
                    if w.want_write != w.polled_write:
                        if w.want_write:
                            poller.register(w.task_fd, select.POLLOUT)
                            self._roles[w.task_fd] = (_TASK, w)
                        else:
                            poller.unregister(w.task_fd)
                            self._roles.pop(w.task_fd, None)
                        w.polled_write = w.want_write
                self._sleeping = True
            events = poller.poll()
            with self._lock:
                self._sleeping = False
                self._woken = False
            self._step(events)

    def _finished(self) -> bool:
        state = self._state
        if state is TERMINATE or state is BROKEN:
            return True
        return state is CLOSE and not self._workers and not self._spawn_queue

    def _step(self, events: List[Tuple[int, int]]) -> None:
        got: List[Tuple[_Worker, list]] = []
        ended: List[_Worker] = []
        writable: List[_Worker] = []
        for fd, _ in events:
            role, w = self._roles.get(fd, (None, None))
            if role == _WAKE:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            elif role == _RESULT:
                got.append((w, w.reader.read_available()))
                if w.reader.eof and w.result_open:
                    w.result_open = False
                    self._poller.unregister(fd)
                    self._roles.pop(fd, None)
            elif role == _SENTINEL:
                ended.append(w)
            elif role == _TASK:
                writable.append(w)
        for w in ended:  # what it wrote before it ended comes first
            if w.result_open:
                got.append((w, w.reader.read_available()))
        out: List[tuple] = []
        with self._lock:
            for w, frames in got:
                for frame in frames:
                    self._match(w, frame, out)
            for w in writable:
                self._flush(w)
            for w in ended:
                self._bury(w, out)
            if self._state is TERMINATE:
                return  # terminate() fails and ends everything
            self._pump()
            self._steal()
            self._stop_when_done()
            fatal = self._fatal or self._init_error()
        for item in out:
            self._deliver(*item)
        if fatal is not None:
            self._break(fatal)
            return
        if self._spawn_queue:
            self._spawn_queued()

    def _init_error(self) -> Optional[BaseException]:
        failure = self._init_failure
        if failure is None:
            return None
        w, payload = failure
        try:
            return self._codec.loads(payload)
        except Exception as exc:
            return exc

    def _match(self, w: _Worker, frame: tuple, out: list) -> None:
        kind, _, seq, _, payload = frame
        if kind == READY:
            w.ready = True
            self._startup_failures[w.slot] = 0
            return
        if kind == INIT_FAILED:
            if self._init_failure is None:
                self._init_failure = (w, payload)
            return
        inflight = w.inflight
        if not inflight or inflight[0].seq != seq:
            # cannot happen with an intact pipe; do not guess which task this was
            w.exiting = True
            try:
                w.process.kill()
            except (OSError, ValueError):
                pass
            return
        task = inflight.popleft()
        if kind == EXITING:
            w.exiting = True
        self._task_settled(task)
        out.append((task, kind, payload, w))

    def _deliver(self, task: _Task, kind: int, payload: Any, w: _Worker) -> None:
        """Decode a task's outcome and settle its job (callbacks run here)."""
        job, start, count = task.job, task.start, task.count
        task.payload = b""
        loads = self._codec.loads
        try:
            if kind == DONE:
                job._done(start, count, loads(payload))
            elif kind == FAILED:
                job._failed(start, count, loads(payload))
            elif kind == PARTIAL:
                pickled, errors = loads(payload)
                values = [None if data is None else loads(data) for data in pickled]
                job._partial(start, values, errors)
            elif kind == _LOST:
                job._failed(start, count, payload)
            elif kind == EXITING:
                code, exitcode, tb_text, phase = loads(payload)
                error = WorkerLostError(w.name, w.pid, exitcode, f"sys.exit({code}) was called {phase}")
                error.__cause__ = RemoteTraceback(tb_text)
                job._failed(start, count, error)
        except Exception as exc:
            add_note = getattr(exc, "add_note", None)
            if add_note is not None:
                add_note(f"while loading the outcome of a task from {w.name} (pid {w.pid}) in the pool's process")
            job._failed(start, count, exc)

    def _break(self, cause: BaseException) -> None:
        """Enter the broken state: fail everything, end every worker."""
        error = BrokenPoolError(f"{self.name} is broken and cannot run tasks: {type(cause).__name__}: {cause}")
        error.__cause__ = cause
        with self._lock:
            if self._state is TERMINATE:
                return
            self._state = BROKEN
            self._broken_error = error
            tasks = self._take_all_tasks()
            workers, self._workers = self._workers, []
            for w in workers:
                w.dead = True
        self._fail_tasks(tasks, error)
        _end_processes([w.process for w in workers], _TERM_GRACE)
        self._release_channels(workers)

    def _broken(self) -> BrokenPoolError:
        error = self._broken_error
        assert error is not None
        fresh = BrokenPoolError(*error.args)
        fresh.__cause__ = error.__cause__
        return fresh

    def _fail_tasks(self, tasks: List[_Task], error: BaseException) -> None:
        jobs = {}
        for task in tasks:
            jobs[id(task.job)] = task.job
        _discard(tasks, self._codec)
        for job in jobs.values():
            job._abort(error)

    def _close_wake(self) -> None:
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    os.close(fd)
            self._wake_r = self._wake_w = -1
