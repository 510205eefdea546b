"""Handles to values that live on another member: paired values and remote results.

``get_paired``, ``registered_remote`` and ``remote`` return these instead of torch's
RRefs. They behave as RRefs do (``to_here()``, ``rpc_sync().method(...)``,
``rpc_async()``, ``remote()``, ``owner_name()``, ``is_owner()``, ``local_value()``), but
every message they send is an ordinary machinlike call to the owner *member*'s current
RPC worker::

    caller                                           owner (a member incarnation)
    get_paired(key) ── _is_paired(sid) ────────────► "paired"     → PairedRef(owner, sid)
    remote(to, f)   ── _keep_run(rid, token, f) ───► results[rid] = f(...)
                                                                  → ResultRef(owner, rid)
    ref.to_here()   ── _ref_value(target) ─────────► a copy of the value
    ref.rpc_sync().m(x) ── _ref_call(target, m) ───► value.m(x)
    (ref collected)  ── _release_all([(rid, token)]) ► the hold goes; the last frees it
                        (queued, sent in batches by one thread: ``ref_release``)
    pickle(ref)      ── _hold(rid, token') ────────► a hold for the copy on its way
    (copy unpickled) ── _move(rid, token', me) ────► that hold is the receiver's

Why not torch's RRefs: torch binds a process's RRef bookkeeping to its first RPC agent
for good and routes the RRef protocol by worker *id* through that agent's tables. A
member that renewed or recycled its agent could then not make RRefs that name its new
one, and an id could never be given to a second worker (the tables would route one
worker's RRef messages to another): a world could hand out only 32,000 workers. A handle
here names a member and its incarnation, and finds the member's worker at each call.

Lifetimes: a paired value lives as long as its pairing (``unpair`` ends it: ``to_here``
then raises ``KeyError``); a result lives while any handle to it lives, or until every
member holding one is gone (see ``_calls.results``).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
import uuid
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

import torch
from torch.distributed import rpc

from . import context as _context, ref_owner as _ref_owner, samehost as _samehost
from .future import RpcFuture, carry
from .ref_release import release_later, started
from .send import send_async, send_call, sync_call
from .serve import unwrap
from .cuda_settle import settled
from .context import CallContext
from .ref_owner import Target

__all__ = ["PairedRef", "ResultRef", "new_result"]


# The creating handle's token (a copy sent elsewhere gets a token of its own).
_CREATOR = "c"


# ------------------------------------------------------------------ the caller's side
class _Proxy:
    """``ref.rpc_sync()`` etc.: attribute access gives a function that runs the value's
    method on its owner (``how`` is "sync", "async" or "remote")."""

    __slots__ = ("_ref", "_how", "_timeout")

    def __init__(self, ref: "_Ref", how: str, timeout: Optional[float]) -> None:
        self._ref, self._how, self._timeout = ref, how, timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return self._ref._method(self._how, name, args, kwargs, self._timeout)
        call.__name__ = name
        return call


class _Ref:
    """What both kinds of handle share: the owner, the target, and the calls to it."""

    __slots__ = ("_owner", "_inc", "_target", "__weakref__")

    def __init__(self, owner: str, incarnation: int, target: Target) -> None:
        # (A result of registered_remote learns its owner from the creation's answer.)
        self._owner, self._inc, self._target = owner, incarnation, target

    def _what(self) -> str:
        kind, key = self._target
        return f"paired value {key.split('/', 2)[-1]!r}" if kind == "v" else f"remote result {key}"

    def _ready(self, deadline: float) -> None:
        """Wait until the owner holds the target (results: their creation)."""

    def _named(self) -> bool:
        """Whether ``_owner`` is final before ``_ready`` (a service's result: its creation names it)."""
        return True

    # ---------------------------------------------------------------- RRef's API
    def to_here(self, timeout: Optional[float] = None) -> Any:
        """A copy of the value, fetched from its owner.

        Args:
            timeout: Seconds; None (or torch's -1): the World's ``rpc_timeout``.

        Raises:
            KeyError: the value was unpaired (a paired value's handle).
            PeerLostError, TimeoutError: the owner is gone / did not answer (named).
            Exception: what creating a remote result raised (its type, remote traceback
                as ``__cause__``).
        """
        route = _context.require()
        wait = route.seconds(timeout)
        deadline = _now() + wait
        self._ready(deadline)
        worker = route.worker(self._owner, self._inc, self._what(), deadline)
        return settled(unwrap(sync_call(route.roster, route.waits, worker, _ref_owner._ref_value,
                                        _samehost.outgoing(worker, (self._target, (), {}), deadline),  # [shm hook]
                                        max(0.001, deadline - _now()), self._what, wait)))

    def rpc_sync(self, timeout: Optional[float] = None) -> _Proxy:
        """``ref.rpc_sync().m(*args)`` runs ``value.m(*args)`` on the owner and returns its result."""
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: Optional[float] = None) -> _Proxy:
        """``ref.rpc_async().m(*args)`` returns an :class:`RpcFuture` of ``value.m(*args)``."""
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: Optional[float] = None) -> _Proxy:
        """``ref.remote().m(*args)`` returns a :class:`ResultRef` to ``value.m(*args)``, kept by the owner."""
        return _Proxy(self, "remote", timeout)

    def owner_name(self) -> str:
        """The owner's member name (known at once, as torch's ``owner()``, unless a result's
        creation is to name it)."""
        if not self._named():
            self._ready(_now() + _context.require().timeout)
        return self._owner

    def owner_incarnation(self) -> int:
        """The owner's incarnation (as :meth:`owner_name`, known at once unless a result's
        creation is to name it)."""
        if not self._named():
            self._ready(_now() + _context.require().timeout)
        return self._inc

    def owner(self) -> rpc.WorkerInfo:
        """The owner's current RPC worker (torch's ``WorkerInfo``).

        Raises:
            PeerLostError: the owner's incarnation is gone.
        """
        route = _context.require()
        deadline = _now() + route.timeout
        self._ready(deadline)
        return rpc.get_worker_info(route.worker(self._owner, self._inc, self._what(), deadline))

    def is_owner(self) -> bool:
        """Whether this process is the owner (at once when another member is)."""
        route = _context.require()
        if not self._named() or self._owner == route.me[0]:
            self._ready(_now() + route.timeout)
        return route.me == (self._owner, self._inc)

    def local_value(self) -> Any:
        """The value itself, on its owner.

        Raises:
            RuntimeError: this process is not the owner.
            KeyError: the value is no longer there.
        """
        route = _context.require()
        self._ready(_now() + route.timeout)
        if route.me != (self._owner, self._inc):
            raise RuntimeError(f"local_value() of {self._what()} on member {route.me[0]!r}: it is owned by "
                               f"member {self._owner!r}; use to_here() for a copy")
        return _ref_owner._lookup(self._target)

    def confirmed_by_owner(self) -> bool:
        """Whether the owner holds the value (a result: its creation has finished)."""
        return True

    # --------------------------------------------------------------------- calls
    def _method(self, how: str, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any],
                timeout: Optional[float]) -> Any:
        route = _context.require()
        wait = route.seconds(timeout)
        deadline = _now() + wait
        if how == "async" and not self._made():
            return self._async_once_made(name, args, kwargs, deadline, wait)
        self._ready(deadline)
        worker = route.worker(self._owner, self._inc, self._what(), deadline)
        what = f"{name}() of {self._what()}"
        if how == "sync":
            call = _samehost.outgoing(worker, ((self._target, name), args, kwargs), deadline)  # [shm hook]
            return settled(unwrap(sync_call(route.roster, route.waits, worker, _ref_owner._ref_call, call,
                                            max(0.001, deadline - _now()), what, wait)))
        if how == "async":
            sent_to, fut = send_call(route.roster, worker, max(0.001, deadline - _now()), what,
                                     lambda to, left: send_async(
                                         route.roster, to, _ref_owner._ref_call,
                                         _samehost.outgoing(to, ((self._target, name), args, kwargs), deadline), left))
            return carry(RpcFuture(None, self._owner, what, wait), fut, sent_to, route.roster, route.waits)
        return new_result(route, self._owner, worker, what, max(0.001, deadline - _now()),
                          lambda head: (_ref_owner._keep_call, (head + (self._target, name), args, kwargs)))

    def _made(self) -> bool:
        """Whether the target exists (a result: its creation has answered)."""
        return True

    def _async_once_made(self, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], deadline: float,
                         wait: float) -> RpcFuture:
        raise AssertionError("only a result is ever not made")  # (see ResultRef)

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self._what()} on member {self._owner!r} (incarnation {self._inc})>"


