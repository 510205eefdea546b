"""What ``apply_async`` and ``map_async`` return: :class:`AsyncResult`, :class:`MapResult`
(``imap``'s iterators: ``_imap.py``).

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
import traceback
import types
from _thread import allocate_lock
from typing import Any, Callable, Dict, Generator, List, Optional, Protocol

from .. import _checks
from .._awaiting import loop_waker
from ._errors import PoolTimeoutError

__all__ = ["AsyncResult", "MapResult", "ApplyResult", "Job"]

_PENDING, _SETTLING, _DONE = 0, 1, 2

# Guards only the PENDING -> SETTLING step of every result: one tiny critical section per
# settlement, so results need no lock of their own.
_settle_guard = allocate_lock()


def check_timeout(timeout: Any) -> Optional[float]:
    """Validate a ``timeout`` argument (None or a finite number of seconds >= 0)."""
    return _checks.seconds_or_none("timeout", timeout, allow_zero=True)


def report_callback_error(callback: Any, exc: BaseException) -> None:
    """Hand a callback's exception to ``sys.unraisablehook``: it must neither vanish nor
    stop the thread that delivers results. Never raises.

    Why not always the hook: Python's own (``sys.__unraisablehook__``) takes only its
    ``UnraisableHookArgs``, which Python code cannot build, and raised TypeError on our
    record: that escaped into the settlement, so the result never became ready (a
    ``get()`` without timeout waited for good) and a thread pool's worker died. Python's
    hook is then done here, in its format; a hook someone installed (pytest's, a
    logger's) gets the record.
    """
    what = "Exception ignored in a pool result callback"
    try:
        if sys.unraisablehook is not sys.__unraisablehook__:
            sys.unraisablehook(types.SimpleNamespace(exc_type=type(exc), exc_value=exc,
                                                     exc_traceback=exc.__traceback__, err_msg=what, object=callback))
            return
    except BaseException:  # (a hook that fails: printed below, as Python prints it)
        pass
    try:
        text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        sys.stderr.write(f"{what}: {callback!r}\n{text}")
    except BaseException:  # (no stderr left: nothing more can be said)
        pass


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
