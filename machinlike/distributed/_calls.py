"""What travels over RPC: remote entry points, result envelopes and error translation.

Every call machinlike makes through ``torch.distributed.rpc`` targets one of the
module-level entry points below (torch pickles them by reference), which run the user's
service or function on the callee and wrap the outcome:

    caller                                    callee (owner of the key)
    ------                                    ----------------------------------
    rpc_sync(owner, _call_service,   ───────► look the service up in the local table
             (sid, args, kwargs))             ├─ absent   → _Missing      (caller refreshes
                                              │                            its owner cache)
                                              ├─ raised   → _Failure(ExceptionWithTraceback)
    raise / retry / return  ◄──────────────── └─ returned → the value itself

Values go back as they are, so tensors still travel in torch's tensor table (large CPU
ones through shared memory when the caller passed a ``reply`` threshold, see
``_samehost``); only an exception is wrapped, and it is rebuilt on the caller with its original type and the
remote traceback chained as ``__cause__``. torch would instead turn it into a
``RuntimeError`` holding the traceback as text.
"""

from __future__ import annotations

import sys
import threading
import time
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence, Tuple, TypeVar, Union

import torch
from torch.distributed import rpc

from ..exception import ExceptionWithTraceback, PeerLostError
from ..pickle import dumps, loads
from .._checks import call_args
from . import _transport
from ._results import ResultTable
from ._samehost import reply as _reply

if TYPE_CHECKING:
    from ._roster import Roster
    from ._waits import Waits

__all__ = ["RpcFuture", "LocalTables", "sync_call", "send_call", "prepare_call"]


class LocalTables:
    """The services and values this process owns, keyed by service id (``group/epoch/key``)."""

    def __init__(self, member: str) -> None:
        self.member = member
        self.services: Dict[str, Callable[..., Any]] = {}
        self.values: Dict[str, Any] = {}
        # Lets an owner forward a call for a key it no longer holds (registered_remote).
        self.resolve_owner: Optional[Callable[[str], Optional[str]]] = None
        # Results kept here for remote handles (see _refs).
        self.results = ResultTable()
        # Told the member of each call of this process that timed out (see _agent_probe).
        self.timed_out: Optional[Callable[[str], None]] = None


_tables: Optional[LocalTables] = None


def bind_tables(tables: Optional[LocalTables]) -> None:
    """Make ``tables`` what incoming calls see (None: this process serves nothing)."""
    global _tables
    _tables = tables


def _where() -> str:
    return f"member {_tables.member!r}" if _tables is not None else "an RPC callee"


class _Failure:
    """An exception raised on the callee, carried back as a value."""

    __slots__ = ("exc",)

    def __init__(self, exc: Any) -> None:
        self.exc = exc

    def __reduce__(self) -> Any:
        return _Failure, (self.exc,)


def _failure(exc: BaseException) -> _Failure:
    return _Failure(ExceptionWithTraceback(exc, where=_where()))


class _Missing:
    """The callee does not hold the key the caller asked for (a stale owner cache)."""

    __slots__ = ()

    def __reduce__(self) -> Any:
        return _Missing, ()


_MISSING = _Missing()




def _resolve(result: Any) -> Any:
    # A plain service may still hand back a Future; finish it on this RPC thread.
    if isinstance(result, torch.futures.Future):
        return result.wait()
    return result


def _settle(fut: torch.futures.Future, reply: int = 0) -> Any:
    try:
        return _reply(fut.value(), reply)
    except Exception as exc:
        return _failure(exc)


def _done(value: Any) -> torch.futures.Future:
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(value)
    return fut


def _settled(fut: torch.futures.Future, reply: int) -> torch.futures.Future:
    """What an asynchronous service's future answers with: ``_settle``'s envelope once it
    completes. A future already complete (a service that answered on the spot, as an
    idle inference server does) is settled here: ``Future.then`` costs about 30 us on
    the RPC thread, a third of such a call's time on the callee."""
    if fut.done():
        return _done(_settle(fut, reply))
    return fut.then(lambda done: _settle(done, reply))


# ----------------------------------------------------------------- callee entry points
def _call_service(sid: str, args: Tuple, kwargs: Dict, reply: int = 0) -> Any:
    service = _tables.services.get(sid) if _tables is not None else None
    if service is None:
        return _MISSING
    try:
        return _reply(_resolve(service(*args, **kwargs)), reply)
    except Exception as exc:
        return _failure(exc)


