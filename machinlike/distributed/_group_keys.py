"""RpcGroup's services and values: keys that members own, which any process calls or reads.

Who owns a key lives in the world's store (claimed through ``Claims``); callers cache owners
and correct the cache when it went stale: an owner that no longer holds the key answers
"missing" (or is known to be gone), the caller looks the key up again and retries once,
within the same deadline. A cached call is therefore a single RPC round trip, like a raw
``rpc_sync``. A member that dies has its keys freed by the liveness monitor, so a survivor
can take them over.

    register(key) / pair(key)      claim <ns>rg/<group>/<epoch>/s/<key> ("s:<worker>" | "a:<worker>")
                                   or .../v/<key> ("<worker>"); the callable / value stays here
    registered_* / get_paired      cached owner -> one call; "missing" or owner gone -> look
                                   the key up again, retry once within the same deadline
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Optional, Sequence, Set, Tuple, Union

from torch.distributed import rpc

from .. import _checks
from . import _calls, _samehost
from ._calls import RpcFuture, is_async, is_missing, is_stale, sync_call, unwrap
from ._group_directory import GroupDirectory
from ._keys import ServiceOwner
from ._paired import RenewedOwnerRRef
from ._registry import deadline_left

__all__ = ["GroupKeys"]

_check_key = _checks.service_key


class GroupKeys:
    """The services and values of :class:`~machinlike.distributed.RpcGroup` (a mixin it inherits).

    Holds no state of its own; it declares what it uses of the group's (initialised in
    ``RpcGroup.__init__``, which owns it) and the group methods it calls. Everything of
    the world comes from the group's :class:`GroupDirectory`.
    """

    _name: str
    _sid: str
    _lock: threading.Lock
    _service_owners: Dict[str, ServiceOwner]
    _value_owners: Dict[str, str]
    _my_services: Set[str]
    _my_values: Set[str]

    def _check_usable(self, need_member: bool) -> GroupDirectory:
        raise NotImplementedError  # RpcGroup's

    def _timeout(self, d: GroupDirectory, timeout: Optional[float]) -> float:
        raise NotImplementedError  # RpcGroup's

    def _key(self, d: GroupDirectory, kind: str, key: str) -> str:
        raise NotImplementedError  # RpcGroup's

    # ------------------------------------------------------------------ look-ups
    def _lookup_value(self, d: GroupDirectory, key: str, refresh: bool) -> Optional[str]:
        """The RPC worker that paired ``key`` (cached unless ``refresh``), None if nobody."""
        if not refresh:
            held = self._value_owners.get(key)
            if held is not None and not d.roster.transport_gone(held):
                return held
        held = d.claims.owner(self._key(d, "v", key))
        if held is None:
            self._value_owners.pop(key, None)
        else:
            self._value_owners[key] = held
        return held

    def _lookup_service(self, d: GroupDirectory, key: str, refresh: bool) -> Optional[ServiceOwner]:
        """Who serves ``key`` (cached unless ``refresh``), None if nobody."""
        if not refresh:
            owner = self._service_owners.get(key)
            if owner is not None and not d.roster.transport_gone(owner.worker):
                return owner
        held = d.claims.owner(self._key(d, "s", key))
        if held is None:
            self._service_owners.pop(key, None)
            return None
        owner = self._service_owners[key] = ServiceOwner.decode(held)
        return owner

    def _service_target(self, d: GroupDirectory, key: str, refresh: bool = False) -> Tuple[str, Callable[..., Any]]:
        owner = None if refresh else self._service_owners.get(key)
        if owner is None or d.roster.transport_gone(owner.worker):  # else the common case, at once
            owner = self._lookup_service(d, key, refresh)
            if owner is None:
                raise KeyError(f"Service [{key}] not found on Group [{self._name}]")
        return owner.worker, _calls._call_async_service if owner.is_async else _calls._call_service

    # ------------------------------------------------------------------- services
    def register(self, key: str, service: Callable[..., Any]) -> None:
        """Publish ``service`` under ``key``; members call it with ``registered_*``.

        ``service`` may return a value or, when decorated with
        ``@torch.distributed.rpc.functions.async_execution``, a ``torch.futures.Future`` that
        it completes later without holding an RPC thread. It runs in this process, on an
        RPC thread, so it must be thread-safe.

        Args:
            key: Name of the service, unique in the group.
            service: The callable (a function, bound method, lambda, ...).

        Raises:
            KeyError: ``key`` is already registered in the group (by any member).
            TypeError: ``service`` is not callable.
        """
        _check_key(key)
        if not callable(service):
            raise TypeError(f"service must be callable, not {type(service).__name__}")
        d = self._check_usable(need_member=True)
        holder = ServiceOwner(d.endpoint.transport, is_async(service))
        with self._lock:
            if key in self._my_services:
                raise KeyError(f"Service [{key}] already registered in Group [{self._name}] (by this member)")
            d.tables.services[self._sid + key] = service
            taken = d.claims.claim(self._key(d, "s", key), holder.encode())
            if taken is not None:
                del d.tables.services[self._sid + key]
                raise KeyError(f"Service [{key}] already registered in Group [{self._name}] "
                               f"(by member {d.roster.member_of(ServiceOwner.worker_of(taken))!r})")
            self._my_services.add(key)
            self._service_owners[key] = holder

    def deregister(self, key: str) -> None:
        """Withdraw a service this member registered.

        Args:
            key: Name of the service.

        Raises:
            KeyError: this member has not registered ``key``.
        """
        _check_key(key)
        d = self._check_usable(need_member=True)
        with self._lock:
            if key not in self._my_services:
                raise KeyError(f"Service [{key}] not registered in Group [{self._name}] by member {d.name!r}")
            owner = self._service_owners.get(key)
            d.claims.release(self._key(d, "s", key), owner.encode() if owner is not None else "")
            self._my_services.discard(key)
            self._service_owners.pop(key, None)
            d.tables.services.pop(self._sid + key, None)

    def is_registered(self, key: str) -> bool:
        """Whether any member holds a service under ``key`` (asks the store).

        Args:
            key: Name of the service.
        """
        _check_key(key)
        d = self._check_usable(need_member=False)
        return self._lookup_service(d, key, refresh=True) is not None

    def registered_sync(self, key: str, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
                        timeout: Optional[float] = None) -> Any:
        """Run the service ``key`` on its owner and return its result.

        Args:
            key: Name of the service.
            args: Positional arguments of the service.
            kwargs: Keyword arguments of the service; None: none.
            timeout: Seconds; None: the world's ``rpc_timeout``.

        Returns:
            What the service returned; for an asynchronous service, the value its future
            was completed with.

        Raises:
            KeyError: no member registered ``key``.
            TimeoutError, PeerLostError: the owner did not answer / is gone (named).
            Exception: whatever the service raised, with its remote traceback as cause.
        """
        _check_key(key)
        d = self._check_usable(need_member=False)
        wait = self._timeout(d, timeout)
        call = (self._sid + key,) + _checks.call_args(args, kwargs)
        # A retry after a stale owner shares the deadline.
        return self._call_until(d, key, call, time.monotonic() + wait, wait, (False, True))

    def _call_until(self, d: GroupDirectory, key: str, call: Tuple, deadline: float, stated: float,
                    refreshes: Sequence[bool]) -> Any:
        """Call service ``key`` once per entry of ``refreshes`` (True: look its owner up
        first) until an owner holds it, all within ``deadline``; quote ``stated``."""
        for refresh in refreshes:
            member, entry = self._service_target(d, key, refresh)
            left = deadline - time.monotonic()
            value = sync_call(d.roster, d.waits, member, entry, _samehost.outgoing(member, call), left if left > 0.001 else 0.001,
                               lambda: f"service {key!r} of group {self._name!r}", stated)  # [shm hook] above
            if not is_missing(value):
                return unwrap(value)
        raise KeyError(f"Service [{key}] not found on Group [{self._name}]")

    def registered_async(self, key: str, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
                         timeout: Optional[float] = None) -> RpcFuture:
        """Like :meth:`registered_sync` but returns at once; ``wait()`` on the result.

        Args:
            key: Name of the service.
            args: Positional arguments of the service.
            kwargs: Keyword arguments of the service; None: none.
            timeout: Seconds for the call, counted from now; None: the world's
                ``rpc_timeout``.

        Returns:
            An :class:`RpcFuture` whose ``wait()`` returns the result or raises what
            :meth:`registered_sync` would.

        Raises:
            KeyError: no member registered ``key`` (raised here, not by ``wait()``).
        """
        _check_key(key)
        d = self._check_usable(need_member=False)
        wait = self._timeout(d, timeout)
        call = (self._sid + key,) + _checks.call_args(args, kwargs)
        deadline = time.monotonic() + wait
        member, entry = self._service_target(d, key)
        d.roster.pipes.called(member)
        fut = rpc.rpc_async(member, entry, args=_samehost.outgoing(member, call), timeout=wait)  # [shm hook]
        # The owner answered "missing" (a stale cache): look it up again and call the new
        # one with what is left of this call's timeout, not a fresh one.
        return RpcFuture(fut, d.roster.member_of(member), f"service {key!r} of group {self._name!r}",
                         wait, retry=lambda: self._call_until(d, key, call, deadline, wait, (True,)))

    def registered_remote(self, key: str, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
                          timeout: Optional[float] = None) -> rpc.RRef:
        """Run the service ``key`` on its owner and return an RRef to its result.

        The result stays on the owner. Errors of the service surface from
        ``rref.to_here()`` as torch reports them (a ``RuntimeError`` holding the remote
        message).

        Args:
            key: Name of the service.
            args: Positional arguments of the service.
            kwargs: Keyword arguments of the service; None: none.
            timeout: Seconds for creating the result on the owner; None: the world's
                ``rpc_timeout``.

        Returns:
            A ``torch.distributed.rpc.RRef`` owned by the service's owner.

        Raises:
            KeyError: no member registered ``key``.
        """
        _check_key(key)
        d = self._check_usable(need_member=False)
        call = (self._sid + key,) + _checks.call_args(args, kwargs)
        wait = self._timeout(d, timeout)
        member, _ = self._service_target(d, key)
        d.roster.pipes.called(member)
        return rpc.remote(member, _calls._remote_service, args=_samehost.outgoing(member, call),  # [shm hook]
                          timeout=wait)

    # --------------------------------------------------------------------- values
    def pair(self, key: str, value: Any) -> None:
        """Publish ``value`` under ``key``; members reach it with ``get_paired``.

        The value stays in this process; others get an RRef to it.

        Args:
            key: Name of the value, unique in the group.
            value: Any object.

        Raises:
            KeyError: ``key`` is already paired in the group (by any member).
        """
        _check_key(key)
        d = self._check_usable(need_member=True)
        with self._lock:
            if key in self._my_values:
                raise KeyError(f"Value with key [{key}] already paired to Group [{self._name}] (by this member)")
            d.tables.values[self._sid + key] = value
            me = d.endpoint.transport
            taken = d.claims.claim(self._key(d, "v", key), me)
            if taken is not None:
                del d.tables.values[self._sid + key]
                raise KeyError(f"Value with key [{key}] already paired to Group [{self._name}] "
                               f"(by member {d.roster.member_of(taken)!r})")
            self._my_values.add(key)
            self._value_owners[key] = me

    def unpair(self, key: str) -> None:
        """Withdraw a value this member paired.

        Args:
            key: Name of the value.

        Raises:
            KeyError: this member has not paired ``key``.
        """
        _check_key(key)
        d = self._check_usable(need_member=True)
        with self._lock:
            if key not in self._my_values:
                raise KeyError(f"Value with key [{key}] not paired to Group [{self._name}] by member {d.name!r}")
            d.claims.release(self._key(d, "v", key), d.endpoint.transport)
            self._my_values.discard(key)
            self._value_owners.pop(key, None)
            d.tables.values.pop(self._sid + key, None)

    def is_paired(self, key: str) -> bool:
        """Whether any member paired a value under ``key`` (asks the store).

        Args:
            key: Name of the value.
        """
        _check_key(key)
        d = self._check_usable(need_member=False)
        return self._lookup_value(d, key, refresh=True) is not None

    def get_paired(self, key: str, timeout: Optional[float] = None) -> Union[rpc.RRef, RenewedOwnerRRef]:
        """An RRef to the value paired under ``key`` (owned by the member that paired it).

        ``rref.rpc_sync().method(...)`` runs a method of the value on its owner;
        ``rref.to_here()`` copies it with torch's pickler (standard ``pickle`` rules).

        Args:
            key: Name of the value.
            timeout: Seconds for the look-up on the owner; None: the world's
                ``rpc_timeout``.

        Returns:
            A ``torch.distributed.rpc.RRef``; when the owner restarted its RPC agent (or
            built a second World in its process), a wrapper that behaves as one.

        Raises:
            KeyError: nothing is paired under ``key``.
            TimeoutError, PeerLostError: the owner did not answer / is gone (named).
        """
        _check_key(key)
        d = self._check_usable(need_member=False)
        wait = self._timeout(d, timeout)
        deadline = time.monotonic() + wait
        for refresh in (False, True):
            member = self._lookup_value(d, key, refresh)
            if member is None:
                break
            value = sync_call(d.roster, d.waits, member, _calls._paired_rref, (self._sid + key,), max(0.001, deadline_left(deadline)),
                               f"value {key!r} of group {self._name!r}", wait)
            if is_stale(value):  # the owner restarted its RPC agent: this side makes the RRef
                d.roster.pipes.called(member)
                rref = rpc.remote(member, _calls._paired_value, args=(self._sid + key,),
                                  timeout=max(0.001, deadline_left(deadline)))
                return RenewedOwnerRRef(rref, member, self._sid + key)
            if not is_missing(value):
                return value
        raise KeyError(f"Value with key [{key}] not found on Group [{self._name}]")
