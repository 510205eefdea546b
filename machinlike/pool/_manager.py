"""The process engine's manager thread: results in, deaths buried, replacements started.

::

    "machinlike-pool-N-manager":
      poll([wake-up pipe, result pipes, worker sentinels, full task pipes])   (Watch)
        result frames ─> match worker i's oldest task ─> decode, settle, callbacks
        sentinel      ─> bury worker i: drain its pipe; tasks it had started fail with
                         WorkerLostError (exit code / signal, phase); tasks it had not
                         started go back to the front of the backlog; the Supervisor
                         decides about a replacement (same slot, same context)
        writable      ─> flush what the task pipe did not take
        then: pump the backlog, steal for idle workers, stop workers once closed & done
      before each sleep: stop workers once closed & done, start queued replacements
      (callers wake only a sleeping manager)
      until the pool is terminated or broken, or closed with every worker gone

Like CPython's ``_ExecutorManagerThread``, it is handed exactly what it uses, and owns
only the thread and the decoding of outcomes: the state is the flags', the tasks and
workers the dispatcher's, replacements the supervisor's, the poll set the watch's.
Callbacks run in this thread, outside the engine lock.
"""

from __future__ import annotations

import threading
from typing import Any, List, Optional, Tuple

from .. import _warm
from .._procs import end_processes
from ..exception import RemoteTraceback, WorkerLostError
from ._dispatch import Dispatcher
from ._errors import BrokenPoolError
from ._handle import WorkerHandle
from ._ledger import PHASES
from ._policy import Codec
from ._state import PoolFlags, PoolState
from ._supervisor import Supervisor
from ._task import Task, fail_tasks, fail_unsent, release_cuda
from ._wakeup import Wakeup
from ._watch import RESULT, SENTINEL, TASK, WAKE, Watch
from ._wire import DONE, EXITING, FAILED, INIT_FAILED, PARTIAL, READY

__all__ = ["Manager", "TERM_GRACE"]

TERM_GRACE = 1.0  # seconds between SIGTERM and SIGKILL
_LOST = -1  # outcome kind for the tasks of a dead worker (payload: the error)

Outcome = Tuple[Task, int, Any, WorkerHandle]


