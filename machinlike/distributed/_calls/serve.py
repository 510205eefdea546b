"""The callee's side of a call: the tables it serves, the entry points and the envelopes.

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
``_calls.samehost``); only an exception is wrapped, and it is rebuilt on the caller with its original type and the
remote traceback chained as ``__cause__``. torch would instead turn it into a
``RuntimeError`` holding the traceback as text.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.distributed import rpc

from ...exception import ExceptionWithTraceback, freeze_traceback
from .coroutines import future_of
from .results import ResultTable
from .samehost import reply as _reply
from .shipping import _load_function

__all__ = ["LocalTables", "bind_tables", "unwrap", "is_failure", "is_missing", "ENVELOPES"]


class LocalTables:
    """The services and values this process owns, keyed by service id (``group/epoch/key``)."""

    def __init__(self, member: str) -> None:
        self.member = member
        self.services: Dict[str, Callable[..., Any]] = {}
        self.values: Dict[str, Any] = {}
        # Lets an owner forward a call for a key it no longer holds (registered_remote).
        self.resolve_owner: Optional[Callable[[str], Optional[str]]] = None
        # Results kept here for remote handles (see _calls.refs).
        self.results = ResultTable()


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
    # Frozen: an asynchronous answer sits in a torch Future, in C++ (see freeze_traceback).
    return _Failure(ExceptionWithTraceback(freeze_traceback(exc), where=_where()))


class _Missing:
    """The callee does not hold the key the caller asked for (a stale owner cache)."""

    __slots__ = ()

    def __reduce__(self) -> Any:
        return _Missing, ()


_MISSING = _Missing()

#: The types of what a callee answers other than a plain value (a caller unwraps them).
ENVELOPES = (_Failure, _Missing)


def _resolve(result: Any) -> Any:
    # A plain service may still hand back a Future, or a coroutine (an ``async def``
    # method called through a handle): finish it on this RPC thread.
    if isinstance(result, torch.futures.Future):
        return result.wait()
    if inspect.iscoroutine(result):
        return future_of(result).wait()
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
    the RPC thread, a third of such a call's time on the callee. A coroutine (an ``async
    def`` function's call) runs on this process's loop thread."""
    if inspect.iscoroutine(fut):
        fut = future_of(fut)
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