@rpc.functions.async_execution
def _call_async_service(sid: str, args: Tuple, kwargs: Dict, reply: int = 0) -> torch.futures.Future:
    service = _tables.services.get(sid) if _tables is not None else None
    if service is None:
        return _done(_MISSING)
    try:
        return _settled(service(*args, **kwargs), reply)
    except Exception as exc:
        return _done(_failure(exc))


def _ping() -> None:
    """Answers at once: the member is alive and serving."""


def _run(func: Any, args: Tuple, kwargs: Dict, reply: int = 0) -> Any:
    try:
        return _reply(_resolve(_load_function(func)(*args, **kwargs)), reply)
    except Exception as exc:
        return _failure(exc)


@rpc.functions.async_execution
def _run_async(func: Any, args: Tuple, kwargs: Dict, reply: int = 0) -> torch.futures.Future:
    try:
        return _settled(_load_function(func)(*args, **kwargs), reply)
    except Exception as exc:
        return _done(_failure(exc))


# ------------------------------------------------------------------ shipping functions
# A lambda or closure cannot be pickled by reference, so it travels as bytes of
# machinlike.pickle (by value, through dill). Both
# sides cache: the caller its bytes per function object, the callee the loaded function
# per byte string (so captured objects are unpickled once per process and then reused).
_shipped: "weakref.WeakKeyDictionary[Any, bytes]" = weakref.WeakKeyDictionary()
_loaded: "OrderedDict[bytes, Callable[..., Any]]" = OrderedDict()
_loaded_lock = threading.Lock()
_LOADED_MAX = 256


def _by_reference(func: Any) -> bool:
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    qualname = getattr(func, "__qualname__", None)
    if module is None or not qualname or "<locals>" in qualname:
        return False
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target is func


def ship_function(func: Callable[..., Any]) -> Any:
    """What to send for ``func``: itself when importable on the callee, else its bytes."""
    if _by_reference(func):
        return func
    try:
        return _shipped[func]
    except (KeyError, TypeError):
        pass
    data = dumps(func)
    try:
        _shipped[func] = data
    except TypeError:  # not weak-referenceable (e.g. a functools.partial): no caching
        pass
    return data


def _load_function(func: Any) -> Callable[..., Any]:
    if type(func) is not bytes:
        return func
    with _loaded_lock:
        loaded = _loaded.get(func)
        if loaded is not None:
            _loaded.move_to_end(func)
            return loaded
    loaded = loads(func)
    with _loaded_lock:
        _loaded[func] = loaded
        if len(_loaded) > _LOADED_MAX:
            _loaded.popitem(last=False)
    return loaded


def is_async(func: Any) -> bool:
    """Whether ``func`` is marked with ``@rpc.functions.async_execution``."""
    return hasattr(func, "_wrapped_async_rpc_function")


# ------------------------------------------------------------------- error translation
_LOST_MARKERS = (
    "eof", "pipe closed", "connection refused", "econnrefused", "connection reset",
    "econnreset", "broken pipe", "epipe", "shut down", "shutdown", "no route to host",
    "unknown destination worker", "could not find destination",
    # tensorpipe's CMA channel reading a same-host sender's memory after it died (ESRCH)
    "process_vm_readv: no such process",
)


def translate_error(err: BaseException, member: str, what: str, timeout: float) -> BaseException:
    """Turn torch's text-only RPC errors into a TimeoutError / PeerLostError naming ``member``."""
    text = str(err).lower()
    if "timeout" in text or "timed out" in text:
        tables = _tables
        if tables is not None and tables.timed_out is not None:
            tables.timed_out(member)  # (returns at once: the monitor acts on its next tick)
        return TimeoutError(f"{what} on member {member!r} did not answer within {timeout:g} s")
    if any(marker in text for marker in _LOST_MARKERS):
        return PeerLostError(member, f"{what} failed: {err}")
    if _transport.closed_agent_error(err):
        return RuntimeError(f"{what} on member {member!r} was not sent: this process's RPC agent was shut down "
                            f"(its World stopped, or a renewal of its agent failed): {err}")
    return err


# ------------------------------------------------------------------ the blocking call
def _text(what: Union[str, Callable[[], str]]) -> str:
    return what if isinstance(what, str) else what()