class Manager:
    """The manager thread and its loop (see the module docstring).

    Args:
        name: The pool's name (the thread is ``<name>-manager``).
        flags: The pool's state and the engine lock.
        dispatch: Backlog and workers.
        supervisor: Start-up and replacement of workers.
        watch: The poll set.
        wakeup: The pipe callers wake this thread through.
        codec: Decodes outcomes.
    """

    def __init__(
        self, name: str, flags: PoolFlags, dispatch: Dispatcher, supervisor: Supervisor, watch: Watch,
        wakeup: Wakeup, codec: Codec,
    ) -> None:
        self._name = name
        self._flags = flags
        self._dispatch = dispatch
        self._supervisor = supervisor
        self._watch = watch
        self._wakeup = wakeup
        self._codec = codec
        self.thread: Optional[threading.Thread] = None

    def adopt(self, w: WorkerHandle) -> None:
        """Take a started worker in (engine lock held, or before the thread starts)."""
        self._watch.add(w)
        self._dispatch.add(w)

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name=f"{self._name}-manager", daemon=True)
        self.thread.start()

    def is_current(self) -> bool:
        """Whether the calling thread is this manager (which delivers results)."""
        thread = self.thread
        return thread is not None and thread.ident == threading.get_ident()

    def break_pool(self, cause: BaseException) -> None:
        """Enter the broken state: fail everything, end every worker."""
        error = BrokenPoolError(f"{self._name} is broken and cannot run tasks: {type(cause).__name__}: {cause}")
        error.__cause__ = cause
        with self._flags.lock:
            if not self._flags.break_(error):
                return
            tasks = self._dispatch.take_all()
            workers = self._dispatch.release_workers()
        fail_tasks(tasks, error, self._codec, cuda=False)
        end_processes([w.process for w in workers], TERM_GRACE, close=True)
        release_cuda(tasks)  # (every worker has ended: what none of them gave back)
        for w in workers:
            w.release_cuda()
            w.close_channels()

    # ------------------------------------------------------------------ the loop

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # a bug here must not leave callers waiting forever
            self.break_pool(exc)
        finally:
            with self._flags.lock:
                workers = list(self._dispatch.workers)
            for w in workers:
                w.close_channels()
            self._wakeup.close()

    def _loop(self) -> None:
        flags, watch, wakeup, dispatch = self._flags, self._watch, self._wakeup, self._dispatch
        supervisor = self._supervisor
        while True:
            with flags.lock:
                if self._finished():
                    return
                # Callers wake only a sleeping manager: what one changed while this thread
                # was awake (close() during a callback, a replacement queued by a submit)
                # is looked at here, or nothing would ever wake it for that.
                dispatch.stop_when_done(flags)
                spawn = supervisor.pending()
                if not spawn:
                    watch.sync_writes(dispatch.workers)
                    wakeup.arm()
            if spawn:
                self._spawn_queued()
                continue
            events = watch.poll()
            with flags.lock:
                wakeup.disarm()
            self._step(events)

    def _finished(self) -> bool:
        flags = self._flags
        if flags.ended():
            return True
        return flags.state is PoolState.CLOSE and not self._dispatch.workers and not self._supervisor.pending()

    def _step(self, events: List[Tuple[int, int]]) -> None:
        watch = self._watch
        got: List[Tuple[WorkerHandle, list]] = []
        ended: List[WorkerHandle] = []
        writable: List[WorkerHandle] = []
        for fd, _ in events:
            role, w = watch.role(fd)
            if role == WAKE:
                self._wakeup.drain()
            elif role == RESULT and w is not None:
                got.append((w, w.reader.read_available()))
                if w.reader.eof:
                    watch.end_of_results(w)
            elif role == SENTINEL and w is not None:
                ended.append(w)
            elif role == TASK and w is not None:
                writable.append(w)
        for w in ended:  # what it wrote before it ended comes first
            if watch.reading(w):
                got.append((w, w.reader.read_available()))
        out: List[Outcome] = []
        flags, dispatch, supervisor = self._flags, self._dispatch, self._supervisor
        with flags.lock:
            for w, frames in got:
                for frame in frames:
                    self._match(w, frame, out)
            for w in writable:
                w.flush()
            for w in ended:
                self._bury(w, out)
            if flags.state is PoolState.TERMINATE:
                return  # terminate() fails and ends everything
            dispatch.pump()
            dispatch.steal()
            dispatch.stop_when_done(flags)  # (before the callbacks below: workers end meanwhile)
            fatal = supervisor.error()
            unsent = dispatch.take_unsent()
        for item in out:
            self._deliver(*item)
        if unsent:
            fail_unsent(unsent, self._codec)
        if fatal is not None:
            self.break_pool(fatal)
        # (queued replacements start in _loop, next, before it sleeps)

    # ------------------------------------------------------------------ frames and deaths (lock held)

    def _match(self, w: WorkerHandle, frame: tuple, out: List[Outcome]) -> None:
        kind, _, seq, _, payload = frame
        if kind == READY:
            self._supervisor.on_ready(w)
            return
        if kind == INIT_FAILED:
            self._supervisor.on_init_failed(payload)
            return
        task = w.settle(seq)
        if task is None:
            w.kill()  # cannot happen with an intact pipe; do not guess which task this was
            return
        if kind == EXITING:
            w.mark_exiting()
        w.hold_cuda(task)  # it loaded the task: its CUDA references are the worker's to give back
        if task.function is not None:
            task.function.ran_on(w)
        self._dispatch.settled(task)
        out.append((task, kind, payload, w))

    def _bury(self, w: WorkerHandle, out: List[Outcome]) -> None:
        """Account for a worker that has ended (its pipe drained)."""
        if w.is_dead():
            return
        flags, dispatch = self._flags, self._dispatch
        dispatch.remove(w)
        self._watch.forget(w)
        terminating = flags.state is PoolState.TERMINATE
        exitcode = None if terminating else w.process.exitcode
        # (255: what the forkserver's pipe says when the server that forked it died; asked
        # before bury() closes the process object)
        server = _warm.server_of_died(w.process) if exitcode == 255 else None
        life = w.life
        lost, requeue = w.bury(reap=not terminating)  # terminate() owns the processes then
        phase = PHASES.get(w.phase(), "")
        if server is not None:
            phase += f"; the warm forkserver that started it (pid {server}) died, which ended it"
        release_cuda(lost)  # (it has ended: what it held and never gave back)
        w.release_cuda()
        for task in lost:
            dispatch.settled(task)
            out.append((task, _LOST, WorkerLostError(w.name, w.pid, exitcode, phase), w))
        dispatch.requeue(requeue)
        if flags.ended():
            return
        self._supervisor.after_death(w, life, exitcode, flags.state is PoolState.RUN, dispatch.holds_work(flags))

    def _spawn_queued(self) -> None:
        """Start the queued replacements (no lock held while a process starts)."""
        flags, dispatch, supervisor = self._flags, self._dispatch, self._supervisor
        with flags.lock:
            queue = supervisor.take_queue()
        for slot, predecessor in queue:
            try:
                w = supervisor.launch(slot)
            except Exception as exc:
                self.break_pool(exc)
                return
            with flags.lock:
                late = flags.ended()
                if not late:
                    if predecessor is not None:
                        w.follow(predecessor)
                    self.adopt(w)
                    supervisor.adopted_replacement()
                    if flags.state is PoolState.CLOSE and not dispatch.holds_work(flags) and w.retire():
                        w.flush()
                    dispatch.pump()
                unsent = dispatch.take_unsent()
            if unsent:
                fail_unsent(unsent, self._codec)
            if late:
                end_processes([w.process], 0.0, close=True)
                w.release_cuda()  # (its initializer's arguments)
                w.close_channels()

    # ------------------------------------------------------------------ outcomes (no lock)

    def _deliver(self, task: Task, kind: int, payload: Any, w: WorkerHandle) -> None:
        """Decode a task's outcome and settle its job (callbacks run here)."""
        job, start, count = task.job, task.start, task.count
        task.payload = b""
        loads = self._codec.loads_result
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
        finally:
            w.ledger.delivered(task.seq)  # a retiring worker may exit now (see _ledger)
