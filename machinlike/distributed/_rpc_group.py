"""RpcGroup: a named set of members that register services and pair values.

Who owns a key lives in the world's store (see ``_registry``); callers cache owners and
correct the cache when it went stale: an owner that no longer holds the key answers
"missing", the caller looks the key up again and retries once. A cached call is therefore
a single RPC round trip, like a raw ``rpc_sync``.

Store keys of one group incarnation (``epoch`` counts re-creations of the name):

    mlk/<n>/rg/<group>/<epoch>/join/<member>   member lists, written at creation
    mlk/<n>/rg/<group>/<epoch>/s/<key>         service owner:  "s:<member>" | "a:<member>"
    mlk/<n>/rg/<group>/<epoch>/v/<key>         value owner:    "<member>"
    mlk/<n>/rg/<group>/<epoch>/bar/<gen>/<m>   barrier arrivals
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from torch.distributed import rpc

from . import _calls, _samehost
from ._state import require_world
from ._calls import RpcFuture, is_async, is_missing, ship_function, translate_error, unwrap

__all__ = ["RpcGroup", "check_group_name"]


def check_group_name(name: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"group name must be a str, not {type(name).__name__}")
    if not name or "/" in name or "," in name:
        raise ValueError(f"group name {name!r} must be non-empty and contain no '/' or ','")


def _check_key(key: str) -> None:
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, not {type(key).__name__} ({key!r})")


_world = require_world


class RpcGroup:
    """A group of world members; create it with :meth:`World.create_rpc_group`.

    Members publish services (:meth:`register`) and values (:meth:`pair`) under string
    keys, unique in the group; any process of the world calls them by key. Who owns a
    key is kept in the world's store and cached by callers, so a call is one RPC round
    trip.

    The handle pickles by name, so it can travel inside service accessors; unpickled in a
    member process it is that process's own group object.

    Every method raises ``RuntimeError`` when this process has no World or the group was
    destroyed here; ``register``, ``deregister``, ``pair``, ``unpair`` and ``barrier``
    also when this process is not a member. A ``timeout`` is in seconds and must be
    positive (``ValueError`` otherwise); None means the World's ``rpc_timeout`` for calls
    and its ``dist_timeout`` for barriers. Keys must be str (``TypeError`` otherwise).
    """

    def __init__(self, name: str, members: Sequence[str], epoch: int) -> None:
        self._name = name
        self._members = tuple(sorted(members))
        self._epoch = epoch
        self._sid = f"{name}/{epoch}/"
        self._lock = threading.Lock()
        self._barrier_lock = threading.Lock()
        self._barrier_gen = 0
        self._service_owners: Dict[str, str] = {}
        self._value_owners: Dict[str, str] = {}
        self._my_services: Set[str] = set()
        self._my_values: Set[str] = set()
        self._destroyed = False

    def __reduce__(self) -> Any:
        return _rebuild_group, (self._name, self._members, self._epoch)

    def __repr__(self) -> str:
        return f"<RpcGroup {self._name!r} members={list(self._members)}>"

    # ------------------------------------------------------------------ plumbing
    def _key(self, world: Any, kind: str, key: str) -> str:
        return f"{world._ns}rg/{self._sid}{kind}/{key}"

    def _timeout(self, world: Any, timeout: Optional[float]) -> float:
        if timeout is None:
            return world.rpc_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds (or None)")
        return float(timeout)

    def _check_usable(self, need_member: bool) -> Any:
        world = _world()
        if self._destroyed:
            raise RuntimeError(f"RpcGroup {self._name!r} has been destroyed")
        if need_member and world.name not in self._members:
            raise RuntimeError(f"this process ({world.name!r}) is not a member of RpcGroup {self._name!r}")
        return world

    def _lookup(self, world: Any, cache: Dict[str, str], kind: str, key: str, refresh: bool) -> Optional[str]:
        if not refresh:
            held = cache.get(key)
            if held is not None:
                return held
        held = world._registry.owner(self._key(world, kind, key))
        if held is None:
            cache.pop(key, None)
        else:
            cache[key] = held
        return held

    def _service_target(self, world: Any, key: str, refresh: bool = False) -> Tuple[str, Callable[..., Any]]:
        held = self._lookup(world, self._service_owners, "s", key, refresh)
        if held is None:
            raise KeyError(f"Service [{key}] not found on Group [{self._name}]")
        entry = _calls._call_async_service if held[0] == "a" else _calls._call_service
        return held[2:], entry

    def _sync(self, member: str, entry: Any, args: Tuple, timeout: float, what: str) -> Any:
        try:
            return rpc.rpc_sync(member, entry, args=args, timeout=timeout)
        except RuntimeError as err:
            raise translate_error(err, member, what, timeout) from err

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
        world = self._check_usable(need_member=True)
        holder = f"{'a' if is_async(service) else 's'}:{world.name}"
        with self._lock:
            if key in self._my_services:
                raise KeyError(f"Service [{key}] already registered in Group [{self._name}] (by this member)")
            world._tables.services[self._sid + key] = service
            taken = world._registry.claim(self._key(world, "s", key), holder)
            if taken is not None:
                del world._tables.services[self._sid + key]
                raise KeyError(f"Service [{key}] already registered in Group [{self._name}] "
                               f"(by member {taken[2:]!r})")
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
        world = self._check_usable(need_member=True)
        with self._lock:
            if key not in self._my_services:
                raise KeyError(f"Service [{key}] not registered in Group [{self._name}] by member {world.name!r}")
            world._registry.release(self._key(world, "s", key), self._service_owners.get(key, ""))
            self._my_services.discard(key)
            self._service_owners.pop(key, None)
            world._tables.services.pop(self._sid + key, None)

    def is_registered(self, key: str) -> bool:
        """Whether any member holds a service under ``key`` (asks the store).

        Args:
            key: Name of the service.
        """
        _check_key(key)
        world = self._check_usable(need_member=False)
        return self._lookup(world, self._service_owners, "s", key, refresh=True) is not None

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
        world = self._check_usable(need_member=False)
        wait = self._timeout(world, timeout)
        call = (self._sid + key, tuple(args), kwargs or {})
        for refresh in (False, True):
            member, entry = self._service_target(world, key, refresh)
            value = self._sync(member, entry, _samehost.outgoing(member, call), wait,  # [shm hook]
                               f"service {key!r} of group {self._name!r}")
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
        world = self._check_usable(need_member=False)
        wait = self._timeout(world, timeout)
        member, entry = self._service_target(world, key)
        call = _samehost.outgoing(member, (self._sid + key, tuple(args), kwargs or {}))  # [shm hook]
        fut = rpc.rpc_async(member, entry, args=call, timeout=wait)
        return RpcFuture(fut, member, f"service {key!r} of group {self._name!r}", wait,
                         retry=lambda: self.registered_sync(key, args, kwargs, timeout))

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
        world = self._check_usable(need_member=False)
        member, _ = self._service_target(world, key)
        call = _samehost.outgoing(member, (self._sid + key, tuple(args), kwargs or {}))  # [shm hook]
        return rpc.remote(member, _calls._remote_service, args=call,
                          timeout=self._timeout(world, timeout))

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
        world = self._check_usable(need_member=True)
        with self._lock:
            if key in self._my_values:
                raise KeyError(f"Value with key [{key}] already paired to Group [{self._name}] (by this member)")
            world._tables.values[self._sid + key] = value
            taken = world._registry.claim(self._key(world, "v", key), world.name)
            if taken is not None:
                del world._tables.values[self._sid + key]
                raise KeyError(f"Value with key [{key}] already paired to Group [{self._name}] (by member {taken!r})")
            self._my_values.add(key)
            self._value_owners[key] = world.name

    def unpair(self, key: str) -> None:
        """Withdraw a value this member paired.

        Args:
            key: Name of the value.

        Raises:
            KeyError: this member has not paired ``key``.
        """
        _check_key(key)
        world = self._check_usable(need_member=True)
        with self._lock:
            if key not in self._my_values:
                raise KeyError(f"Value with key [{key}] not paired to Group [{self._name}] by member {world.name!r}")
            world._registry.release(self._key(world, "v", key), world.name)
            self._my_values.discard(key)
            self._value_owners.pop(key, None)
            world._tables.values.pop(self._sid + key, None)

    def is_paired(self, key: str) -> bool:
        """Whether any member paired a value under ``key`` (asks the store).

        Args:
            key: Name of the value.
        """
        _check_key(key)
        world = self._check_usable(need_member=False)
        return self._lookup(world, self._value_owners, "v", key, refresh=True) is not None

    def get_paired(self, key: str, timeout: Optional[float] = None) -> rpc.RRef:
        """An RRef to the value paired under ``key`` (owned by the member that paired it).

        ``rref.rpc_sync().method(...)`` runs a method of the value on its owner;
        ``rref.to_here()`` copies it with torch's pickler (standard ``pickle`` rules).

        Args:
            key: Name of the value.
            timeout: Seconds for the look-up on the owner; None: the world's
                ``rpc_timeout``.

        Returns:
            A ``torch.distributed.rpc.RRef``.

        Raises:
            KeyError: nothing is paired under ``key``.
            TimeoutError, PeerLostError: the owner did not answer / is gone (named).
        """
        _check_key(key)
        world = self._check_usable(need_member=False)
        wait = self._timeout(world, timeout)
        for refresh in (False, True):
            member = self._lookup(world, self._value_owners, "v", key, refresh)
            if member is None:
                break
            value = self._sync(member, _calls._paired_rref, (self._sid + key,), wait,
                               f"value {key!r} of group {self._name!r}")
            if not is_missing(value):
                return value
        raise KeyError(f"Value with key [{key}] not found on Group [{self._name}]")

    # ---------------------------------------------------------------- plain calls
    def _target(self, to: str) -> None:
        if to not in self._members:
            raise ValueError(f"{to!r} is not a member of RpcGroup {self._name!r} (members: {list(self._members)})")

    def _prepare(self, func: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]]) -> Tuple:
        if not callable(func):
            raise TypeError(f"func must be callable, not {type(func).__name__}")
        return ship_function(func), tuple(args), kwargs or {}

    def rpc_sync(self, to: str, func: Callable[..., Any], timeout: Optional[float] = None,
                 args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        """Run ``func(*args, **kwargs)`` on member ``to`` and return the result.

        ``func`` may be a lambda or local function (sent with dill); tensors in ``args``
        travel as tensors. A ``func`` decorated with
        ``@torch.distributed.rpc.functions.async_execution`` may return a future.

        Args:
            to: Name of a member of this group.
            func: The callable to run there.
            timeout: Seconds; None: the world's ``rpc_timeout``.
            args: Positional arguments of ``func``.
            kwargs: Keyword arguments of ``func``; None: none.

        Returns:
            What ``func`` returned.

        Raises:
            ValueError: ``to`` is not a member of the group.
            TypeError: ``func`` is not callable.
            TimeoutError, PeerLostError: ``to`` did not answer in time / is gone (named).
            Exception: whatever ``func`` raised, with its remote traceback as cause.
        """
        self._target(to)
        wait = self._timeout(self._check_usable(need_member=False), timeout)
        entry = _calls._run_async if is_async(func) else _calls._run
        call = _samehost.outgoing(to, self._prepare(func, args, kwargs))  # [shm hook]
        return unwrap(self._sync(to, entry, call, wait, f"rpc_sync of {func!r}"))

    def rpc_async(self, to: str, func: Callable[..., Any], timeout: Optional[float] = None,
                  args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None) -> RpcFuture:
        """Like :meth:`rpc_sync` but returns at once; ``wait()`` on the result.

        Args:
            to: Name of a member of this group.
            func: The callable to run there.
            timeout: Seconds, counted from now; None: the world's ``rpc_timeout``.
            args: Positional arguments of ``func``.
            kwargs: Keyword arguments of ``func``; None: none.

        Returns:
            An :class:`RpcFuture` whose ``wait()`` returns the result or raises what
            :meth:`rpc_sync` would.

        Raises:
            ValueError: ``to`` is not a member of the group.
            TypeError: ``func`` is not callable.
        """
        self._target(to)
        wait = self._timeout(self._check_usable(need_member=False), timeout)
        entry = _calls._run_async if is_async(func) else _calls._run
        fut = rpc.rpc_async(to, entry, args=_samehost.outgoing(to, self._prepare(func, args, kwargs)),  # [shm hook]
                            timeout=wait)
        return RpcFuture(fut, to, f"rpc_async of {func!r}", wait)

    def remote(self, to: str, func: Callable[..., Any], timeout: Optional[float] = None,
               args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None) -> rpc.RRef:
        """Run ``func`` on member ``to`` and return an RRef to the result at once.

        Errors of ``func`` surface from ``rref.to_here()`` as torch reports them.

        Args:
            to: Name of a member of this group.
            func: The callable to run there.
            timeout: Seconds for creating the result on ``to``; None: the world's
                ``rpc_timeout``.
            args: Positional arguments of ``func``.
            kwargs: Keyword arguments of ``func``; None: none.

        Returns:
            A ``torch.distributed.rpc.RRef`` owned by ``to``.

        Raises:
            ValueError: ``to`` is not a member of the group.
            TypeError: ``func`` is not callable.
        """
        self._target(to)
        wait = self._timeout(self._check_usable(need_member=False), timeout)
        entry = _calls._run_bare_async if is_async(func) else _calls._run_bare
        return rpc.remote(to, entry, args=_samehost.outgoing(to, self._prepare(func, args, kwargs)),  # [shm hook]
                          timeout=wait)

    # -------------------------------------------------------------------- barrier
    def barrier(self, timeout: Optional[float] = None) -> None:
        """Wait until every member reached this barrier (thread-safe, reusable).

        Two threads of one member calling it are two successive rounds.

        Args:
            timeout: Seconds; None: the world's ``dist_timeout``.

        Raises:
            TimeoutError: naming the members that did not arrive within ``timeout``.
        """
        world = self._check_usable(need_member=True)
        wait = world.dist_timeout if timeout is None else self._timeout(world, timeout)
        deadline = time.monotonic() + wait
        # Rounds of one member run one at a time, which is what makes deleting the
        # previous round's key safe (see Registry.barrier).
        if not self._barrier_lock.acquire(timeout=wait):
            raise TimeoutError(f"barrier of RpcGroup {self._name!r}: an earlier round of this member "
                               f"did not finish within {wait:g} s")
        try:
            generation = self._barrier_gen
            self._barrier_gen += 1
            world._registry.barrier(
                f"{world._ns}rg/{self._sid}bar", generation, world.name, self._members,
                max(0.001, deadline - time.monotonic()), f"barrier of RpcGroup {self._name!r}: members", wait)
        finally:
            self._barrier_lock.release()

    # ------------------------------------------------------------------ lifecycle
    def destroy(self) -> None:
        """Withdraw every service and value this member owns and leave the group.

        The group name can be created again once every member destroyed its handle.
        Safe to call twice.

        Raises:
            RuntimeError: this process has no World.
        """
        world = _world()
        with self._lock:
            if self._destroyed:
                return
            for key in list(self._my_services):
                world._registry.release(self._key(world, "s", key), self._service_owners.get(key, ""))
                world._tables.services.pop(self._sid + key, None)
            for key in list(self._my_values):
                world._registry.release(self._key(world, "v", key), world.name)
                world._tables.values.pop(self._sid + key, None)
            self._my_services.clear()
            self._my_values.clear()
            # The last barrier key stays: a slower member may still be waiting on it.
            self._destroyed = True
        world._forget_group(self)

    # ------------------------------------------------------------------ accessors
    def size(self) -> int:
        """Number of members."""
        return len(self._members)

    def is_member(self, name: Optional[str] = None) -> bool:
        """Whether ``name`` is a member.

        Args:
            name: A member name; None: this process.
        """
        return (_world().name if name is None else name) in self._members

    def get_group_name(self) -> str:
        """Name of the group."""
        return self._name

    def get_group_members(self) -> List[str]:
        """Member names, sorted."""
        return list(self._members)

    def get_cur_name(self) -> str:
        """This process's member name."""
        return _world().name


def _rebuild_group(name: str, members: Sequence[str], epoch: int) -> RpcGroup:
    from . import _state

    world = _state.current
    if world is not None:
        local = world._groups.get(name)
        if local is not None and local._epoch == epoch:
            return local
    return RpcGroup(name, members, epoch)
