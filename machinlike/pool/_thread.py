"""The thread pool engine: worker threads on one in-memory queue; nothing is pickled.

    callers ──(kind, job, func, ...)──> queue.SimpleQueue ──> "machinlike-poolN-thread-i"
                                                              run, settle the job (callbacks
                                                              under the pool's callback lock)

Functions, arguments and results are the caller's own objects: a closure over a tensor
edits that very tensor, and an exception keeps its own traceback. Callbacks never run
concurrently (one lock), as in the standard pool where one thread runs them all.

Threads cannot be killed: ``terminate()`` fails every pending task at once and stops the
threads, but a task that is running finishes in the background (its result is dropped);
``join()`` waits for it.

Interpreter exit: a pool left open is terminated, and its threads are *joined* (up to
``EXIT_WAIT`` seconds for all pools together) before the interpreter finalizes. A daemon
thread still alive then is stopped by CPython when it next takes the GIL, with
``pthread_exit``; if it is inside torch at that moment (a GIL-releasing operator), the
forced unwind crosses a ``noexcept`` C++ frame and the process aborts with "terminate
called without an active exception", exit code 134 (the standard ``ThreadPool`` does the
same). The hook is registered once, when the first thread pool starts.
"""

from __future__ import annotations

import atexit
import functools
import itertools
import queue
import threading
import time
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ._errors import BrokenPoolError, PoolTerminatedError
from ._result import Job
from ._state import PoolFlags, PoolState
from ._worker import run_chunk

__all__ = ["ThreadCore", "EXIT_WAIT"]

#: Seconds interpreter exit waits, for all thread pools together, for their threads.
EXIT_WAIT = 5.0

RUN, CLOSE, TERMINATE, BROKEN = PoolState.RUN, PoolState.CLOSE, PoolState.TERMINATE, PoolState.BROKEN

_CALL, _MAP = 1, 2
_STOP = None
_counter = itertools.count(1)
_exit_lock = threading.Lock()
_open_cores: "Optional[weakref.WeakSet[ThreadCore]]" = None  # created with the exit hook


def _track(core: "ThreadCore") -> None:
    """Register ``core`` for the exit hook (registered on the first call)."""
    global _open_cores
    with _exit_lock:
        if _open_cores is None:
            _open_cores = weakref.WeakSet()
            # atexit runs its hooks last-in first-out: this one runs before
            # multiprocessing's finalizers, while daemon threads still run normally.
            atexit.register(_end_at_exit)
        _open_cores.add(core)


def _end_at_exit() -> None:
    with _exit_lock:
        cores = list(_open_cores or ())
    deadline = time.monotonic() + EXIT_WAIT
    for core in cores:
        core.terminate()
    for core in cores:
        try:
            core.join(max(0.0, deadline - time.monotonic()))
        except (TimeoutError, ValueError):  # a task still runs: leave it, as before
            pass


