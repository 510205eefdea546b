"""What the process engine moves around: tasks, and the map functions they share.

A :class:`Task` is one call, or one chunk of a map, already pickled in the caller's thread.
A map's function is pickled once (:class:`Function`) and *installed* on each worker that
runs one of its chunks; once the map is final and every chunk has settled, the pool sends
the workers that hold it a DROP frame::

    Function.outstanding  chunks queued or running      (+ at submit, - at settle)
    Function.final        no more chunks will come
    Function.holders      workers it is installed on    -> DROP when final and 0 outstanding

These records carry no lock: the engine changes them with its lock held.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Optional, Protocol, Set, Tuple

from ._cuda_shares import CudaCounter, pickled_counters, release_unheld
from ._policy import Codec

if TYPE_CHECKING:
    from ._result import Job

__all__ = ["Function", "FunctionHolder", "Task", "abort_jobs", "discard", "fail_tasks", "fail_unsent", "release_cuda"]


class FunctionHolder(Protocol):
    """A worker a function is installed on, as the function's record sees it (a
    ``WorkerHandle``; named through this protocol so that the records sit below it)."""

    def is_dead(self) -> bool: ...

    def drop(self, function: "Function") -> None: ...

    def flush(self) -> None: ...


class Function:
    """A map's function, pickled once, installed on the workers that run its chunks.

    Args:
        function_id: Its id in the workers' frames.
        data: Its pickle, which every install sends; unused with ``encode``.
        kept: Shared storages ``data`` names: alive until every load.
        encode: Pickles it again for each install (None: ``data`` for all): for a function
            holding CUDA tensors, whose references stand for one receiver each (see
            ``_cuda_shares``). Returns the pickle and what it tracked.
    """

    __slots__ = ("id", "data", "kept", "encode", "first", "installs", "outstanding", "final", "holders")

    def __init__(
        self, function_id: int, data: bytes, kept: List[Any],
        encode: Optional[Callable[[], Tuple[bytes, List[Any]]]] = None, counters: Tuple[CudaCounter, ...] = (),
    ) -> None:
        self.id = function_id
        self.data = data
        self.kept = kept
        self.encode = encode
        # With encode: the first pickle (``data``, ``counters``) goes to the first install;
        # each install's record says whether a task of it ran there (so it was loaded).
        self.first: Optional[Tuple[bytes, Tuple[CudaCounter, ...]]] = (data, counters) if encode else None
        self.installs: Dict[FunctionHolder, _Install] = {}
        self.outstanding = 0
        self.final = False
        self.holders: Set[FunctionHolder] = set()

    def droppable(self) -> bool:
        """Final, and no chunk of it is queued or running."""
        return self.final and not self.outstanding

    def install_payload(self, holder: FunctionHolder) -> Tuple[bytes, Tuple[CudaCounter, ...]]:
        """The pickle an install on ``holder`` sends, and the CUDA references it hands it.

        Raises:
            pickle.PicklingError, TypeError, OSError: pickling it again failed.
        """
        if self.encode is None:
            return self.data, ()
        if self.first is not None:
            (data, counters), self.first = self.first, None
        else:
            data, kept = self.encode()
            kept, counters = pickled_counters(kept)
            self.kept.extend(kept)
        self.installs[holder] = _Install(data, counters)
        return data, counters

    def ran_on(self, holder: FunctionHolder) -> None:
        """A task of it ran on ``holder`` (which therefore may have loaded it)."""
        if self.encode is not None:
            install = self.installs.get(holder)
            if install is not None:
                install.loaded = True

    def release_unloaded(self, codec: Codec) -> None:
        """(it is dropped) Give back what installs no task ever ran on hold, on live
        workers (a dead one's were given back at its death): a worker loads a function
        only for a task of it, and a DROP discards the bytes unread."""
        if self.encode is None:
            return
        unloaded = [install for holder, install in self.installs.items()
                    if not install.loaded and not holder.is_dead()]
        if self.first is not None:  # never installed anywhere
            unloaded.append(_Install(*self.first))
            self.first = None
        self.installs = {}
        for install in unloaded:
            try:
                codec.loads_here(install.data)  # (gives back its CPU shares)
            except Exception:  # best effort, as for a discarded task
                pass
            release_unheld(install.counters, delivered=False)  # (sent, then dropped unread)


class _Install:
    """One install of a function pickled per worker: its pickle and references."""

    __slots__ = ("data", "counters", "loaded")

    def __init__(self, data: bytes, counters: Tuple[CudaCounter, ...]) -> None:
        self.data = data
        self.counters = counters
        self.loaded = False


class Task:
    """One call or one map chunk of ``job``: positions ``start .. start+count-1``.

    ``seq`` is its number in the channel of the worker that holds it (-1: in the backlog).
    """

    __slots__ = ("job", "start", "count", "kind", "star", "function", "payload", "shares", "cuda", "seq")

    def __init__(
        self, job: "Job", start: int, count: int, kind: int, star: int,
        function: Optional[Function], payload: bytes, shares: bool, cuda: Tuple[CudaCounter, ...] = (),
    ) -> None:
        self.job = job
        self.start = start
        self.count = count
        self.kind = kind
        self.star = star
        self.function = function
        self.payload = payload
        self.shares = shares  # the payload names shared storages (released by loading it)
        self.cuda = cuda  # CUDA IPC references it hands its receiver (see _cuda_shares)
        self.seq = -1


def discard(tasks: Iterable[Task], codec: Codec, cuda: bool = True) -> None:
    """Release what undelivered payloads hold in shared memory (loading drops it).

    Args:
        tasks: The tasks.
        codec: Their pool's codec.
        cuda: Also give back their CUDA references still counted: only when no live
            worker can hold them (else :func:`release_cuda` once the workers ended).
    """
    tasks = list(tasks)
    for task in tasks:
        if task.shares:
            try:
                codec.loads_here(task.payload)
            except Exception:  # best effort: the payload's owner is gone anyway
                pass
        task.payload = b""
    if cuda:
        release_cuda(tasks, delivered=False)


def release_cuda(tasks: Iterable[Task], delivered: bool = True) -> None:
    """Give back the CUDA references of ``tasks`` that no receiver did (every worker that
    may have loaded them has ended; ``delivered``: as for ``release_unheld``)."""
    counters: List[CudaCounter] = []
    for task in tasks:
        if task.cuda:
            counters.extend(task.cuda)
            task.cuda = ()
    if counters:
        release_unheld(counters, delivered=delivered)


def fail_unsent(unsent: List[Tuple[Task, BaseException]], codec: Codec) -> None:
    """Fail each task whose sending failed with its error (no lock held: callbacks run)."""
    for task, error in unsent:
        discard([task], codec)
        task.job._failed(task.start, task.count, error)


def abort_jobs(tasks: Iterable[Task], error: BaseException) -> None:
    """End the jobs of ``tasks`` for good with ``error``."""
    jobs = {}
    for task in tasks:
        jobs[id(task.job)] = task.job
    for job in jobs.values():
        job._abort(error)


def fail_tasks(tasks: List[Task], error: BaseException, codec: Codec, cuda: bool = True) -> None:
    """End the jobs of ``tasks`` for good with ``error``, releasing their payloads
    (``cuda``: as for :func:`discard`)."""
    discard(tasks, codec, cuda)
    abort_jobs(tasks, error)