def sync_call(roster: "Roster", waits: "Waits", worker: str, entry: Any, args: Tuple, timeout: float,
              what: Union[str, Callable[[], str]], stated: Optional[float] = None) -> Any:
    """One blocking call of ``entry`` on RPC worker ``worker``, the way every group call makes it.

        worker gone in this view       -> PeerLostError at once
        worker on this host (/proc)    -> rpc_sync: its death closes the sockets
        worker elsewhere               -> rpc_async + Waits.wait_call: the liveness
                                          monitor ends the wait

    Args:
        timeout: Seconds for this call.
        what: The call, for messages; a callable makes it only when needed (a small
            call should not pay for formatting it).
        stated: The caller's timeout to quote (None: ``timeout``).

    Raises:
        PeerLostError, TimeoutError: the worker is gone / did not answer (its member named).
    """
    if roster.cut_off is not None:
        raise roster.cut_off
    if roster.resolve(worker) is None:
        raise PeerLostError(roster.member_of(worker), f"{_text(what)}: it left or was lost")

    def call(to: str, left: float) -> Any:
        if roster.on_this_host(to):
            # A dead process here closes its sockets: the call fails at once by itself.
            return rpc.rpc_sync(to, entry, args=args, timeout=left)
        # Another host may vanish without a word: the liveness monitor ends the wait.
        return waits.wait_call(rpc.rpc_async(to, entry, args=args, timeout=left), to, _text(what))

    return _until_sent(roster, worker, timeout, call, lambda err, to: translate_error(
        err, roster.member_of(to), _text(what), timeout if stated is None else stated))[1]


_Sent = TypeVar("_Sent")


def send_call(roster: "Roster", worker: str, timeout: float, what: str,
              send: Callable[[str, float], _Sent]) -> Tuple[str, _Sent]:
    """Hand a call to this process's agent without waiting for it: ``send(worker, seconds)``
    (an ``rpc.rpc_async`` or ``rpc.remote``), sent again when the agent could not send it at
    all (see ``_Attempts``), all within ``timeout`` seconds.

    Returns:
        The worker it went to (its member may have moved) and what ``send`` returned.

    Raises:
        PeerLostError, RuntimeError: it could not be sent (the member named).
    """
    return _until_sent(roster, worker, timeout, send,
                       lambda err, to: translate_error(err, roster.member_of(to), what, timeout))


def _until_sent(roster: "Roster", worker: str, timeout: float, send: Callable[[str, float], _Sent],
                fail: Callable[[BaseException, str], BaseException]) -> Tuple[str, _Sent]:
    """``send(worker, seconds left)``, again as ``_Attempts`` says, within ``timeout``
    seconds; ``fail(err, worker)`` is what to raise when an error stands."""
    deadline = time.monotonic() + timeout
    _transport.wait_steady(timeout)  # (an agent swap under way: see _transport._swap)
    attempt: Optional[_Attempts] = None  # made on the first error only (the hot path has none)
    to = worker
    while True:
        # A worker retired by its member's renewal since the caller picked it (this
        # process's own included): its successor (see Roster.resolve).
        to = roster.resolve(to) or to
        roster.pipes.called(to)
        try:
            return to, send(to, max(0.001, deadline - time.monotonic()))
        except (RuntimeError, ValueError) as err:
            attempt = attempt or _Attempts(to)
            if not attempt.again(roster, err, deadline):
                raise fail(err, attempt.worker) from err
            to = attempt.worker


class _Attempts:
    """Where one call goes next after an error that delivered nothing of it (so sending it
    again cannot run it twice), within the call's deadline:

        no current agent (this process swaps it: a renewal)      -> wait for the swap
        an agent shut down under the call (a failed renewal's)   -> wait, then the new one
        refused (its member renewed its agent or recycled)       -> the worker it moved to
        reset by a live process on this host (its listener       -> the worker it moved to
          closed under a new pipe)
        unknown to this agent ("could not find destination")     -> the worker it moved to,
                                                                    or introduce it once
    """

    __slots__ = ("worker", "_introduced", "_closed")

    # A closed agent that stays current (torch resets it just after its shutdown) is met
    # at most this often per call: the World itself is stopping then.
    _CLOSED_MAX = 3

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self._introduced = False  # a worker is introduced to this process's agent once per call
        self._closed = 0

    def again(self, roster: "Roster", err: BaseException, deadline: float) -> bool:
        """Whether to send once more (to ``self.worker``, perhaps changed); False: ``err`` stands."""
        if time.monotonic() >= deadline:
            return False
        if _transport.closed_agent_error(err):
            self._closed += 1
            if self._closed > self._CLOSED_MAX:
                return False
            return _transport.wait_current(deadline - time.monotonic())
        if not isinstance(err, RuntimeError):
            return False
        if _transport.no_agent_error(err):
            return _transport.wait_current(deadline - time.monotonic())
        renewed = _renewed_worker(roster, self.worker, err, deadline, self._introduced)
        if renewed is None:
            return False
        self._introduced = self._introduced or renewed == self.worker
        self.worker = renewed
        return True


