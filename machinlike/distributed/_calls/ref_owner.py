"""The owner's side of remote handles (see ``_calls.refs``): the entry points their calls run.

Every handle message lands here, on the member that owns the value, and finds it in this
process's ``LocalTables`` (``_calls``): a paired value by its service id, a result in the
:class:`~._results.ResultTable`::

    _is_paired(sid)                 the owner's (member, incarnation), or "missing"
    _ref_value / _ref_call          a copy of the value / value.method(...), errors carried
    _keep_run / _keep_call /        run it, keep the outcome as result ``rid`` held by the
      _keep_service                 caller's token; answer who keeps it (or the error)
    _hold / _move / _release        a copy's hold taken, moved to its receiver, dropped

Why module-level functions: torch pickles an RPC's function by reference.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.distributed import rpc

from . import context as _context, samehost as _samehost, serve as _serve
from .coroutines import future_of
from .serve import _done, _failure, _resolve
from .shipping import _load_function
from .results import Holder, is_absent

__all__ = ["Target"]

#: What a handle points at on its owner: ``("v", sid)`` a paired value, ``("r", rid)`` a result.
Target = Tuple[str, str]


def _lookup(target: Target) -> Any:
    tables = _serve._tables
    kind, key = target
    if kind == "v":
        value = tables.values.get(key, _ABSENT) if tables is not None else _ABSENT
        if value is _ABSENT:
            raise KeyError(f"value {key.split('/', 2)[-1]!r} is no longer paired on {_serve._where()}")
        return value
    if tables is None or is_absent(value := tables.results.get(key)):
        raise KeyError(f"remote result {key} is no longer kept by {_serve._where()} (every handle to it was "
                       f"released, or their holders are gone)")
    return value


_ABSENT = object()


def _identity() -> Holder:
    """This member and incarnation (what a handle names as the owner)."""
    context = _context.current()
    if context is None:
        raise RuntimeError(f"{_serve._where()} stopped serving")
    return context.me


def _is_paired(sid: str) -> Any:
    tables = _serve._tables
    return _identity() if tables is not None and sid in tables.values else _serve._MISSING


def _ref_value(target: Target, args: Tuple, kwargs: Dict, reply: int = 0) -> Any:
    try:
        return _samehost.reply(_lookup(target), reply)
    except Exception as exc:
        return _failure(exc)


def _ref_call(what: Tuple[Target, str], args: Tuple, kwargs: Dict, reply: int = 0) -> Any:
    target, name = what
    try:
        return _samehost.reply(_resolve(getattr(_lookup(target), name)(*args, **kwargs)), reply)
    except Exception as exc:
        return _failure(exc)


def _kept(head: Tuple[str, str, Holder], fut: torch.futures.Future) -> Any:
    """Keep what ``fut`` holds as result ``head[0]``; answer who keeps it (member,
    incarnation), or the carried error."""
    try:
        value = fut.value()
        keeper = _identity()
    except Exception as exc:
        return _failure(exc)
    tables = _serve._tables
    if tables is None:
        return _failure(RuntimeError(f"{_serve._where()} stopped serving before it could keep the result"))
    rid, token, holder = head
    tables.results.keep(rid, token, tuple(holder), value)  # type: ignore[arg-type]
    return keeper


def _keep_outcome(head: Tuple[str, str, Holder], make: Callable[[], Any]) -> torch.futures.Future:
    try:
        out = make()
    except Exception as exc:
        return _done(_failure(exc))
    if inspect.iscoroutine(out):  # an ``async def`` function or method: on this process's loop thread
        out = future_of(out)
    fut = out if isinstance(out, torch.futures.Future) else _done(out)
    return fut.then(lambda f: _kept(head, f))


@rpc.functions.async_execution
def _keep_run(what: Tuple[Any, ...], args: Tuple, kwargs: Dict, reply: int = 0) -> torch.futures.Future:
    head, func = what[:3], what[3]
    return _keep_outcome(head, lambda: _load_function(func)(*args, **kwargs))


@rpc.functions.async_execution
def _keep_call(what: Tuple[Any, ...], args: Tuple, kwargs: Dict, reply: int = 0) -> torch.futures.Future:
    head, target, name = what[:3], what[3], what[4]
    return _keep_outcome(head, lambda: getattr(_lookup(target), name)(*args, **kwargs))


@rpc.functions.async_execution
def _keep_service(what: Tuple[Any, ...], args: Tuple, kwargs: Dict, reply: int = 0) -> torch.futures.Future:
    head, sid = what[:3], what[3]
    tables = _serve._tables
    service = tables.services.get(sid) if tables is not None else None
    if service is not None:
        return _keep_outcome(head, lambda: service(*args, **kwargs))
    # The key moved since the caller looked it up: its new owner runs it, and the result
    # is kept here, where the caller's handle points.
    owner = tables.resolve_owner(sid) if tables is not None and tables.resolve_owner else None
    if owner is None or tables is None or owner == tables.member:
        return _done(_failure(KeyError(f"service {sid.split('/', 2)[-1]!r} is not registered on any member")))
    forwarded = rpc.rpc_async(owner, _run_service, args=(sid, args, kwargs))
    return forwarded.then(lambda f: _kept_forwarded(head, sid, f))


@rpc.functions.async_execution
def _run_service(sid: str, args: Tuple, kwargs: Dict) -> torch.futures.Future:
    """Service ``sid``'s outcome, plain or asynchronous (for a forwarded ``_keep_service``)."""
    tables = _serve._tables
    service = tables.services.get(sid) if tables is not None else None
    if service is None:
        return _done(_serve._MISSING)
    try:
        out = service(*args, **kwargs)
    except Exception as exc:
        return _done(_failure(exc))
    if not isinstance(out, torch.futures.Future):
        return _done(out)
    return out.then(lambda f: _serve._settle(f))


def _kept_forwarded(head: Tuple[str, str, Holder], sid: str, fut: torch.futures.Future) -> Any:
    try:
        value = fut.value()
    except Exception as exc:
        return _failure(exc)
    if _serve.is_missing(value):
        return _failure(KeyError(f"service {sid.split('/', 2)[-1]!r} is not registered on any member"))
    if _serve.is_failure(value):
        return value
    return _kept(head, _done(value))


def _hold(rid: str, token: str, holder: Holder) -> bool:
    tables = _serve._tables
    return tables is not None and tables.results.hold(rid, token, tuple(holder))  # type: ignore[arg-type]


def _move(rid: str, token: str, holder: Holder) -> None:
    tables = _serve._tables
    if tables is not None:
        tables.results.move(rid, token, tuple(holder))  # type: ignore[arg-type]


def _release(rid: str, token: str) -> None:
    tables = _serve._tables
    if tables is not None:
        tables.results.release(rid, token)


def _release_all(pairs: List[Tuple[str, str]]) -> None:
    """Releases of several holds ``(rid, token)`` in one call (``ref_release``)."""
    tables = _serve._tables
    if tables is not None:
        for rid, token in pairs:
            tables.results.release(rid, token)