class PairedRef(_Ref):
    """A handle to a value paired in a group (what ``RpcGroup.get_paired`` returns).

    Args:
        owner: The member that paired it.
        incarnation: That member's incarnation.
        sid: The value's id, ``group/epoch/key``.
    """

    __slots__ = ()

    def __init__(self, owner: str, incarnation: int, sid: str) -> None:
        super().__init__(owner, incarnation, ("v", sid))

    def __reduce__(self) -> Any:
        return PairedRef, (self._owner, self._inc, self._target[1])


class ResultRef(_Ref):
    """A handle to a result kept by its owner (what ``remote`` and ``registered_remote`` return).

    The result stays on the owner while this handle or a copy of it lives (a copy sent to
    another member holds it too), or until every member holding one is gone.

    Args:
        owner: The member that keeps the result.
        incarnation: That member's incarnation.
        rid: The result's id.
        token: This handle's hold on it.
        created: The creation call, whose answer names the keeper (None: created already).
        what: The call that made it, for messages.
    """

    __slots__ = ("_token", "_created", "_done", "_release", "_made_by", "_sent_to_owner")

    def __init__(self, owner: str, incarnation: int, rid: str, token: str, created: Optional[RpcFuture],
                 what: str, sent_to_owner: bool = True) -> None:
        super().__init__(owner, incarnation, ("r", rid))
        self._token, self._created, self._made_by = token, created, what
        self._done = created is None
        self._sent_to_owner = sent_to_owner  # (False: a service's, whose owner may have moved)
        # Released when the handle is collected (``weakref.finalize``, not ``__del__``: a
        # finalizer holds no reference to the handle and can be told to skip interpreter exit).
        started()  # (its releases go out through that thread)
        fin = weakref.finalize(self, release_later, (owner, incarnation), rid, token, created)
        fin.atexit = False
        self._release = fin

    def _what(self) -> str:
        return f"the result of {self._made_by}"

    def _named(self) -> bool:
        return self._done or self._sent_to_owner

    def _made(self) -> bool:
        return self._done or (self._created is not None and self._created.done())

    def _async_once_made(self, name: str, args: Tuple[Any, ...], kwargs: Dict[str, Any], deadline: float,
                         wait: float) -> RpcFuture:
        """``rpc_async().name(...)`` of a result still being made: sent once it is, so that
        starting it never blocks (torch's owner queues such calls; here the caller does).
        Its future fails as the creation did, or at ``deadline`` when it was made too late."""
        out = RpcFuture(None, self._owner, f"{name}() of {self._what()}", wait)

        def send(_: Any) -> None:
            try:
                out.follow(self._method("async", name, args, kwargs, max(0.001, deadline - _now())))
            except BaseException as exc:  # the creation failed, or the call could not start
                out.fail(exc)

        assert self._created is not None
        self._created.add_done_callback(send)  # (RpcFuture's: run off the lane's thread, as send may block)
        return out

    def _ready(self, deadline: float) -> None:
        if self._done:
            return
        created = self._created
        assert created is not None
        if not created.done():
            # Bounded by the caller's deadline, not only by the creation's own timeout (a
            # to_here(timeout=0.5) of a result still being made waited for it: cold trial 12).
            made = threading.Event()
            torch.futures.Future.add_done_callback(created, lambda _: made.set())  # (never blocks)
            if not made.wait(max(0.0, deadline - _now())):
                raise TimeoutError(f"{self._what()} was not made within the call's timeout: its creation on "
                                   f"member {self._owner!r} still runs (bounded by the timeout of the call that "
                                   f"makes it)")
        self._owner, self._inc = created.wait()
        self._done = True

    def confirmed_by_owner(self) -> bool:
        """Whether the owner has made the result (its creation finished without error)."""
        if self._done:
            return True
        assert self._created is not None
        if not self._created.done():
            return False
        try:
            self._ready(_now())
        except Exception:  # the creation failed: to_here() raises it
            return False
        return True

    def __reduce__(self) -> Any:
        # A copy on its way to another process holds the result too, from now on: the
        # original may be collected before the copy arrives.
        route = _context.require()
        self._ready(_now() + route.timeout)
        token = uuid.uuid4().hex
        worker = route.worker(self._owner, self._inc, self._what(), _now() + route.timeout)
        held = sync_call(route.roster, route.waits, worker, _ref_owner._hold, (self._target[1], token, route.me),
                         route.timeout, f"a copy of {self._what()}")
        if not held:
            raise KeyError(f"{self._what()} is no longer kept by member {self._owner!r}")
        return _arrived, (self._owner, self._inc, self._target[1], token, self._made_by)


