"""RpcFuture: the pending result of an asynchronous call, settled as a synchronous one is.

An RpcFuture is a ``torch.futures.Future``, so what torch RPC users write works on it:
``then()`` (whose callback's exception keeps its type), ``value()``,
``add_done_callback(fn)``, ``torch.futures.wait_all`` and ``collect_all``, and returning
one (or its ``then``) from an ``@async_execution`` service. A coroutine may ``await`` it:
the event loop runs on while the call is pending. It is completed
with what ``wait()`` is to give, once, by whoever carried the call::

    the lane (same host): completes this very future      ┐
      (call_async(into=it): no second future, no callback) ├─► complete(value, error)
    torch RPC: its own future's done-callback               ┘     value ──► set_result
                                                                  a remote error's envelope
                                                                    ──► set_exception (its type)
                                                                  a transport error ──► TimeoutError /
                                                                    PeerLostError naming the member
                                                                  "missing" (a stale owner cache)
                                                                    ──► the retry, on a thread of
                                                                    its own (a synchronous call)
                                                                  then the sentinel opens
    the user's callbacks (then, add_done_callback): run inside the completion, or, when the
      lane's own thread completes it, on a helper thread (they may block; that thread must read)

Why settled at completion, not in ``wait()``: torch's ``then`` and ``wait_all`` read the
future in C++, past any Python ``wait``; the value they read must be the final one. Why
the lane completes it directly: a second future and a torch done-callback per call cost
several microseconds of the lane's watcher thread per answer.
"""

from __future__ import annotations

import inspect
import logging
import os
import queue
import threading
import traceback
from typing import TYPE_CHECKING, Any, Callable, Generator, Optional, Tuple

import torch

from ... import _checks
from ..._awaiting import loop_waker
from .. import _transport
from ...exception import PeerLostError, copy_to_raise, drop_frames
from .coroutines import blocking_error, on_loop_thread
from .cuda_settle import settle
from .send import translate_error
from .serve import ENVELOPES, is_failure, is_missing, unwrap

if TYPE_CHECKING:
    from .._membership import Roster, Waits

__all__ = ["RpcFuture", "carry"]

log = logging.getLogger(__name__)

# torch.futures.Future's own are Python frames over these.
_set_result, _value, _wait = torch._C.Future.set_result, torch._C.Future.value, torch._C.Future.wait