# How torch's TensorPipe words a pipe reset under a call (tcp and shm transports).
_RESET = ("connection reset", "econnreset", "broken pipe", "epipe")
# Seconds a reset call waits for its worker's member to move (a renewal: a monitor tick to
# notice the closed listener, and the new agent's join).
_RESET_WAIT = 10.0


def _renewed_worker(roster: "Roster", worker: str, err: RuntimeError, deadline: float,
                    introduced: bool = False) -> Optional[str]:
    """The worker to call instead of ``worker`` after ``err``, else None (the error stands).

    Refused: the worker its member moved to before ``deadline``. Unknown to this process's
    agent ("could not find destination"): the worker it moved to, or ``worker`` itself once
    introduced to the agent (not again when ``introduced``: this call did that already),
    or, when its address is gone too, the worker it moves to within ``_RESET_WAIT``.
    Reset by a live process on this host: the worker it moved to within ``_RESET_WAIT``.
    """
    text = str(err).lower()
    if "could not find destination" in text:
        # Nothing was sent: this process's agent does not know ``worker``. Either its
        # member moved to a new agent since this view's caller picked ``worker`` (this
        # process's own old agent included), or it joined while this process was renewing
        # its agent, so that its join told the agent being retired, not the new one.
        moved = roster.moved_from(worker, 0.0)
        if moved is not None:
            return moved
        if introduced or roster.transport_gone(worker):
            return None  # (introduced: this call told the agent once already; it stands)
        if not _transport.introduce_current(worker):
            # Its address is gone: a worker its member retired (renewals in a row), whose
            # move this view reads within a tick; a gone member's ends the wait at once.
            return roster.moved_from(worker, min(_RESET_WAIT, deadline - time.monotonic()))
        return worker
    if "connection refused" in text or "econnrefused" in text:
        return roster.moved_from(worker, deadline - time.monotonic())
    if any(word in text for word in _RESET) and roster.on_this_host(worker):
        # A new pipe to a process here whose listener closed as it connected (the kernel
        # took the connection, nobody accepted it: nothing of the call ran), this process's
        # own included: it renews its agent within a tick or two, and the call goes to the
        # new one. A dead process here resets too: moved_from says so at once and the
        # error stands; so it does when no move comes within _RESET_WAIT.
        return roster.moved_from(worker, min(_RESET_WAIT, deadline - time.monotonic()))
    return None


def prepare_call(func: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]]) -> Tuple:
    """``(shipped func, args, kwargs)`` of a plain call, checked before anything is sent.

    Raises:
        TypeError: ``func`` is not callable, or ``args``/``kwargs`` are not a sequence / dict.
    """
    if not callable(func):
        raise TypeError(f"func must be callable, not {type(func).__name__}")
    return (ship_function(func),) + call_args(args, kwargs)


def unwrap(value: Any) -> Any:
    """Raise a carried remote exception, else return the value."""
    if type(value) is _Failure:
        raise value.exc
    return value


def is_failure(value: Any) -> bool:
    """Whether ``value`` is a carried remote exception (``unwrap`` raises it)."""
    return type(value) is _Failure


def is_missing(value: Any) -> bool:
    return type(value) is _Missing


class RpcFuture:
    """The pending result of an asynchronous call.

    ``wait()`` returns the value, or raises the remote exception (original type, remote
    traceback as ``__cause__``), ``TimeoutError`` or :class:`~machinlike.exception.PeerLostError`.
    """

    __slots__ = ("_fut", "_member", "_what", "_timeout", "_retry")

    def __init__(
        self,
        fut: torch.futures.Future,
        member: str,
        what: str,
        timeout: float,
        retry: Optional[Callable[[], Any]] = None,
    ) -> None:
        self._fut = fut
        self._member = member
        self._what = what
        self._timeout = timeout
        self._retry = retry

    def wait(self) -> Any:
        """Block until the call finished (at most its RPC timeout) and return its value.

        Raises:
            TimeoutError: the member (named) did not answer within the call's timeout.
            PeerLostError: the member is gone.
            Exception: what the remote function raised (original type, remote traceback
                as ``__cause__``).
        """
        try:
            value = self._fut.wait()
        except RuntimeError as err:
            raise translate_error(err, self._member, self._what, self._timeout) from err
        if type(value) is _Missing and self._retry is not None:
            return self._retry()
        return unwrap(value)

    def done(self) -> bool:
        """Whether the result (or error) has arrived."""
        return self._fut.done()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the result (or error) has arrived (at once if it has)."""
        self._fut.add_done_callback(lambda _: callback())

    def __repr__(self) -> str:
        state = "done" if self._fut.done() else "pending"
        return f"<RpcFuture {self._what} on {self._member!r} {state}>"
