"""What pool calls return: :class:`AsyncResult`, :class:`MapResult`, :class:`IMapIterator`.

A pool's engine settles results through three methods, whatever the transport:

* ``_done(start, count, value)``: positions ``start .. start+count-1`` succeeded (``value``
  is the call's result for ``apply_async``, the list of ``count`` results for a chunk);
* ``_failed(start, count, exc)``: those positions raised ``exc``;
* ``_partial(start, values, errors)``: a chunk where the positions in ``errors`` (offset
  within the chunk -> exception) raised and the others produced ``values``.

``_abort(exc)`` ends a result for good (pool terminated or broken); the first settlement
wins and later ones are ignored, so a task finishing after ``terminate()`` changes nothing.
Callbacks run before :meth:`AsyncResult.get` returns, in the thread that settles (the
process pool's manager thread; one at a time in a thread pool), like the standard pool.
A callback that raises does not break the pool: its exception goes to
``sys.unraisablehook`` (printed, or reported by pytest).
"""

from __future__ import annotations

import sys
import threading
import time
import types
from _thread import allocate_lock
from collections import deque
from typing import Any, Callable, Dict, Generator, List, Optional, Protocol

from .. import _checks
from .._awaiting import loop_waker
from ._errors import PoolTimeoutError

__all__ = ["AsyncResult", "MapResult", "IMapIterator", "IMapUnorderedIterator", "ApplyResult", "Job"]

_PENDING, _SETTLING, _DONE = 0, 1, 2

# Guards only the PENDING -> SETTLING step of every result: one tiny critical section per
# settlement, so results need no lock of their own.
_settle_guard = allocate_lock()


def check_timeout(timeout: Any) -> Optional[float]:
    """Validate a ``timeout`` argument (None or a finite number of seconds >= 0)."""
    return _checks.seconds_or_none("timeout", timeout, allow_zero=True)


def report_callback_error(callback: Any, exc: BaseException) -> None:
    """Hand a callback's exception to ``sys.unraisablehook``: it must neither vanish nor
    stop the thread that delivers results."""
    sys.unraisablehook(
        types.SimpleNamespace(
            exc_type=type(exc),
            exc_value=exc,
            exc_traceback=exc.__traceback__,
            err_msg="Exception ignored in a pool result callback",
            object=callback,
        )
    )


class Job(Protocol):
    """What an engine settles: every result class here (see the module docstring)."""

    def _done(self, start: int, count: int, value: Any) -> None: ...

    def _failed(self, start: int, count: int, exc: BaseException) -> None: ...

    def _partial(self, start: int, values: List[Any], errors: Dict[int, BaseException]) -> None: ...

    def _abort(self, exc: BaseException) -> None: ...

    def _is_done(self) -> bool: ...


def _first_error(errors: Dict[int, BaseException]) -> BaseException:
    return errors[min(errors)]