class RpcFuture(_transport.lane.LaneFuture):
    """The pending result of an asynchronous call; a ``torch.futures.Future``.

    ``wait()`` (and ``value()`` once done) returns the value, or raises the remote
    exception (original type, remote traceback as ``__cause__``), ``TimeoutError`` or
    :class:`~machinlike.exception.PeerLostError`.
    """

    __slots__ = ("member", "_what", "_timeout", "_retry", "_unread", "_read", "_once", "_unwatch")

    def __init__(self, fut: Optional[torch.futures.Future], member: str, what: str, timeout: float,
                 retry: Optional[Callable[[], Any]] = None) -> None:
        """``fut``: the transport's future to take the result from; None: the lane completes
        this one (``call_async(into=...)``) or :meth:`take_from` names it later."""
        super().__init__()
        self.member = member  # (the caller sets the member a resent call went to)
        self._what = what
        self._timeout = timeout
        self._retry = retry
        self._unread: Optional[BaseException] = None  # its failure, said at collection unless _read
        self._read = False  # someone waited, read its value or registered a callback
        # Taken by the first of two completers (see carry): None while the transport is the only one.
        self._once: Optional[threading.Lock] = None
        self._unwatch: Optional[Callable[[], None]] = None  # (Waits keeps it while pending: see carry)
        if fut is not None:
            self.take_from(fut)

    def take_from(self, fut: torch.futures.Future) -> None:
        """Complete this future from ``fut`` (torch RPC's) once it completes; nothing when
        ``fut`` is this future itself (the lane completes it)."""
        if fut is not self:
            fut.add_done_callback(self._from_torch)

    def follow(self, fut: "RpcFuture") -> None:
        """Complete this future as ``fut``, another call's, completes: its value, or its
        error as it is (translated once already)."""
        def take(done: torch.futures.Future) -> None:
            try:
                value = done.wait()  # (completed: at once)
            except BaseException as err:
                self.fail(err)
            else:
                _set_result(self, value)
                self.arrived()

        torch.futures.Future.add_done_callback(fut, take)  # (it never blocks: on the completer's thread)

    def fail(self, error: BaseException) -> None:
        """Fail this future with ``error`` (a call that could not be started)."""
        self._fail(error)
        self.arrived()

    def end_unanswered(self, error: PeerLostError) -> None:
        """Fail this pending call now: its answer can never come (its member is gone, or
        this member was cut off: see carry); an answer that comes later is dropped. The
        callbacks run on a helper thread: the caller is the liveness thread."""
        if self._claim():
            self._stop_watch()
            self.complete(None, error)

    def _claim(self) -> bool:
        """Whether this completion is the first (always, with one completer)."""
        once = self._once
        return once is None or once.acquire(blocking=False)

    def _stop_watch(self) -> None:
        unwatch, self._unwatch = self._unwatch, None
        if unwatch is not None:
            unwatch()

    def _from_torch(self, fut: torch.futures.Future) -> None:
        if not self._claim():
            return  # ended unanswered already
        if self._unwatch is not None:
            self._stop_watch()
        try:
            value = fut.wait()  # (completed: at once)
        except BaseException as err:  # (torch's are RuntimeErrors; any other must settle too)
            self.complete(None, err)
        else:
            self.complete(value, None)

    def _settle(self, value: Any, error: Optional[BaseException]) -> bool:
        """Settle with what the transport delivered (``complete``, the lane's entry, runs
        this with the user's callbacks sent off its thread: see _off_the_lane); False: a
        retry will (it was started)."""
        if error is None and type(value) not in ENVELOPES:  # the common case: short
            self._retry = None  # (it holds the call's arguments: a kept future must not)
            _set_result(self, value)
            return True
        try:
            if error is None and is_missing(value) and self._retry is not None:
                threading.Thread(target=self._run_retry, name="machinlike-call-retry", daemon=True).start()
                return False
            self._retry = None
            if error is not None:
                failure = translate_error(error, self.member, self._what, self._timeout)
                if failure is not error:
                    failure.__cause__ = error
                self._fail(failure)
            elif is_failure(value):  # the remote error, as it arrived (its traceback is its cause's text)
                self._fail(value.exc)
            else:
                self.set_result(unwrap(value))
        except BaseException as exc:  # never left pending
            if not self.done():
                self._fail(exc)
        return True

    def _fail(self, error: BaseException) -> None:
        self._unread = drop_frames(error)  # (its frames are this plumbing's: see freeze_traceback)
        self.set_exception(error)

    def _run_retry(self) -> None:
        retry, self._retry = self._retry, None
        assert retry is not None  # (only started with one)
        try:
            value = retry()
        except BaseException as exc:
            self._fail(exc)
        else:
            self.set_result(value)
        self.arrived()

    def wait(self, timeout: Optional[float] = None) -> Any:
        """Block until the call finished (at most its RPC timeout) and return its value.

        Args:
            timeout: Seconds to wait at most, if shorter than what is left of the call's
                own timeout; None: the call's. Past it the call goes on (wait again).

        Raises:
            TimeoutError: the member (named) did not answer within the call's timeout,
                or within ``timeout`` (then the call is still pending).
            PeerLostError: the member is gone.
            Exception: what the remote function raised (original type, remote traceback
                as ``__cause__``), as a copy of its own for each read
                (:func:`~machinlike.exception.copy_to_raise` says why).
        """
        self._read = True
        if not self.done() and on_loop_thread():
            raise blocking_error(f"wait() on {self._what} on member {self.member!r}")
        if timeout is not None:
            bound = _checks.seconds("timeout", timeout, allow_zero=True)
            if not self.done() and not self.wait_arrived(bound):
                raise TimeoutError(f"{self._what} on member {self.member!r} did not finish within the {bound:g} s "
                                   f"of this wait; the call goes on (wait() again), bounded by its own timeout "
                                   f"({self._timeout:g} s)")
        try:
            if not self.done() and threading.current_thread() is threading.main_thread():
                # On the sentinel, not in torch's C++ wait, which holds the thread until the
                # call ended (up to its whole timeout) whatever signal comes: a Ctrl-C raises
                # at once. Bounded: the call fails at its timeout, and a retry shares it.
                self.wait_arrived()
            # value(), not torch's wait, which lets go of the GIL (a thread switch a call)
            result = _read(_value if self.done() else _wait, self)
            settle(result)  # (CUDA tensors in it: ready on this thread's stream too)
            return result
        except BaseException:
            del self  # this frame joins the error's traceback, which torch keeps (see exception.freeze_traceback)
            raise

    def then(self, callback: Callable[[Any], Any], _note: bool = True) -> torch.futures.Future:
        """A future of ``callback(self)``, run once this one completes, as torch's ``then``;
        an exception ``callback`` raises keeps its type (torch's wraps it in a
        ``RuntimeError``), so a remote error a relay re-raises reaches its own caller as
        itself. The future is awaitable too. (``_note``: this package's own callbacks
        skip the note that says where a callback raised.)"""
        self._read = True  # the callback is handed the error
        out: torch.futures.Future = _Derived()

        def run(fut: torch.futures.Future) -> None:
            try:
                value = callback(fut)
            except BaseException as exc:
                if _note and not _is_its_error(exc, fut):  # the callback's own: say where, as text
                    below = exc.__traceback__.tb_next if exc.__traceback__ is not None else None
                    exc.add_note("raised in a then() callback:\n" + "".join(traceback.format_tb(below)).rstrip())
                out.set_exception(drop_frames(exc))
            else:
                out.set_result(value)

        super().add_done_callback(_off_the_lane(run))
        return out

    def add_done_callback(self, callback: Callable[..., None]) -> None:
        """Call ``callback(fut)`` once the result (or error) has arrived, as torch does (at
        once if it has); a callback that takes no argument is called without one. A
        callback may block (make a call, wait for another future): one the same-host lane
        would run on its own thread runs on a helper thread instead."""
        self._read = True  # the callback is handed the error (or, taking no argument, chose not to look)
        if _takes_no_argument(callback):
            super().add_done_callback(_off_the_lane(lambda _: callback()))
        else:
            super().add_done_callback(_off_the_lane(callback))

    def value(self) -> Any:
        """The value of a completed future, or its error raised (as torch's ``value``)."""
        self._read = True
        try:
            result = _read(_value, self)
            settle(result)
            return result
        except BaseException:
            del self  # (as in wait)
            raise

    def __await__(self) -> Generator[Any, None, Any]:
        """``await fut`` in a coroutine: the event loop runs on while the call is pending
        (no thread of it waits); gives the value or raises as :meth:`wait` does.
        Cancelling the awaiting task stops the wait, not the call.

        Raises:
            RuntimeError: no event loop runs in this thread.
        """
        return _awaiting(self)

    def __del__(self) -> None:
        # As asyncio does for a task's exception never retrieved: a call that failed
        # while nobody held its future (fire and forget) is said, not lost in silence.
        error = getattr(self, "_unread", None)  # (unset: torch made this object without __init__)
        if error is not None and not self._read:
            try:
                log.warning("%s on member %r failed and its future was dropped unread: %s: %s (wait() on it, "
                            "or add_done_callback, to handle its errors)", self._what, self.member,
                            type(error).__name__, error)
            except Exception:  # (at interpreter exit logging may be gone)
                pass

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"<RpcFuture {self._what} on {self.member!r} {state}>"


