"""What the manager thread polls, and why: descriptor -> (role, worker).

::

    wake-up fd        WAKE      (readable: a caller wants the manager)
    result pipe i     RESULT    (readable: frames from worker i; dropped at EOF)
    sentinel i        SENTINEL  (readable: worker i has ended)
    task pipe i       TASK      (writable; only while worker i has frames the pipe did not take)

The write interest follows each handle's ``want_write``; :meth:`Watch.sync_writes` makes
the poll set match before the manager sleeps, and :meth:`Watch.stale` tells a caller
whether the sleeping manager must be woken to do so.

Thread use: the poll set and the roles belong to the manager thread (and the
constructor, before it starts). The write set is also read by callers: it changes, and is
read, with the engine lock held.
"""

from __future__ import annotations

import select
from typing import Dict, Iterable, List, Optional, Set, Tuple

from ._handle import WorkerHandle

__all__ = ["Watch", "WAKE", "RESULT", "SENTINEL", "TASK"]

WAKE, RESULT, SENTINEL, TASK = range(4)


class Watch:
    """A ``select.poll`` set with a role per descriptor.

    Args:
        wake_fd: The wake-up pipe's reading end.
    """

    def __init__(self, wake_fd: int) -> None:
        self._poller = select.poll()
        self._roles: Dict[int, Tuple[int, Optional[WorkerHandle]]] = {}
        self._writing: Set[int] = set()  # task fds registered for POLLOUT (engine lock)
        self._poller.register(wake_fd, select.POLLIN)
        self._roles[wake_fd] = (WAKE, None)

    def add(self, w: WorkerHandle) -> None:
        """Watch a started worker's results and its end."""
        for fd, role in ((w.result_fd, RESULT), (w.sentinel, SENTINEL)):
            self._poller.register(fd, select.POLLIN)
            self._roles[fd] = (role, w)

    def forget(self, w: WorkerHandle) -> None:
        """Stop watching a worker that has ended (before its descriptors close)."""
        self._writing.discard(w.task_fd)
        for fd in (w.result_fd, w.sentinel, w.task_fd):
            self._drop(fd)

    def reading(self, w: WorkerHandle) -> bool:
        """Whether its result pipe is still watched (not at EOF yet)."""
        return w.result_fd in self._roles

    def end_of_results(self, w: WorkerHandle) -> None:
        self._drop(w.result_fd)

    def role(self, fd: int) -> Tuple[Optional[int], Optional[WorkerHandle]]:
        return self._roles.get(fd, (None, None))

    def stale(self, workers: Iterable[WorkerHandle]) -> bool:
        """Whether a worker's write interest differs from the poll set (engine lock held)."""
        writing = self._writing
        return any(w.want_write != (w.task_fd in writing) for w in workers)

    def sync_writes(self, workers: Iterable[WorkerHandle]) -> None:
        """Poll the task pipes of exactly the workers that want to write (engine lock held)."""
        writing = self._writing
        for w in workers:
            fd = w.task_fd
            if w.want_write == (fd in writing):
                continue
            if w.want_write:
                self._poller.register(fd, select.POLLOUT)
                self._roles[fd] = (TASK, w)
                writing.add(fd)
            else:
                self._drop(fd)
                writing.discard(fd)

    def poll(self) -> List[Tuple[int, int]]:
        """Sleep until a watched descriptor is ready; the (fd, events) pairs."""
        return self._poller.poll()

    def _drop(self, fd: int) -> None:
        if self._roles.pop(fd, None) is not None:
            try:
                self._poller.unregister(fd)
            except KeyError:
                pass
