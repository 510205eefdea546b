"""What ``imap`` and ``imap_unordered`` return: iterators over results as they arrive.

    engine thread ── _done / _failed / _partial(start, ...) ──► settled: chunks by start
                                                                   │ (under the lock, a
                                                                   ▼  whole chunk a time)
    consumer ── next() ──► buffer.popleft() ◄──────────────── buffer: entries in order

Why two stages: the engine settles whole chunks, the consumer takes items one by one. A
lock and a condition per item cost about a microsecond, more than a small task itself
(``imap(f, range(100_000), chunksize=64)`` ran at a third of the standard pool's rate).
So the lock is taken once a chunk, to move it into the buffer, and the items are then
handed out by ``deque.popleft`` (atomic: any number of consumer threads may share an
iterator). The feed that pulls the input counts a chunk consumed when it is moved.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Tuple

from ._errors import PoolTimeoutError
from ._result import check_timeout

if TYPE_CHECKING:
    from ._feed import _Feed

__all__ = ["IMapIterator", "IMapUnorderedIterator"]

# One result: (True, value) or (False, exception).
_Entry = Tuple[bool, Any]


class IMapIterator:
    """The iterator :meth:`Pool.imap` returns: results in input order, as they arrive.

    :meth:`next` takes a timeout. The pool pulls items from the input lazily: it stays a
    bounded number of chunks ahead of what has been consumed here (until the pool is
    closed), so an endless generator works and an abandoned iterator stops the feeding.
    An item that failed raises its exception at its position; iteration may go on after
    it. An error of the input iterable itself is raised at the position where it
    happened and ends the iteration.
    """

    def __init__(self, pool: Any) -> None:
        self._pool = pool
        self._cond = threading.Condition(threading.Lock())
        self._length: Optional[int] = None
        self._abort_error: Optional[BaseException] = None
        self._feed: Optional["_Feed"] = None  # set by the pool; told about every chunk taken
        self._buffer: Deque[_Entry] = deque()  # taken from the settled chunks, not yet returned
        self._moved = 0  # items moved into the buffer so far
        self._init_settled()

    def _init_settled(self) -> None:
        self._settled: Dict[int, List[_Entry]] = {}  # chunk start -> its entries

    def __iter__(self) -> "IMapIterator":
        return self

    def __next__(self) -> Any:
        try:
            ok, value = self._buffer.popleft()
        except IndexError:
            ok, value = self._refill(None)
        if ok:
            return value
        raise value

    def next(self, timeout: Optional[float] = None) -> Any:
        """The next result.

        Args:
            timeout: Seconds to wait for it; None waits as long as it takes.

        Raises:
            StopIteration: every result has been returned.
            PoolTimeoutError: the next result did not arrive within ``timeout``.
            Exception: the item's own exception, or the pool's (terminated, broken).
        """
        if timeout is not None:
            timeout = check_timeout(timeout)
        try:
            ok, value = self._buffer.popleft()
        except IndexError:
            ok, value = self._refill(timeout)
        if ok:
            return value
        raise value

    def _refill(self, timeout: Optional[float]) -> _Entry:
        """The next entry once the buffer ran dry: waits for the next chunk to settle."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                try:
                    return self._buffer.popleft()  # another consumer may have refilled it
                except IndexError:
                    pass
                chunk = self._take_chunk()
                if chunk is not None:
                    self._moved += len(chunk)
                    feed = self._feed
                    if feed is not None:
                        feed.consumed_chunk(len(chunk))
                    self._buffer.extend(chunk)
                    continue
                if self._length is not None and self._moved >= self._length:
                    self._pool = None  # exhausted: no longer keeps the pool alive
                    raise StopIteration
                if self._abort_error is not None:
                    raise self._abort_error
                pool = self._pool
                if pool is not None and pool._delivers_in_this_thread():
                    raise RuntimeError("iterating over a pool's imap inside one of its callbacks would deadlock")
                if deadline is None:
                    self._cond.wait()
                    continue
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._cond.wait(remaining):
                    if self._has_chunk():
                        continue
                    raise PoolTimeoutError(f"the next result did not arrive within {timeout:g} s")

    def __repr__(self) -> str:
        return f"<{type(self).__name__} consumed={self._moved - len(self._buffer)} length={self._length}>"

    def __reduce__(self) -> Any:
        raise TypeError(f"{type(self).__name__} objects cannot be pickled: they belong to the pool's process")

    # ------------------------------------------------------------------ ordering policy

    def _take_chunk(self) -> Optional[List[_Entry]]:
        return self._settled.pop(self._moved, None)

    def _has_chunk(self) -> bool:
        return self._moved in self._settled

    def _settle_chunk(self, start: int, entries: List[_Entry]) -> None:
        self._settled[start] = entries

    # ------------------------------------------------------------------ engine side

    def _is_done(self) -> bool:
        return self._abort_error is not None

    def _done(self, start: int, count: int, value: Any) -> None:
        entries = [(True, item) for item in value]
        with self._cond:
            self._settle_chunk(start, entries)
            self._cond.notify_all()

    def _failed(self, start: int, count: int, exc: BaseException) -> None:
        with self._cond:
            self._settle_chunk(start, [(False, exc)] * count)
            self._cond.notify_all()

    def _partial(self, start: int, values: List[Any], errors: Dict[int, BaseException]) -> None:
        entries = [(True, item) if offset not in errors else (False, errors[offset]) for offset, item in enumerate(values)]
        with self._cond:
            self._settle_chunk(start, entries)
            self._cond.notify_all()

    def _set_length(self, length: int) -> None:
        with self._cond:
            self._length = length
            self._cond.notify_all()

    def _abort(self, exc: BaseException) -> None:
        with self._cond:
            if self._abort_error is None:
                self._abort_error = exc
            self._cond.notify_all()


class IMapUnorderedIterator(IMapIterator):
    """The iterator :meth:`Pool.imap_unordered` returns: results in completion order."""

    def _init_settled(self) -> None:
        self._arrived: Deque[List[_Entry]] = deque()

    def _take_chunk(self) -> Optional[List[_Entry]]:
        return self._arrived.popleft() if self._arrived else None

    def _has_chunk(self) -> bool:
        return bool(self._arrived)

    def _settle_chunk(self, start: int, entries: List[_Entry]) -> None:
        self._arrived.append(entries)