def carry(result: RpcFuture, fut: torch.futures.Future, worker: str, roster: "Roster", waits: "Waits") -> RpcFuture:
    """``result``, completed from ``fut``: the transport's future of an async call to ``worker``.

    A call torch carries to another host ends as soon as that worker's member is gone, or
    this member is cut off from the world (``Waits.watch``), not at its timeout: a host
    that vanished sends no reset, and a member cut off never gets its answers. A call the
    lane carries, or one to a process here, fails by itself when its peer dies (its
    sockets close).
    """
    if fut is result or roster.on_this_host(worker):
        result.take_from(fut)
        return result
    # (one done-callback: the completion itself tells Waits to forget the call)
    result._once = threading.Lock()  # (before either completer can run)
    result._unwatch = waits.watch(worker, result._what, result.end_unanswered)
    result.take_from(fut)
    gone = waits.gone(worker, result._what)  # (went before the call was noted: never told)
    if gone is not None:
        result.end_unanswered(gone)  # (nothing, when its answer came first)
    return result


class _LastRaised(threading.local):
    """The ids of the copy this thread's last read raised, and of the error it copies (ids:
    builtin exceptions take no weak reference, and a reference would keep the copy)."""

    ids: Tuple[int, int] = (0, 0)


_last_raised = _LastRaised()


def _read(read: Callable[[torch.futures.Future], Any], fut: torch.futures.Future) -> Any:
    """``read(fut)`` (torch's ``value`` or ``wait``): its value, or a copy of the error
    ``fut`` keeps raised (:func:`~machinlike.exception.copy_to_raise` says why)."""
    try:
        return read(fut)
    except BaseException as kept:
        error = copy_to_raise(kept)
        _last_raised.ids = (id(error), id(kept))
    raise error


