"""The public surface every pool shares: the standard pool API over a pluggable engine.

An engine (``ProcessCore`` or ``ThreadCore``) offers ``call``, ``function`` + ``map``,
``feed_opened`` / ``feed_closed``, ``close``, ``terminate``, ``join``, ``check_running``
and ``state``; this class validates arguments, builds the result objects, splits maps
into chunks, and owns the lifetime (finalizer at garbage collection and interpreter
exit). The five public pools are configurations of it (see ``machinlike.pool``).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Mapping
from multiprocessing import util as _mp_util
from typing import Any, Callable, Iterable, List, Optional

from ._args import PoolPicklingError, as_args, check_callable
from ._engine import Engine
from ._feed import Feeder
from ._imap import IMapIterator, IMapUnorderedIterator
from ._result import AsyncResult, MapResult, check_timeout
from ._state import PoolState

__all__ = ["PoolBase"]

log = logging.getLogger(__name__)

# Before multiprocessing's own exit work (which joins non-daemon children, and would
# wait forever for the workers of a pool nobody closed).
_EXIT_PRIORITY = 15


def _check_chunksize(chunksize: Any, optional: bool) -> Optional[int]:
    if chunksize is None and optional:
        return None
    if isinstance(chunksize, bool) or not isinstance(chunksize, int):
        raise TypeError(f"chunksize must be {'None or ' if optional else ''}an int, not {type(chunksize).__name__}")
    if chunksize < 1:
        raise ValueError(f"chunksize must be >= 1, got {chunksize}")
    return chunksize


def _as_kwds(kwds: Any) -> Optional[dict]:
    if kwds is None:
        return None
    if not isinstance(kwds, Mapping):
        raise TypeError(f"kwds must be a mapping of keyword arguments or None, not {type(kwds).__name__}")
    return dict(kwds) if kwds else None


def _shut_down(backend: Engine, feeder: Feeder) -> None:
    feeder.stop()
    backend.terminate()


class PoolBase:
    """The standard pool API over an engine (base of every public pool)."""

    _backend: Engine
    _feeder: Feeder

    def _setup(self, backend: Engine) -> None:
        # A child forked (os.fork) from this process shares the workers' pipes and lacks
        # the pool's threads: it may neither submit nor end the pool (see _forked).
        self._pid = os.getpid()
        self._backend = backend
        self._feeder = Feeder(backend, backend.name)
        # Garbage collection of the pool, or interpreter exit, terminates it. The
        # finalizer holds the engine, never the pool (which it must let die).
        self._finalizer = _mp_util.Finalize(self, _shut_down, args=(backend, self._feeder), exitpriority=_EXIT_PRIORITY)

    # ------------------------------------------------------------------ single calls

    def apply(self, func: Callable[..., Any], args: Iterable[Any] = (), kwds: Optional[Mapping] = None) -> Any:
        """Run ``func(*args, **kwds)`` in a worker and return its result.

        Waits as long as the call takes; use :meth:`apply_async` and
        ``get(timeout)`` to bound the wait.

        Args:
            func: Any callable, including lambdas, local functions and closures.
            args: Positional arguments (a tuple).
            kwds: Keyword arguments, or None for none.

        Returns:
            What ``func`` returned (a copy, or a shared tensor, under the tensor policy).

        Raises:
            Exception: what the call raised (see :meth:`AsyncResult.get`), including
                :class:`~machinlike.exception.WorkerLostError` if its worker died.
            TypeError: a bad argument type (``args`` not a tuple, ``func`` not callable).
            ValueError: the pool is not running (closed or terminated).
            BrokenPoolError: the pool is broken.
        """
        return self.apply_async(func, args, kwds).get()

    def apply_async(
        self,
        func: Callable[..., Any],
        args: Iterable[Any] = (),
        kwds: Optional[Mapping] = None,
        callback: Optional[Callable[[Any], Any]] = None,
        error_callback: Optional[Callable[[BaseException], Any]] = None,
    ) -> AsyncResult:
        """Start ``func(*args, **kwds)`` in a worker.

        Args:
            func: Any callable, including lambdas, local functions and closures.
            args: Positional arguments (a tuple).
            kwds: Keyword arguments, or None for none.
            callback: Called with the result when it arrives, in the thread that
                delivers results; None for no callback.
            error_callback: Called with the exception if the call fails (raised by
                the call, worker lost, pool terminated or broken); None for none.

        Returns:
            The pending result.

        Raises:
            TypeError: a bad argument type (``args`` not a tuple, ``func`` not callable).
            ValueError: the pool is not running (closed or terminated).
            BrokenPoolError: the pool is broken.
        """
        check_callable(func, "func")
        args = as_args(args, "args")
        kwds = _as_kwds(kwds)
        check_callable(callback, "callback", optional=True)
        check_callable(error_callback, "error_callback", optional=True)
        self._refuse_if_forked()
        backend = self._backend
        backend.check_running()
        result = AsyncResult(self, callback, error_callback)
        backend.call(result, func, args, kwds)
        return result

    # ------------------------------------------------------------------ maps

    def map(self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: Optional[int] = None) -> List[Any]:
        """``[func(x) for x in iterable]``, computed by the workers, in input order.

        Args:
            func: Applied to each item. Pickled once for the whole map.
            iterable: The items (consumed at once, as by the standard pool).
            chunksize: Items per task (>= 1); None picks about four tasks per worker.

        Returns:
            The results, one per item.

        Raises:
            Exception: the first failing item's exception (its original type, the
                worker's traceback as ``__cause__``), or
                :class:`~machinlike.exception.WorkerLostError` for an item whose worker
                died.
            TypeError: ``func`` is not callable, ``iterable`` not iterable, or
                ``chunksize`` not an int.
            ValueError: ``chunksize`` < 1, or the pool is not running.
            BrokenPoolError: the pool is broken.
        """
        return self._map_async(func, iterable, chunksize, None, None, False).get()

    def map_async(
        self,
        func: Callable[[Any], Any],
        iterable: Iterable[Any],
        chunksize: Optional[int] = None,
        callback: Optional[Callable[[Any], Any]] = None,
        error_callback: Optional[Callable[[BaseException], Any]] = None,
    ) -> MapResult:
        """Asynchronous :meth:`map`.

        Args:
            func: Applied to each item. Pickled once for the whole map.
            iterable: The items (consumed at once).
            chunksize: Items per task (>= 1); None picks about four tasks per worker.
            callback: Called with the list of results when all have arrived; None for
                no callback.
            error_callback: Called with the first failing item's exception; None for
                no callback.

        Returns:
            The pending list of results, in input order.

        Raises:
            TypeError, ValueError: as for :meth:`map` (the items' own errors are
                raised by ``get()``).
            BrokenPoolError: the pool is broken.
        """
        return self._map_async(func, iterable, chunksize, callback, error_callback, False)

    def starmap(self, func: Callable[..., Any], iterable: Iterable[Iterable[Any]], chunksize: Optional[int] = None) -> List[Any]:
        """Like :meth:`map`, calling ``func(*item)``.

        Args:
            func: Called as ``func(*item)`` for each item.
            iterable: Argument tuples (consumed at once).
            chunksize: Items per task (>= 1); None picks about four tasks per worker.

        Returns:
            The results, one per item, in input order.

        Raises:
            Exception: as for :meth:`map`.
        """
        return self._map_async(func, iterable, chunksize, None, None, True).get()

    def starmap_async(
        self,
        func: Callable[..., Any],
        iterable: Iterable[Iterable[Any]],
        chunksize: Optional[int] = None,
        callback: Optional[Callable[[Any], Any]] = None,
        error_callback: Optional[Callable[[BaseException], Any]] = None,
    ) -> MapResult:
        """Asynchronous :meth:`starmap`.

        Args:
            func: Called as ``func(*item)`` for each item.
            iterable: Argument tuples (consumed at once).
            chunksize: Items per task (>= 1); None picks about four tasks per worker.
            callback: Called with the list of results; None for no callback.
            error_callback: Called with the first failing item's exception; None for
                no callback.

        Returns:
            The pending list of results, in input order.

        Raises:
            TypeError, ValueError: as for :meth:`map`.
            BrokenPoolError: the pool is broken.
        """
        return self._map_async(func, iterable, chunksize, callback, error_callback, True)

    def imap(self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int = 1) -> IMapIterator:
        """A lazy :meth:`map`: results in input order as they come, input pulled as needed.

        The pool reads ``iterable`` in a background thread, keeping a bounded number of
        chunks ahead of what has been consumed (for any ``chunksize``), so it may be
        endless; dropping the iterator stops the reading and closes a generator input.
        The bound, in items: ``chunksize`` times the larger of ``processes * 33`` for a
        process pool (``processes * 2`` for a thread pool) and ``256 / chunksize``
        rounded up. Items that are large each: pick ``chunksize`` with that in mind.

        Args:
            func: Applied to each item. Pickled once for the whole call.
            iterable: The items, pulled as needed.
            chunksize: Items per task (>= 1).

        Returns:
            An iterator over the results; its ``next(timeout)`` bounds each wait.

        Raises:
            TypeError: ``func`` is not callable, ``iterable`` not iterable, or
                ``chunksize`` not an int.
            ValueError: ``chunksize`` < 1, or the pool is not running.
        """
        return self._imap(IMapIterator, func, iterable, chunksize)

    def imap_unordered(self, func: Callable[[Any], Any], iterable: Iterable[Any], chunksize: int = 1) -> IMapUnorderedIterator:
        """Like :meth:`imap`, with results in completion order.

        Args:
            func: Applied to each item. Pickled once for the whole call.
            iterable: The items, pulled as needed.
            chunksize: Items per task (>= 1).

        Returns:
            An iterator over the results as they complete.

        Raises:
            TypeError, ValueError: as for :meth:`imap`.
        """
        return self._imap(IMapUnorderedIterator, func, iterable, chunksize)  # type: ignore[return-value]

    def _map_async(
        self, func: Any, iterable: Any, chunksize: Any, callback: Any, error_callback: Any, star: bool
    ) -> MapResult:
        check_callable(func, "func")
        chunksize = _check_chunksize(chunksize, optional=True)
        check_callable(callback, "callback", optional=True)
        check_callable(error_callback, "error_callback", optional=True)
        self._refuse_if_forked()
        backend = self._backend
        backend.check_running()
        try:
            items = list(iterable)
        except TypeError:
            if not isinstance(iterable, Iterable):
                raise TypeError(f"iterable must be iterable, not {type(iterable).__name__}") from None
            raise
        if chunksize is None:
            chunksize, extra = divmod(len(items), backend.processes * 4)
            chunksize += 1 if extra or not chunksize else 0
        result = MapResult(self, len(items), callback, error_callback)
        if items:
            try:
                handle = backend.function(func)
            except Exception as exc:
                result._failed(0, len(items), exc)
                return result
            chunks = [(start, items[start:start + chunksize]) for start in range(0, len(items), chunksize)]
            backend.map(result, handle, star, chunks, True)
        return result

    def _imap(self, cls: type, func: Any, iterable: Any, chunksize: Any) -> IMapIterator:
        check_callable(func, "func")
        chunksize = _check_chunksize(chunksize, optional=False)
        self._refuse_if_forked()
        self._backend.check_running()
        try:
            source = iter(iterable)
        except TypeError:
            raise TypeError(f"iterable must be iterable, not {type(iterable).__name__}") from None
        result = cls(self)
        self._feeder.start(result, func, source, chunksize, False)
        return result

    # ------------------------------------------------------------------ lifetime

    def size(self) -> int:
        """Number of workers (processes or threads); replacements keep it constant."""
        return self._backend.processes

    def close(self) -> None:
        """Accept no new work; workers exit once everything submitted has finished.

        Submitting afterwards raises ``ValueError``. Follow with :meth:`join` to wait.
        """
        if self._forked("close"):
            return
        self._backend.close()
        self._feeder.unbound()

    def terminate(self) -> None:
        """Stop now: pending results fail with PoolTerminatedError, workers are ended.

        Idempotent. Process workers get SIGTERM, then SIGKILL after a grace period
        (1 s). Threads cannot be killed: a thread pool's running task finishes in the
        background and its result is dropped. Leaving a ``with`` block calls this.
        """
        if self._forked("terminate"):
            return
        self._feeder.stop()
        self._backend.terminate()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the workers to exit, after :meth:`close` or :meth:`terminate`.

        Args:
            timeout: Seconds to wait; None waits as long as the remaining work takes.

        Raises:
            ValueError: the pool is still running (call close() or terminate() first).
            TimeoutError: work or workers remain after ``timeout`` seconds.
        """
        timeout = check_timeout(timeout)
        if self._forked("join"):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        self._backend.join(timeout)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        if not self._feeder.join(remaining):
            raise TimeoutError(f"the pool's input feeder is still reading an imap input after {timeout:g} s")

    def _forked(self, what: str) -> bool:
        """Whether this is a child forked from the pool's process (then ``what`` does
        nothing, and says so: ending the pool from here would end its creator's workers)."""
        if os.getpid() == self._pid:
            return False
        log.warning("%r belongs to process %d; %s() in process %d, forked from it, does nothing (end a forked "
                    "child with os._exit, or start it with the 'spawn' method)", self, self._pid, what, os.getpid())
        return True

    def _refuse_if_forked(self) -> None:
        if os.getpid() != self._pid:
            raise RuntimeError(
                f"{self!r} belongs to process {self._pid}: process {os.getpid()}, forked (os.fork) from it, cannot "
                f"submit to it (its workers' pipes are the parent's, and its threads did not cross the fork); "
                f"create a pool in the child, or start the child with 'spawn'")

    def __enter__(self) -> "PoolBase":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.terminate()  # what the standard pool does

    def __reduce_ex__(self, protocol: Any) -> Any:
        raise PoolPicklingError(
            f"{type(self).__name__} objects cannot be passed between processes or pickled: a pool "
            f"belongs to the process that created it (create a pool inside the worker instead)"
        )

    def __repr__(self) -> str:
        return f"<{type(self).__name__} state={self._backend.state} processes={self._backend.processes}>"

    def __del__(self) -> None:
        try:
            if self._backend.state is PoolState.RUN:
                warnings.warn(f"unclosed running pool {self!r}; it is terminated now", ResourceWarning, source=self)
        except Exception:  # interpreter shutdown, or a constructor that failed early
            pass

    def _delivers_in_this_thread(self) -> bool:
        return self._backend.delivers_in_this_thread()

