"""RpcGroup: a named set of members that register services and pair values.

Who owns a key lives in the world's store (kept by ``_membership``); callers cache owners
and correct the cache when it went stale: an owner that no longer holds the key answers
"missing" (or is known to be gone), the caller looks the key up again and retries once,
within the same deadline. A cached call is therefore a single RPC round trip, like a raw
``rpc_sync``. A member that dies has its keys freed by the liveness monitor, so a survivor
can take them over.

Store keys of one group incarnation (``epoch`` counts re-creations of the name; an open
group, created with ``members=None``, has the epoch ``o``):

    <ns>rg/<group>/current                  "<epoch>/<members>" ("*" for an open group)
    <ns>rg/<group>/<epoch>/join/<member>    member lists, written at creation
    <ns>rg/<group>/<epoch>/s/<key>          service owner:  "s:<worker>" | "a:<worker>"
    <ns>rg/<group>/<epoch>/v/<key>          value owner:    "<worker>"
    <ns>rg/<group>/<epoch>/bar/<gen>/<m>    barrier arrivals

``<worker>`` is the owner's RPC worker name: its member name in a static world; in an
elastic world ``<name with '_' for '-'>_<unique id>``, new for every incarnation.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple, Union

from torch.distributed import rpc

from . import _calls, _checks, _samehost
from ._calls import RpcFuture, is_async, is_missing, is_stale, ship_function, translate_error, unwrap
from ._membership import Membership
from ._paired import RenewedOwnerRRef
from ._registry import deadline_left
from ._state import require_world
from ..exception import PeerLostError

__all__ = ["RpcGroup", "check_group_name", "create_group", "open_group"]


def check_group_name(name: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"group name must be a str, not {type(name).__name__}")
    if not name or "/" in name or "," in name:
        raise ValueError(f"group name {name!r} must be non-empty and contain no '/' or ','")


_check_key = _checks.service_key


def _membership() -> Membership:
    return require_world().membership


def create_group(members_view: Membership, name: str, members: Sequence[str], wait: float) -> "RpcGroup":
    """Create group ``name`` over ``members`` (every member calls this); see ``World.create_rpc_group``."""
    check_group_name(name)
    deadline = time.monotonic() + wait
    members = sorted(members)
    if members_view.elastic and len(set(members)) == len(members):
        # Members of an elastic world may still be on their way: wait for them, but not
        # for one that already left or was lost (that fails now, naming it).
        try:
            members_view.wait_until(lambda live: set(members) <= set(live)
                                    or any(members_view.gone(m) for m in members), wait)
        except TimeoutError:
            pass  # named below
        for member in members:
            why = members_view.gone(member)
            if why:
                verb = "left" if why == "left" else "was lost from"
                raise PeerLostError(member, f"creating RpcGroup {name!r}: it {verb} the world; wait for its "
                                            f"return (World.wait_for_members) before grouping with it")
    live = members_view.members()
    unknown = [m for m in members if m not in live]
    if unknown or len(set(members)) != len(members) or not members:
        if members_view.elastic and len(set(members)) == len(members):
            raise TimeoutError(f"creating RpcGroup {name!r}: {unknown} did not join the world within {wait:g} s")
        raise ValueError(f"members={members!r} must be distinct names of live world members ({live}); "
                         f"unknown: {unknown}")
    if members_view.name not in members:
        raise ValueError(f"this process ({members_view.name!r}) is not in members={members}; "
                         f"only members create the group")
    if name in members_view.groups:
        raise ValueError(f"RpcGroup {name!r} already exists here; destroy() it before creating it again")
    epoch = members_view.group_epochs.get(name, 0)
    members_view.group_epochs[name] = epoch + 1
    prefix = members_view.key(f"rg/{name}/{epoch}/join/")
    listing = ",".join(members)
    # In an elastic world the group is made of these incarnations: one that dies and
    # comes back is a new process, gone for this group (it creates a new one).
    incarnations = members_view.incarnations(members) if members_view.elastic else None
    members_view.registry.set(prefix + members_view.name, listing)
    members_view.wait_all(prefix, members, members, max(0.001, deadline_left(deadline)),
                          f"creating RpcGroup {name!r}: members", wait, incarnations)
    odd = [m for m, v in zip(members, members_view.registry.values(prefix, members)) if v != listing]
    if odd:
        raise ValueError(f"members of RpcGroup {name!r} disagree: {odd} passed other member lists")
    members_view.registry.set(members_view.key(f"rg/{name}/current"), f"{epoch}/{listing}")
    group = RpcGroup(name, members, str(epoch), incarnations)
    members_view.groups[name] = group
    return group


def open_group(members_view: Membership, name: str) -> "RpcGroup":
    """Join the open group ``name`` (whoever is in the world); returns at once."""
    check_group_name(name)
    if name in members_view.groups:
        raise ValueError(f"RpcGroup {name!r} already exists here; destroy() it before creating it again")
    held = members_view.registry.compare_set(members_view.key(f"rg/{name}/current"), "", "o/*")
    if held != "o/*":
        raise ValueError(f"RpcGroup {name!r} exists with fixed members ({held.split('/', 1)[1]}); "
                         f"open groups (members=None) need a name of their own")
    group = RpcGroup(name, None, "o")
    members_view.groups[name] = group
    return group


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

    def __init__(self, name: str, members: Optional[Sequence[str]], epoch: str,
                 incarnations: Optional[Dict[str, int]] = None) -> None:
        self._name = name
        self._incarnations = incarnations
        #: None for an open group: whoever is in the world.
        self._members = None if members is None else tuple(sorted(members))
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
        return f"<RpcGroup {self._name!r} members={'(open)' if self._members is None else list(self._members)}>"

    # ------------------------------------------------------------------ plumbing
    def _key(self, world: Any, kind: str, key: str) -> str:
        return world.membership.key(f"rg/{self._sid}{kind}/{key}")

    def _timeout(self, world: Any, timeout: Optional[float]) -> float:
        return _checks.seconds_or_none("timeout", timeout, world.rpc_timeout)

    def _has(self, world: Any, name: str) -> bool:
        return name in world.get_members() if self._members is None else name in self._members

    def _check_usable(self, need_member: bool) -> Any:
        world = require_world()
        if self._destroyed:
            raise RuntimeError(f"RpcGroup {self._name!r} has been destroyed")
        if need_member and not self._has(world, world.name):
            raise RuntimeError(f"this process ({world.name!r}) is not a member of RpcGroup {self._name!r}")
        return world

    def _lookup(self, world: Any, cache: Dict[str, str], kind: str, key: str, refresh: bool) -> Optional[str]:
        members = world.membership
        if not refresh:
            held = cache.get(key)
            if held is not None and not members.transport_gone(held.partition(":")[2] if kind == "s" else held):
                return held
        held = members.owner(self._key(world, kind, key))
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

    def _sync(self, worker: str, entry: Any, args: Tuple, timeout: float, what: str,
              stated: Optional[float] = None) -> Any:
        """One blocking call; ``stated`` is the caller's timeout to quote (None: ``timeout``)."""
        members = require_world().membership
        if members.transport_gone(worker):
            raise PeerLostError(members.member_of(worker), f"{what}: it left or was lost")
        try:
            if members.on_this_host(worker):
                # A dead process here closes its sockets: the call fails at once by itself.
                return rpc.rpc_sync(worker, entry, args=args, timeout=timeout)
            # Another host may vanish without a word: the liveness monitor ends the wait.
            return members.wait_call(rpc.rpc_async(worker, entry, args=args, timeout=timeout), worker, what)
        except RuntimeError as err:
            raise translate_error(err, members.member_of(worker), what,
                                  timeout if stated is None else stated) from err

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
        holder = f"{'a' if is_async(service) else 's'}:{world.membership.transport}"
        with self._lock:
            if key in self._my_services:
                raise KeyError(f"Service [{key}] already registered in Group [{self._name}] (by this member)")
            world.membership.tables.services[self._sid + key] = service
            taken = world.membership.claim(self._key(world, "s", key), holder)
            if taken is not None:
                del world.membership.tables.services[self._sid + key]
                raise KeyError(f"Service [{key}] already registered in Group [{self._name}] "
                               f"(by member {world.membership.member_of(taken[2:])!r})")
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
            world.membership.release(self._key(world, "s", key), self._service_owners.get(key, ""))
            self._my_services.discard(key)
            self._service_owners.pop(key, None)
            world.membership.tables.services.pop(self._sid + key, None)

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
        call = (self._sid + key,) + _checks.call_args(args, kwargs)
        deadline = time.monotonic() + wait  # a retry after a stale owner shares it
        for refresh in (False, True):
            member, entry = self._service_target(world, key, refresh)
            left = max(0.001, deadline_left(deadline))
            value = self._sync(member, entry, _samehost.outgoing(member, call), left,  # [shm hook]
                               f"service {key!r} of group {self._name!r}", wait)
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
        call = (self._sid + key,) + _checks.call_args(args, kwargs)
        member, entry = self._service_target(world, key)
        fut = rpc.rpc_async(member, entry, args=_samehost.outgoing(member, call), timeout=wait)  # [shm hook]
        return RpcFuture(fut, world.membership.member_of(member), f"service {key!r} of group {self._name!r}", wait,
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
        call = (self._sid + key,) + _checks.call_args(args, kwargs)
        wait = self._timeout(world, timeout)
        member, _ = self._service_target(world, key)
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
        world = self._check_usable(need_member=True)
        with self._lock:
            if key in self._my_values:
                raise KeyError(f"Value with key [{key}] already paired to Group [{self._name}] (by this member)")
            world.membership.tables.values[self._sid + key] = value
            me = world.membership.transport
            taken = world.membership.claim(self._key(world, "v", key), me)
            if taken is not None:
                del world.membership.tables.values[self._sid + key]
                raise KeyError(f"Value with key [{key}] already paired to Group [{self._name}] "
                               f"(by member {world.membership.member_of(taken)!r})")
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
        world = self._check_usable(need_member=True)
        with self._lock:
            if key not in self._my_values:
                raise KeyError(f"Value with key [{key}] not paired to Group [{self._name}] by member {world.name!r}")
            world.membership.release(self._key(world, "v", key), world.membership.transport)
            self._my_values.discard(key)
            self._value_owners.pop(key, None)
            world.membership.tables.values.pop(self._sid + key, None)

    def is_paired(self, key: str) -> bool:
        """Whether any member paired a value under ``key`` (asks the store).

        Args:
            key: Name of the value.
        """
        _check_key(key)
        world = self._check_usable(need_member=False)
        return self._lookup(world, self._value_owners, "v", key, refresh=True) is not None

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
        world = self._check_usable(need_member=False)
        wait = self._timeout(world, timeout)
        deadline = time.monotonic() + wait
        for refresh in (False, True):
            member = self._lookup(world, self._value_owners, "v", key, refresh)
            if member is None:
                break
            value = self._sync(member, _calls._paired_rref, (self._sid + key,), max(0.001, deadline_left(deadline)),
                               f"value {key!r} of group {self._name!r}", wait)
            if is_stale(value):  # the owner restarted its RPC agent: this side makes the RRef
                rref = rpc.remote(member, _calls._paired_value, args=(self._sid + key,),
                                  timeout=max(0.001, deadline_left(deadline)))
                return RenewedOwnerRRef(rref, member, self._sid + key)
            if not is_missing(value):
                return value
        raise KeyError(f"Value with key [{key}] not found on Group [{self._name}]")

    # ---------------------------------------------------------------- plain calls
    def _target(self, to: str) -> str:
        """The RPC worker of member ``to``; refuses non-members, fails fast for the gone."""
        world = require_world()
        if not isinstance(to, str):
            raise TypeError(f"to must be a member name (str), not {type(to).__name__} ({to!r})")
        if self._members is not None and to not in self._members:
            raise ValueError(f"{to!r} is not a member of RpcGroup {self._name!r} (members: {list(self._members)})")
        return world.membership.transport_of(to)

    def _prepare(self, func: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]]) -> Tuple:
        if not callable(func):
            raise TypeError(f"func must be callable, not {type(func).__name__}")
        return (ship_function(func),) + _checks.call_args(args, kwargs)

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
        wait = self._timeout(self._check_usable(need_member=False), timeout)
        call = self._prepare(func, args, kwargs)
        entry = _calls._run_async if is_async(func) else _calls._run
        worker = self._target(to)
        return unwrap(self._sync(worker, entry, _samehost.outgoing(worker, call), wait,  # [shm hook]
                                 f"rpc_sync of {func!r}"))

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
        wait = self._timeout(self._check_usable(need_member=False), timeout)
        call = self._prepare(func, args, kwargs)
        entry = _calls._run_async if is_async(func) else _calls._run
        worker = self._target(to)
        fut = rpc.rpc_async(worker, entry, args=_samehost.outgoing(worker, call), timeout=wait)  # [shm hook]
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
        wait = self._timeout(self._check_usable(need_member=False), timeout)
        call = self._prepare(func, args, kwargs)
        entry = _calls._run_bare_async if is_async(func) else _calls._run_bare
        worker = self._target(to)
        return rpc.remote(worker, entry, args=_samehost.outgoing(worker, call), timeout=wait)  # [shm hook]

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
        if self._members is None:
            raise RuntimeError(f"RpcGroup {self._name!r} is open (members=None), so a barrier has no fixed "
                               f"set of members to wait for; create a group with members=[...] for barriers")
        wait = _checks.seconds_or_none("timeout", timeout, world.dist_timeout)
        deadline = time.monotonic() + wait
        members = world.membership
        # Rounds of one member run one at a time, which is what makes deleting the
        # previous round's key safe: whoever passed round g had every member leave g - 1.
        if not self._barrier_lock.acquire(timeout=wait):
            raise TimeoutError(f"barrier of RpcGroup {self._name!r}: an earlier round of this member "
                               f"did not finish within {wait:g} s")
        try:
            generation = self._barrier_gen
            self._barrier_gen += 1
            prefix = self._key(world, "bar", f"{generation}/")
            members.registry.set(prefix + world.name, "1")
            members.wait_all(prefix, self._members, self._members, max(0.001, deadline_left(deadline)),
                             f"barrier of RpcGroup {self._name!r}: members", wait, self._incarnations)
            if generation:
                members.registry.delete([self._key(world, "bar", f"{generation - 1}/{world.name}")])
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
        world = require_world()
        with self._lock:
            if self._destroyed:
                return
            for key in list(self._my_services):
                world.membership.release(self._key(world, "s", key), self._service_owners.get(key, ""))
                world.membership.tables.services.pop(self._sid + key, None)
            for key in list(self._my_values):
                world.membership.release(self._key(world, "v", key), world.membership.transport)
                world.membership.tables.values.pop(self._sid + key, None)
            self._my_services.clear()
            self._my_values.clear()
            # The last barrier key stays: a slower member may still be waiting on it.
            self._destroyed = True
        if world.membership.groups.get(self._name) is self:
            del world.membership.groups[self._name]

    # ------------------------------------------------------------------ accessors
    def size(self) -> int:
        """Number of members (of an open group: live members of the world)."""
        return len(self.get_group_members())

    def is_member(self, name: Optional[str] = None) -> bool:
        """Whether ``name`` is a member.

        Args:
            name: A member name; None: this process.
        """
        world = require_world()
        return self._has(world, world.name if name is None else name)

    def get_group_name(self) -> str:
        """Name of the group."""
        return self._name

    def get_group_members(self) -> List[str]:
        """Member names, sorted (of an open group: the live members of the world)."""
        return require_world().get_members() if self._members is None else list(self._members)

    def get_cur_name(self) -> str:
        """This process's member name."""
        return require_world().name


def _rebuild_group(name: str, members: Sequence[str], epoch: int) -> RpcGroup:
    from . import _state

    world = _state.current
    if world is not None:
        local = world.membership.groups.get(name)
        if local is not None and local._epoch == epoch:
            return local
    return RpcGroup(name, members, epoch)