def _is_its_error(exc: BaseException, fut: torch.futures.Future) -> bool:
    """Whether ``exc`` is the error ``fut`` failed with, or the copy of it this thread's
    last read raised (the ids are of live objects: ``exc`` and what ``fut`` keeps)."""
    kept = getattr(fut, "_unread", None)
    return kept is not None and (exc is kept or _last_raised.ids == (id(exc), id(kept)))


def _awaiting(fut: torch.futures.Future) -> Generator[Any, None, Any]:
    """Await ``fut`` in the running event loop: a done-callback wakes the loop."""
    waiter, wake = loop_waker()
    fut.add_done_callback(wake)
    yield from waiter.__await__()
    return fut.wait()  # (done: at once)


class _Derived(torch.futures.Future):
    """The future ``then`` returns: torch's, but its ``wait`` and ``value`` leave no frame
    holding it in the traceback of the error they raise (torch's ``wait`` is a Python frame
    over the C++ one, and the error lives on in the future: see :func:`~machinlike.exception.freeze_traceback`);
    and they settle the value in the caller's thread, as ``RpcFuture``'s do (the callback
    that made it ran in another thread, whose settling orders that thread's stream, not
    the caller's: an ``infer_async`` result read under ``torch.cuda.stream(s)``)."""

    def wait(self) -> Any:
        try:
            result = _read(_wait, self)
            settle(result)
            return result
        except BaseException:
            del self
            raise

    def value(self) -> Any:
        try:
            result = _read(_value, self)
            settle(result)
            return result
        except BaseException:
            del self
            raise

    def __await__(self) -> Generator[Any, None, Any]:
        """``await`` it in a coroutine, as an RpcFuture."""
        return _awaiting(self)


_CALLBACK_THREADS = 32  # helper threads at most (a callback that waits for one queued behind 32 others waits)


class _Helpers:
    """Daemon threads that run callbacks: another starts while the queued outnumber the idle,
    up to ``_CALLBACK_THREADS``; they stay, asleep on the queue. Daemons, not an executor's
    threads, which the interpreter joins at exit: a callback that never ends hangs nothing."""

    def __init__(self) -> None:
        self._tasks: "queue.SimpleQueue[Tuple[Callable[[Any], None], Any]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = self._idle = self._queued = 0

    def submit(self, callback: Callable[[Any], None], fut: Any) -> None:
        with self._lock:
            self._queued += 1
            if self._queued > self._idle and self._threads < _CALLBACK_THREADS:
                self._threads += 1
                threading.Thread(target=self._run, name=f"machinlike-callback-{self._threads}", daemon=True).start()
        self._tasks.put((callback, fut))

    def _run(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            callback, fut = self._tasks.get()
            with self._lock:
                self._idle -= 1
                self._queued -= 1
            _logged(callback, fut)
            del callback, fut  # asleep on the queue, hold no future (nor its callback's)


_helpers: Optional[_Helpers] = None
_helpers_lock = threading.Lock()


def _off_the_lane(callback: Callable[[Any], None]) -> Callable[[Any], None]:
    """``callback``, run on a helper thread when the lane's completer would run it.

    Why: the lane's watcher thread completes its futures, and their callbacks run inside. A
    callback there that called the same peer (``fut.then(lambda f: group.registered_sync(...))``)
    would wait for an answer only that thread reads: it would hang until its timeout.
    """
    def run(fut: Any) -> None:
        if not _transport.lane.completing():
            callback(fut)
            return
        global _helpers
        with _helpers_lock:
            if _helpers is None:
                _helpers = _Helpers()
            helpers = _helpers
        helpers.submit(callback, fut)
    return run


def _logged(callback: Callable[[Any], None], fut: Any) -> None:
    try:
        callback(fut)
    except Exception:  # what torch does with a done-callback's exception: said, not raised
        log.exception("a done-callback of an RpcFuture raised")


def _after_fork_in_child() -> None:
    global _helpers, _helpers_lock
    _helpers, _helpers_lock = None, threading.Lock()  # (the parent's threads are not here)


os.register_at_fork(after_in_child=_after_fork_in_child)


def _takes_no_argument(callback: Callable[..., None]) -> bool:
    try:
        signature = inspect.signature(callback)
    except (TypeError, ValueError):  # a builtin without a signature: torch's form
        return False
    try:
        signature.bind(None)
    except TypeError:
        return True
    return False
