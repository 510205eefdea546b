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

from typing import TYPE_CHECKING, Any, Iterable, List, Optional, Protocol, Set

from ._policy import Codec

if TYPE_CHECKING:
    from ._result import Job

__all__ = ["Function", "FunctionHolder", "Task", "discard", "fail_tasks"]


class FunctionHolder(Protocol):
    """A worker a function is installed on, as the function's record sees it (a
    ``WorkerHandle``; named through this protocol so that the records sit below it)."""

    def is_dead(self) -> bool: ...

    def drop(self, function: "Function") -> None: ...

    def flush(self) -> None: ...


class Function:
    """A map's function, pickled once, installed on the workers that run its chunks."""

    __slots__ = ("id", "data", "kept", "outstanding", "final", "holders")

    def __init__(self, function_id: int, data: bytes, kept: List[Any]) -> None:
        self.id = function_id
        self.data = data
        self.kept = kept  # shared storages named by `data`: alive until every load
        self.outstanding = 0
        self.final = False
        self.holders: Set[FunctionHolder] = set()

    def droppable(self) -> bool:
        """Final, and no chunk of it is queued or running."""
        return self.final and not self.outstanding


class Task:
    """One call or one map chunk of ``job``: positions ``start .. start+count-1``.

    ``seq`` is its number in the channel of the worker that holds it (-1: in the backlog).
    """

    __slots__ = ("job", "start", "count", "kind", "star", "function", "payload", "shares", "seq")

    def __init__(
        self, job: "Job", start: int, count: int, kind: int, star: int,
        function: Optional[Function], payload: bytes, shares: bool,
    ) -> None:
        self.job = job
        self.start = start
        self.count = count
        self.kind = kind
        self.star = star
        self.function = function
        self.payload = payload
        self.shares = shares  # the payload names shared storages (released by loading it)
        self.seq = -1


def discard(tasks: Iterable[Task], codec: Codec) -> None:
    """Release what undelivered payloads hold in shared memory (loading drops it)."""
    for task in tasks:
        if task.shares:
            try:
                codec.loads(task.payload)
            except Exception:  # best effort: the payload's owner is gone anyway
                pass
        task.payload = b""


def fail_tasks(tasks: List[Task], error: BaseException, codec: Codec) -> None:
    """End the jobs of ``tasks`` for good with ``error``, releasing their payloads."""
    jobs = {}
    for task in tasks:
        jobs[id(task.job)] = task.job
    discard(tasks, codec)
    for job in jobs.values():
        job._abort(error)