class ThreadCore:
    """The engine behind :class:`~machinlike.pool.ThreadPool` (see the module docstring).

    Args:
        processes: Number of worker threads.
        initializer: Called in each worker thread before its first task.
        initargs: Arguments for ``initializer``.
        contexts: One context per worker slot.
        has_context: Whether functions receive their thread's context first.
        maxtasks: Tasks (chunks) a thread runs before it is replaced; None: no limit.
        daemon: Daemon flag of the threads.
        label: Pool kind for thread names.
    """

    def __init__(
        self, *, processes: int, initializer: Optional[Callable[..., Any]], initargs: tuple,
        contexts: Sequence[Any], has_context: bool, maxtasks: Optional[int], daemon: bool, label: str,
    ) -> None:
        self.processes = processes
        self.name = f"machinlike-{label}{next(_counter)}"
        self._initializer = initializer
        self._initargs = initargs
        self._contexts = list(contexts)
        self._has_context = has_context
        self._maxtasks = maxtasks
        self._daemon = daemon
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._flags = PoolFlags()
        self._lock = self._flags.lock  # guards the flags, _jobs, _threads, _stops_sent
        self._callback_lock = threading.Lock()
        self._delivering = threading.local()  # .now: this thread runs callbacks (holds _callback_lock)
        self._jobs: Dict[int, List[Any]] = {}  # id(job) -> [job, tasks not yet settled]
        self._stops_sent = False
        self._threads: List[threading.Thread] = []
        self._generation = itertools.count()
        self.replaced = 0
        with self._lock:
            for slot in range(processes):
                self._start_thread(slot)
        _track(self)

    # ------------------------------------------------------------------ public side

    @property
    def state(self) -> PoolState:
        return self._flags.state

    def ahead(self) -> int:
        return self.processes * 2

    def check_running(self) -> None:
        """Raise unless new work is accepted (see ``PoolFlags.check_running``)."""
        self._flags.check_running()

    def delivers_in_this_thread(self) -> bool:
        # Inside a callback: the callbacks take turns (one lock, as multiprocessing's one
        # result thread runs them), so a result another thread settles would wait for this
        # callback to end, which waits for it: a deadlock of the whole pool (cold trial 27).
        # A task's own function waiting for another task is the user's call.
        return getattr(self._delivering, "now", False)

    def function(self, func: Callable[..., Any]) -> Callable[..., Any]:
        return func

    def call(self, job: Job, func: Callable[..., Any], args: tuple, kwds: Optional[dict]) -> None:
        self._put([(_CALL, job, func, args, kwds, 0, 1)], job, 1)

    def map(self, job: Optional[Job], func: Callable[..., Any], star: bool, chunks: Any, final: bool) -> None:
        items = [(_MAP, job, func, star, chunk, start, len(chunk)) for start, chunk in chunks]
        if items:
            self._put(items, job, len(items))

    def feed_opened(self) -> None:
        with self._lock:
            self._flags.feeds_open += 1

    def feed_closed(self) -> None:
        with self._lock:
            self._flags.feeds_open -= 1
            self._stop_when_done()

    def close(self) -> None:
        with self._lock:
            self._flags.close()
            self._stop_when_done()

    def terminate(self) -> None:
        with self._lock:
            if self._flags.state is TERMINATE:
                return
            self._flags.terminate()  # a broken pool stays broken
            jobs = [entry[0] for entry in self._jobs.values()]
            self._jobs.clear()
            self._send_stops()
        error = PoolTerminatedError("the pool was terminated before this task finished")
        for job in jobs:
            job._abort(error)

    def join(self, timeout: Optional[float]) -> None:
        """Wait for every worker thread to end.

        Raises:
            ValueError: the pool is still running.
            TimeoutError: threads still run after ``timeout`` seconds.
        """
        if self._flags.state is RUN:
            raise ValueError("Pool is still running: call close() or terminate() before join()")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._lock:
                threads = [t for t in self._threads if t.is_alive() and t is not threading.current_thread()]
            if not threads:
                return
            for thread in threads:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                thread.join(remaining)
                if thread.is_alive():
                    raise TimeoutError(f"the thread pool did not finish within {timeout:g} s: {thread.name} is busy")

    # ------------------------------------------------------------------ internals

    def _put(self, items: List[tuple], job: Any, count: int) -> None:
        with self._lock:
            if self._flags.ended():
                refused = True
            else:
                refused = False
                entry = self._jobs.get(id(job))
                if entry is None:
                    self._jobs[id(job)] = [job, count]
                else:
                    entry[1] += count
                put = self._queue.put
                for item in items:
                    put(item)
        if refused:
            job._abort(PoolTerminatedError("the pool was terminated before this task was queued"))

    def _start_thread(self, slot: int) -> None:
        thread = threading.Thread(
            target=self._work, args=(slot,), name=f"{self.name}-thread{slot}-{next(self._generation)}",
            daemon=self._daemon,
        )
        self._threads = [t for t in self._threads if t.is_alive()]
        self._threads.append(thread)
        thread.start()

    def _stop_when_done(self) -> None:
        # lock held: once closed and nothing is left to feed, one STOP per thread, queued
        # after every task (the queue is FIFO)
        if self._flags.state is CLOSE and not self._flags.feeds_open:
            self._send_stops()

    def _send_stops(self) -> None:
        if not self._stops_sent:
            self._stops_sent = True
            for _ in range(self.processes):
                self._queue.put(_STOP)

    def _work(self, slot: int) -> None:
        context = self._contexts[slot]
        if self._initializer is not None:
            try:
                self._initializer(*self._initargs)
            except BaseException as exc:
                self._break(exc, slot)
                return
        done = 0
        get = self._queue.get
        while True:
            item = get()
            if item is _STOP:
                return
            if self._flags.ended():
                continue  # its job was failed already; drain until our STOP
            self._execute(item, context)
            del item  # an idle thread holds nothing of its last task (tensors, graphs)
            done += 1
            if self._maxtasks is not None and done >= self._maxtasks:
                with self._lock:
                    if not self._flags.ended():
                        self.replaced += 1
                        self._start_thread(slot)  # inherits this slot and its context
                        return
                return

    def _execute(self, item: tuple, context: Any) -> None:
        kind, job, func, a, b, start, count = item
        call = functools.partial(func, context) if self._has_context else func
        if kind == _CALL:
            try:
                value = call(*a, **(b or {}))
            except BaseException as exc:
                outcome: Tuple[Any, ...] = ("failed", exc)
            else:
                outcome = ("done", value)
        else:
            try:
                values, errors = run_chunk(call, b, bool(a))
            except SystemExit as exc:  # a thread cannot exit the process: report it
                outcome = ("failed", exc)
            else:
                outcome = ("done", values) if errors is None else ("partial", values, errors)
        del call, func
        with self._callback_lock:
            self._delivering.now = True
            try:
                if outcome[0] == "done":
                    job._done(start, count, outcome[1])
                elif outcome[0] == "failed":
                    job._failed(start, count, outcome[1])
                else:
                    job._partial(start, outcome[1], outcome[2])
            finally:
                self._delivering.now = False
        with self._lock:
            entry = self._jobs.get(id(job))
            if entry is not None:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._jobs[id(job)]

    def _break(self, cause: BaseException, slot: int) -> None:
        error = BrokenPoolError(f"{self.name} is broken: the initializer raised in thread slot {slot}: {cause!r}")
        error.__cause__ = cause
        with self._lock:
            if not self._flags.break_(error):
                return
            jobs = [entry[0] for entry in self._jobs.values()]
            self._jobs.clear()
            self._send_stops()
        for job in jobs:
            job._abort(error)