class AsyncResult:
    """The pending result of :meth:`Pool.apply_async` (and base of :class:`MapResult`).

    The standard ``multiprocessing.pool.AsyncResult`` interface: :meth:`get`,
    :meth:`wait`, :meth:`ready`, :meth:`successful`; and a coroutine may ``await`` it
    (the event loop runs on meanwhile; it gives what :meth:`get` gives).
    """

    __slots__ = ("_pool", "_callback", "_error_callback", "_state", "_success", "_value", "_event", "_wakers",
                 "__weakref__")

    def __init__(
        self,
        pool: Any,
        callback: Optional[Callable[[Any], Any]] = None,
        error_callback: Optional[Callable[[BaseException], Any]] = None,
    ) -> None:
        # The pool stays alive while a result is pending (as in the standard pool), so
        # `Pool(2).apply_async(f).get()` works; the reference is dropped once settled.
        self._pool = pool
        self._callback = callback
        self._error_callback = error_callback
        self._state = _PENDING
        self._success = False
        self._value: Any = None
        # A raw lock held until the result is settled: the cheapest one-shot event.
        self._event = allocate_lock()
        self._event.acquire()
        # Awaiting coroutines' wake-ups, run once settled; None once run (under _settle_guard).
        self._wakers: Optional[List[Callable[[Any], None]]] = []

    def ready(self) -> bool:
        """Whether the result has arrived (successfully or not)."""
        return self._state == _DONE

    def successful(self) -> bool:
        """Whether the call returned without raising.

        Raises:
            ValueError: the result is not ready yet.
        """
        if self._state != _DONE:
            raise ValueError(f"{self!r} is not ready; call successful() after ready() is True")
        return self._success

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until the result is ready or ``timeout`` seconds have passed.

        Args:
            timeout: Seconds to wait; None waits until the result is ready.

        Raises:
            RuntimeError: called from the pool's own result thread (inside a callback)
                for a result that thread would have to deliver: it would never come.
        """
        timeout = check_timeout(timeout)
        if self._state == _DONE:
            return
        pool = self._pool
        if pool is not None and pool._delivers_in_this_thread():
            raise RuntimeError(
                "waiting for a pool result inside one of the pool's callbacks would deadlock: "
                "the callback runs in the thread that delivers results"
            )
        if self._event.acquire(True, -1 if timeout is None else timeout):
            self._event.release()  # let every other waiter through as well

    def get(self, timeout: Optional[float] = None) -> Any:
        """Return the result, or raise the exception the call raised.

        Args:
            timeout: Seconds to wait; None waits until the result is ready.

        Raises:
            PoolTimeoutError: not ready within ``timeout`` (it is a
                ``multiprocessing.TimeoutError`` and a ``TimeoutError``).
            Exception: whatever the call raised (original type, remote traceback as
                ``__cause__``), or :class:`~machinlike.exception.WorkerLostError` if its
                worker died, :class:`PoolTerminatedError`, :class:`BrokenPoolError`.
        """
        self.wait(timeout)
        if self._state != _DONE:
            raise PoolTimeoutError(f"the result was not ready within {timeout:g} s")
        if self._success:
            return self._value
        raise self._value

    def __await__(self) -> Generator[Any, None, Any]:
        """``await result`` in a coroutine: the event loop runs on until the result is
        settled; gives the value or raises as :meth:`get` does.

        Raises:
            RuntimeError: no event loop runs in this thread.
        """
        waiter, wake = loop_waker()
        with _settle_guard:
            pending = self._wakers is not None
            if pending:
                self._wakers.append(wake)  # type: ignore[union-attr]
        if pending:
            yield from waiter.__await__()
        return self.get()

    def __repr__(self) -> str:
        state = {_PENDING: "pending", _SETTLING: "pending", _DONE: "ready"}[self._state]
        return f"<{type(self).__name__} {state}>"

    def __reduce__(self) -> Any:
        raise TypeError(f"{type(self).__name__} objects cannot be pickled: they belong to the pool's process")

    # ------------------------------------------------------------------ engine side

    def _settle(self, success: bool, value: Any) -> bool:
        with _settle_guard:
            if self._state != _PENDING:
                return False
            self._state = _SETTLING
        self._success, self._value = success, value
        callback = self._callback if success else self._error_callback
        self._callback = self._error_callback = None
        if callback is not None:
            try:
                callback(value)
            except BaseException as exc:
                report_callback_error(callback, exc)
        self._state = _DONE
        self._pool = None
        self._event.release()
        with _settle_guard:
            wakers, self._wakers = self._wakers, None
        for wake in wakers or ():
            wake(None)
        return True

    def _is_done(self) -> bool:
        return self._state != _PENDING

    def _done(self, start: int, count: int, value: Any) -> None:
        self._settle(True, value)

    def _failed(self, start: int, count: int, exc: BaseException) -> None:
        self._settle(False, exc)

    def _partial(self, start: int, values: List[Any], errors: Dict[int, BaseException]) -> None:
        self._settle(False, _first_error(errors))

    def _abort(self, exc: BaseException) -> None:
        self._settle(False, exc)


#: The standard library's name for the result of ``apply_async``.
ApplyResult = AsyncResult


class MapResult(AsyncResult):
    """The pending result of :meth:`Pool.map_async`: a list, in input order.

    It fails as soon as any item fails, with the exception of the first failing item to
    arrive (as the standard pool does); chunks still queued are then dropped.
    """

    __slots__ = ("_items", "_remaining", "_lock")

    def __init__(
        self,
        pool: Any,
        length: int,
        callback: Optional[Callable[[Any], Any]] = None,
        error_callback: Optional[Callable[[BaseException], Any]] = None,
    ) -> None:
        super().__init__(pool, callback, error_callback)
        self._items: List[Any] = [None] * length
        self._remaining = length
        self._lock = allocate_lock()
        if length == 0:
            self._settle(True, self._items)

    def _done(self, start: int, count: int, value: Any) -> None:
        with self._lock:
            if self._state != _PENDING:
                return
            self._items[start:start + count] = value
            self._remaining -= count
            finished = self._remaining == 0
        if finished:
            self._settle(True, self._items)


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
        self._feed: Any = None  # set by the pool; told about every consumed item
        self._init_store()

    def _init_store(self) -> None:
        self._items: Dict[int, tuple] = {}
        self._next = 0

    def __iter__(self) -> "IMapIterator":
        return self

    def __next__(self) -> Any:
        return self.next()

    def next(self, timeout: Optional[float] = None) -> Any:
        """The next result.

        Args:
            timeout: Seconds to wait for it; None waits as long as it takes.

        Raises:
            StopIteration: every result has been returned.
            PoolTimeoutError: the next result did not arrive within ``timeout``.
            Exception: the item's own exception, or the pool's (terminated, broken).
        """
        timeout = check_timeout(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while True:
                entry = self._take()
                if entry is not None:
                    break
                if self._length is not None and self._consumed() >= self._length:
                    self._pool = None  # exhausted: no longer keeps the pool alive
                    raise StopIteration
                if self._abort_error is not None:
                    raise self._abort_error
                pool = self._pool
                if pool is not None and pool._delivers_in_this_thread():
                    raise RuntimeError("iterating over a pool's imap inside one of its callbacks would deadlock")
                if deadline is None:
                    self._cond.wait()
                else:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or not self._cond.wait(remaining):
                        if self._take_peek():
                            continue
                        raise PoolTimeoutError(f"the next result did not arrive within {timeout:g} s")
        feed = self._feed
        if feed is not None:
            feed.consumed_one()
        ok, value = entry
        if ok:
            return value
        raise value

    def __repr__(self) -> str:
        return f"<{type(self).__name__} consumed={self._consumed()} length={self._length}>"

    def __reduce__(self) -> Any:
        raise TypeError(f"{type(self).__name__} objects cannot be pickled: they belong to the pool's process")

    # ------------------------------------------------------------------ ordering policy

    def _take(self) -> Optional[tuple]:
        entry = self._items.pop(self._next, None)
        if entry is not None:
            self._next += 1
        return entry

    def _take_peek(self) -> bool:
        return self._next in self._items

    def _consumed(self) -> int:
        return self._next

    def _store(self, position: int, entry: tuple) -> None:
        self._items[position] = entry

    # ------------------------------------------------------------------ engine side

    def _is_done(self) -> bool:
        return self._abort_error is not None

    def _done(self, start: int, count: int, value: Any) -> None:
        with self._cond:
            for offset, item in enumerate(value):
                self._store(start + offset, (True, item))
            self._cond.notify_all()

    def _failed(self, start: int, count: int, exc: BaseException) -> None:
        with self._cond:
            for position in range(start, start + count):
                self._store(position, (False, exc))
            self._cond.notify_all()

    def _partial(self, start: int, values: List[Any], errors: Dict[int, BaseException]) -> None:
        with self._cond:
            for offset, item in enumerate(values):
                error = errors.get(offset)
                self._store(start + offset, (True, item) if error is None else (False, error))
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

    def _init_store(self) -> None:
        self._ready: deque = deque()
        self._yielded = 0

    def _take(self) -> Optional[tuple]:
        if not self._ready:
            return None
        self._yielded += 1
        return self._ready.popleft()

    def _take_peek(self) -> bool:
        return bool(self._ready)

    def _consumed(self) -> int:
        return self._yielded

    def _store(self, position: int, entry: tuple) -> None:
        self._ready.append(entry)

