"""Starting process workers, and deciding when a dead or retired one is replaced.

::

    launch(slot) ──> a process running ``_worker.main`` with two private pipes and a ledger
    READY        ──> the slot's start-up strikes reset
    INIT_FAILED  ──> kept: the pool breaks with the initializer's own exception
    a death      ──> never ready?  a strike for its slot; the third in a row breaks the pool
                     retiring?     no: its successor was queued when it got STOP
                     otherwise     replaced while the pool runs or still has work
    maxtasks     ──> replace_later(slot, predecessor): the successor starts at once and
                     takes tasks once its predecessor has ended (never more than N run)

Replacements are queued under the engine lock and started by the manager thread without
it (:meth:`take_queue`, then :meth:`launch`: starting takes milliseconds).

Not thread-safe: everything but :meth:`launch` is called with the engine lock held.
"""

from __future__ import annotations

from multiprocessing.context import BaseContext
from typing import Any, Callable, List, Optional, Sequence, Tuple

from .. import _mainguard, _reductions
from ..exception import WorkerLostError
from ..pickle import dumps as _plain_dumps
from . import _worker
from ._handle import Life, WorkerHandle
from ._cuda_shares import counters_in, release_unheld
from ._ledger import Ledger
from ._policy import Codec

__all__ = ["Supervisor", "STARTUP_RETRIES"]

#: Deaths in a row of a slot's worker before it said READY that break the pool.
STARTUP_RETRIES = 3


class Supervisor:
    """Worker start-up and replacement (see the module docstring).

    Args:
        name: The pool's name, for process names.
        processes: Number of worker slots.
        initializer: Called in each worker before its first task.
        initargs: Arguments for ``initializer``.
        contexts: One context per slot.
        has_context: Whether functions receive their worker's context first.
        daemon: Daemon flag of the worker processes.
        codec: The tensor policy (pickles what a worker starts with).
        ctx: Multiprocessing context that starts the workers.
    """

    def __init__(
        self, *, name: str, processes: int, initializer: Optional[Callable[..., Any]], initargs: tuple,
        contexts: Sequence[Any], has_context: bool, daemon: bool, codec: Codec, ctx: BaseContext,
    ) -> None:
        self._name = name
        self._initializer = initializer
        self._initargs = initargs
        self._contexts = list(contexts)
        self._has_context = has_context
        self._daemon = daemon
        self._codec = codec
        self._ctx = ctx
        self._strikes = [0] * processes  # deaths in a row before READY, per slot
        self._queue: List[Tuple[int, Optional[WorkerHandle]]] = []  # (slot, retiring predecessor)
        self._init_failure: Optional[bytes] = None  # the first INIT_FAILED payload
        self._fatal: Optional[BaseException] = None
        self.replaced = 0  # workers started to replace dead or retired ones
        # Share mode needs torch's shared-memory manager anyway: start it once here, so
        # that workers connect to it instead of each starting one (~0.3 s apiece).
        self._primer = _reductions.manager_primer(start=codec.shares_cpu)

    def launch(self, slot: int) -> WorkerHandle:
        """Start a worker process for ``slot`` (no lock held: it takes milliseconds).

        Raises:
            pickle.PicklingError, TypeError: the initializer, its arguments or the
                slot's context cannot be pickled.
            OSError: the process could not be started.
        """
        ctx = self._ctx
        codec = self._codec
        init, kept = codec.dumps_tracked((self._initializer, self._initargs, self._contexts[slot], self._has_context))
        counters = counters_in(kept)  # CUDA tensors among them: the worker's to give back
        primer = None if self._primer is None else _plain_dumps(self._primer, copy_tensor=False)
        task_r, task_w = ctx.Pipe(duplex=False)
        result_r, result_w = ctx.Pipe(duplex=False)
        ledger = Ledger.create(ctx)
        process = ctx.Process(  # type: ignore[attr-defined]
            target=_worker.main,
            args=(task_r, result_w, ledger, codec, slot, init, primer),
            name=f"{self._name}-worker{slot}",
            daemon=self._daemon,
        )
        try:
            process.start()
        except BaseException:
            release_unheld(counters, delivered=False)  # (nobody loaded them)
            raise
        finally:
            task_r.close()
            result_w.close()
        handle = WorkerHandle(slot, f"pool worker {slot}", process, task_w, result_r, ledger)
        handle.cuda_held.extend(counters)
        return handle

    # ------------------------------------------------------------------ replacements

    def replace_later(self, slot: int, predecessor: Optional[WorkerHandle] = None) -> None:
        """Queue a worker for ``slot`` (after ``predecessor`` has ended, if given)."""
        self._queue.append((slot, predecessor))

    def pending(self) -> bool:
        return bool(self._queue)

    def take_queue(self) -> List[Tuple[int, Optional[WorkerHandle]]]:
        queue, self._queue = self._queue, []
        return queue

    def adopted_replacement(self) -> None:
        self.replaced += 1

    # ------------------------------------------------------------------ what workers say

    def on_ready(self, w: WorkerHandle) -> None:
        w.mark_ready()
        self._strikes[w.slot] = 0

    def on_init_failed(self, payload: bytes) -> None:
        if self._init_failure is None:
            self._init_failure = payload

    def after_death(self, w: WorkerHandle, life: Life, exitcode: Optional[int], running: bool, work_left: bool) -> None:
        """Decide about a buried worker's slot (not called while terminating or broken).

        Args:
            w: The buried worker.
            life: Its life when it died.
            exitcode: Its exit code (negative: the signal).
            running: The pool still accepts work.
            work_left: Tasks are queued, held or still to be fed.
        """
        if not w.started_up and life is not Life.EXITING:
            if self._init_failure is not None:
                return  # the pool breaks, with the initializer's error
            if exitcode == _mainguard.EXIT_CODE:  # (a replacement would do the same again)
                self._fatal = WorkerLostError(w.name, w.pid, exitcode, _mainguard.EXPLANATION)
                return
            self._strikes[w.slot] += 1
            if self._strikes[w.slot] >= STARTUP_RETRIES:
                self._fatal = WorkerLostError(w.name, w.pid, exitcode, "while starting, for the third time in a row")
                return
        if life is Life.RETIRING:
            return  # retired: its replacement was queued when it got STOP
        if running or work_left:
            self.replace_later(w.slot)

    def error(self) -> Optional[BaseException]:
        """Why no worker can run (the pool must break), or None."""
        if self._fatal is not None:
            return self._fatal
        payload = self._init_failure
        if payload is None:
            return None
        try:
            return self._codec.loads(payload)
        except Exception as exc:
            return exc