def _arrived(owner: str, incarnation: int, rid: str, token: str, what: str) -> ResultRef:
    """A copy of a ResultRef unpickled here: its hold becomes this member's."""
    ref = ResultRef(owner, incarnation, rid, token, None, what)
    context = _context.current()
    if context is not None:
        try:
            worker = context.roster.worker_of(owner)
            rpc.rpc_async(worker, _ref_owner._move, args=(rid, token, context.me))
        except Exception:  # the owner is gone, or no agent: the hold stays the sender's
            pass
    return ref


def new_result(route: CallContext, owner: str, worker: str, what: str, wait: float,
               entry: Callable[[Tuple[Any, ...]], Tuple[Any, Tuple[Any, Any, Any]]],
               sent_to_owner: bool = True) -> ResultRef:
    """Ask ``owner`` to make and keep a result; its handle, at once.

    Args:
        route: This process's call context.
        owner: The member that makes and keeps it (the handle's until the creation's
            answer names it: a service's owner may be a member this view has not seen).
        worker: Its RPC worker.
        what: The call, for messages.
        wait: Seconds for the creation.
        entry: ``head -> (callee entry point, (what, args, kwargs))``, where ``head`` is
            ``(rid, token, holder)`` and the entry's ``what`` starts with it.
        sent_to_owner: Whether ``owner`` keeps it for sure (False: a service's owner,
            which may have moved; the creation's answer names the keeper).

    Raises:
        PeerLostError, RuntimeError: it could not be sent (the member named).
    """
    # Unique in the world without asking anyone: this process's id, a serial and a random part.
    rid = f"{os.getpid():x}.{next(_serial):x}.{uuid.uuid4().hex[:12]}"
    inc = route.roster.incarnation_of(owner) or 0
    func, call = entry((rid, _CREATOR, route.me))
    sent_to, fut = send_call(route.roster, worker, wait, what,
                             lambda to, left: send_async(route.roster, to, func,
                                                         _samehost.outgoing(to, call, _now() + left), left))  # [shm hook]
    made = carry(RpcFuture(None, owner, what, wait), fut, sent_to, route.roster, route.waits)
    return ResultRef(owner, inc, rid, _CREATOR, made, what, sent_to_owner)


_serial = itertools.count()
_now = time.monotonic
