"""RpcGroup: a named set of members that register services and pair values.

``RpcGroup`` is the public façade (machin's names and keywords): it checks every argument
once, at this entrance, and hands checked values to its parts. It owns the group's
identity (name, members, epoch), whether it was destroyed here, and its
``GroupParts`` (``parts``) for the World in use: small objects that each own
their state, built together and handed their collaborators in their constructors::

    RpcGroup (façade: checks, docstrings, destroyed?) ── GroupParts, for one World:
      ├─ OwnerCache     who owns each service / value key, cached      owners
      ├─ OwnedKeys      the services this member registered; its lock  tables (SERVICES)
      ├─ OwnedKeys      the values this member paired; its lock        tables (VALUES)
      ├─ Caller         every call sent: to a key's owner, to a member caller
      └─ Barrier        this member's barrier rounds; its lock         barrier

A handle that was unpickled or built by hand, or whose World stopped, uses the current
World's directory at each use (as it always did); its parts are rebuilt when that
directory changes, so no cache or round counter outlives its World. The hot path pays
one identity test for it. Creating, opening and finding a group: ``create``; the
group's store keys: ``_store.keys`` (``rg/<group>/...``).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

from torch.distributed import rpc

from ... import _checks
from .._calls import RpcFuture, as_async_execution, is_coroutine_function, prepare_call
from . import directory as _directory
from .directory import GroupDirectory
from .parts import GroupParts
from .arrival import wait_paired, wait_registered
from .group_end import end_incarnation
from .._calls import PairedRef, ResultRef

__all__ = ["RpcGroup"]

_check_key = _checks.service_key
_seconds = _checks.seconds_or_none


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
                 incarnations: Optional[Dict[str, int]] = None, *,
                 directory: Optional[GroupDirectory] = None, outsider: bool = False) -> None:
        # None (an unpickled or hand-made handle): the current World's, at each use.
        self._dir = directory
        # A handle that create_rpc_group did not make here (get_rpc_group's, an unpickled
        # one): this process never acts as a member through it, even when listed (it
        # destroyed its own handle, or has not created the group yet), for what it
        # registered would outlive the member's count-out and be left in the store.
        self._outsider = outsider
        self._name = name
        self._incarnations = incarnations
        #: None for an open group: whoever is in the world.
        self._members = None if members is None else tuple(sorted(members))
        self._epoch = epoch
        # Guards building the parts and destroying (not the calls: the parts lock their own state).
        self._lock = threading.Lock()
        self._parts: Optional[GroupParts] = None
        if directory is not None:
            self._parts = GroupParts(name, self._members, epoch, incarnations, directory)
        self._destroyed = False

    def __reduce__(self) -> Any:
        return _rebuild_group, (self._name, self._members, self._epoch)

    def __repr__(self) -> str:
        return f"<RpcGroup {self._name!r} members={'(open)' if self._members is None else list(self._members)}>"

    # ------------------------------------------------------------------ plumbing
    def _directory(self) -> GroupDirectory:
        d = self._dir
        if d is None or not d.open:
            d = self._current()  # its World stopped: the current one's, as before
        return d

    def _current(self) -> GroupDirectory:
        """This process's World's directory, for a handle without one or whose World stopped.

        Raises:
            RuntimeError: no World runs here; naming the one this handle belonged to when
                that one was stopped (it was "a pool worker or a child process has not").
        """
        if self._dir is not None and _directory.current() is None:
            raise RuntimeError(f"World {self._dir.name!r} of this process has been stopped: RpcGroup {self._name!r} "
                               f"belonged to it; create a new World (and its groups) to call again")
        return _directory.require(f"RpcGroup {self._name!r}")

    def _usable(self, need_member: bool) -> GroupParts:
        """The parts for the directory in use (built when it changed), if this handle may be used."""
        d = self._dir
        if d is None or not d.open:
            d = self._current()
        parts = self._parts
        if parts is None or parts.directory is not d:
            parts = self._bind(d)
        if self._destroyed:
            raise RuntimeError(f"RpcGroup {self._name!r} has been destroyed")
        if need_member and not self._has(d, d.name):
            cut = d.roster.cut_off
            if cut is not None and self._members is None:
                # (an open group lists the live: the others declared this member lost, and
                # "not a member" would hide why; CI once)
                raise cut
            raise RuntimeError(self._not_member(d))
        return parts

    def _not_member(self, d: GroupDirectory) -> str:
        if self._outsider and self._has_listed(d.name):
            return (f"this handle of RpcGroup {self._name!r} was not made by this process's create_rpc_group "
                    f"({d.name!r} destroyed its own handle, or has not created the group yet): register, pair "
                    f"and barrier through the handle that create_rpc_group returned here")
        if self._members is None and d.roster.gone(d.name) == "lost":
            return (f"this process ({d.name!r}) is not a member of RpcGroup {self._name!r} any more: the others "
                    f"declared it lost (its heartbeat stopped for longer than the world's "
                    f"liveness bound); give World(liveness=...) a longer bound, or leave and join again")
        return f"this process ({d.name!r}) is not a member of RpcGroup {self._name!r}"

    def _bind(self, d: GroupDirectory) -> GroupParts:
        with self._lock:  # two threads moving to a new World share one set of parts
            parts = self._parts
            if parts is None or parts.directory is not d:
                parts = self._parts = GroupParts(self._name, self._members, self._epoch, self._incarnations, d)
            return parts

    def _has(self, d: GroupDirectory, name: str) -> bool:
        if name == d.name and (self._outsider or self._destroyed):
            return False  # (this process is out of the group through this handle)
        return name in d.roster.members() if self._members is None else name in self._members

    def _has_listed(self, name: str) -> bool:
        return self._members is None or name in self._members

    def _check_to(self, to: str) -> None:
        if not isinstance(to, str):
            hint = ("; a handle's owner_name() gives its owner's (torch's owner() names an RPC worker, which is "
                    "not a member's name in an elastic world)" if isinstance(to, rpc.WorkerInfo) else "")
            raise TypeError(f"to must be a member name (str), not {type(to).__name__} ({to!r}){hint}")
        if self._members is not None and to not in self._members:
            raise ValueError(f"{to!r} is not a member of RpcGroup {self._name!r} (members: {list(self._members)})")

    # ------------------------------------------------------------------- services
    def register(self, key: str, service: Callable[..., Any]) -> None:
        """Publish ``service`` under ``key``; members call it with ``registered_*``.

        ``service`` may return a value or, when decorated with
        ``@torch.distributed.rpc.functions.async_execution``, a ``torch.futures.Future`` that
        it completes later without holding an RPC thread. It runs in this process, on an
        RPC thread, so it must be thread-safe. An ``async def`` service runs on this
        process's event loop thread instead, and may ``await`` other calls (a relay)
        without holding an RPC thread; it must not block that loop.

        Args:
            key: Name of the service, unique in the group.
            service: The callable (a function, bound method, lambda, ...).

        Raises:
            KeyError: ``key`` is already registered in the group (by any member).
            TypeError: ``service`` is not callable, or is an async generator function.
        """
        _check_key(key)
        if not callable(service):
            raise TypeError(f"service must be callable, not {type(service).__name__}")
        if is_coroutine_function(service):
            service = as_async_execution(service)
        _checks.not_async("service", service, "on an RPC thread")
        self._usable(need_member=True).services.add(key, service)

    def deregister(self, key: str) -> None:
        """Withdraw a service this member registered.

        Args:
            key: Name of the service.

        Raises:
            KeyError: this member has not registered ``key``.
        """
        _check_key(key)
        self._usable(need_member=True).services.withdraw(key)

    def is_registered(self, key: str) -> bool:
        """Whether any member holds a service under ``key`` (asks the store).

        Args:
            key: Name of the service.
        """
        _check_key(key)
        return self._usable(need_member=False).owners.service(key, refresh=True) is not None

    def wait_registered(self, key: str, timeout: Optional[float] = None) -> None:
        """Return once some member registers service ``key``: for members that start at
        their own pace (see :meth:`wait_paired`, which waits the same way).

        Args:
            key: Name of the service.
            timeout: Seconds for the whole wait; None: the world's ``dist_timeout``.

        Raises:
            TimeoutError: nobody registered ``key`` in time (named).
            PeerLostError: the world's store is gone; the member that registered ``key``
                left the world since (named: the service went with it).
        """
        _check_key(key)
        parts = self._usable(need_member=False)
        d = parts.directory
        wait_registered(parts.owners, d.registry, d.roster, d.departures, self._name, key,
                        _seconds("timeout", timeout, d.dist_timeout))

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
            TimeoutError, PeerLostError: the owner did not answer / is gone (named; also
                once its dead owner's registration was withdrawn, if this process had
                called it there, until some member registers ``key`` again).
            Exception: whatever the service raised, with its remote traceback as cause.
        """
        _check_key(key)
        parts = self._usable(False)
        wait = _seconds("timeout", timeout, parts.directory.rpc_timeout)
        return parts.caller.service_sync(key, _checks.call_args(args, kwargs), wait)

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
            PeerLostError: its owner, as this process last found it, was lost (as
                :meth:`registered_sync`).
        """
        _check_key(key)
        parts = self._usable(False)
        wait = _seconds("timeout", timeout, parts.directory.rpc_timeout)
        return parts.caller.service_async(key, _checks.call_args(args, kwargs), wait)

    def registered_remote(self, key: str, args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None,
                          timeout: Optional[float] = None) -> ResultRef:
        """Run the service ``key`` on its owner and return a handle to its result at once.

        The result stays on the owner while the handle (or a copy of it sent to another
        member) lives. The handle behaves as torch's RRef: ``to_here()`` copies the
        result, and raises what the service raised (its type, the remote traceback as
        ``__cause__``).

        Args:
            key: Name of the service.
            args: Positional arguments of the service.
            kwargs: Keyword arguments of the service; None: none.
            timeout: Seconds for creating the result on the owner; None: the world's
                ``rpc_timeout``.

        Returns:
            A :class:`~machinlike.distributed.ResultRef` owned by the service's owner.

        Raises:
            KeyError: no member registered ``key``.
            PeerLostError: its owner, as this process last found it, was lost (as
                :meth:`registered_sync`).
        """
        _check_key(key)
        parts = self._usable(False)
        call_args = _checks.call_args(args, kwargs)
        return parts.caller.service_remote(key, call_args, _seconds("timeout", timeout, parts.directory.rpc_timeout))

    # --------------------------------------------------------------------- values
    def pair(self, key: str, value: Any) -> None:
        """Publish ``value`` under ``key``; members reach it with ``get_paired``.

        The value stays in this process; others get a handle to it (``get_paired``).

        Args:
            key: Name of the value, unique in the group.
            value: Any object.

        Raises:
            KeyError: ``key`` is already paired in the group (by any member).
        """
        _check_key(key)
        self._usable(need_member=True).values.add(key, value)

    def unpair(self, key: str) -> None:
        """Withdraw a value this member paired.

        Args:
            key: Name of the value.

        Raises:
            KeyError: this member has not paired ``key``.
        """
        _check_key(key)
        self._usable(need_member=True).values.withdraw(key)

    def is_paired(self, key: str) -> bool:
        """Whether any member paired a value under ``key`` (asks the store).

        Args:
            key: Name of the value.
        """
        _check_key(key)
        return self._usable(need_member=False).owners.value(key, refresh=True) is not None

    def get_paired(self, key: str, timeout: Optional[float] = None) -> PairedRef:
        """A handle to the value paired under ``key`` (owned by the member that paired it).

        The handle behaves as torch's RRef: ``ref.rpc_sync().method(...)`` runs a method
        of the value on its owner; ``ref.to_here()`` copies it with torch's pickler
        (standard ``pickle`` rules). It names the owner member, so it keeps working when
        the owner renews its RPC agent, and can be sent to other members.

        Args:
            key: Name of the value.
            timeout: Seconds for the look-up on the owner; None: the world's
                ``rpc_timeout``.

        Returns:
            A :class:`~machinlike.distributed.PairedRef`; after ``unpair`` its
            ``to_here()`` raises ``KeyError``.

        Raises:
            KeyError: nothing is paired under ``key``.
            TimeoutError, PeerLostError: the owner did not answer / is gone (named, as
                :meth:`registered_sync`).
        """
        _check_key(key)
        parts = self._usable(need_member=False)
        return parts.caller.paired(key, _seconds("timeout", timeout, parts.directory.rpc_timeout))

    def wait_paired(self, key: str, timeout: Optional[float] = None) -> PairedRef:
        """:meth:`get_paired`, once some member pairs ``key``: for members that start at
        their own pace (an elastic world's actors, an open group with no barrier).

        A value never paired is waited for in the store (no polling); one whose holder
        withdrew it or was lost (in an elastic world: a restarted holder pairs it again) is
        looked up at each membership change and every 0.1 s. One whose holder left the
        world (its World stopped: the value went with it) ends the wait, named.

        Args:
            key: Name of the value.
            timeout: Seconds for the whole wait; None: the world's ``dist_timeout``.

        Returns:
            A :class:`~machinlike.distributed.PairedRef`, as :meth:`get_paired`.

        Raises:
            TimeoutError: nobody paired ``key`` in time (named).
            PeerLostError: the world's store is gone; in a static world, the holder is; the
                member that paired ``key`` left the world since (named).
        """
        _check_key(key)
        parts = self._usable(need_member=False)
        d = parts.directory
        wait = _seconds("timeout", timeout, d.dist_timeout)
        return wait_paired(parts.caller, parts.owners, d.registry, d.roster, d.departures, d.elastic, self._name, key,
                           wait)

    # ---------------------------------------------------------------- plain calls
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
        parts = self._usable(need_member=False)
        wait = _seconds("timeout", timeout, parts.directory.rpc_timeout)
        call = prepare_call(func, args, kwargs)
        self._check_to(to)
        return parts.caller.run_sync(to, func, call, wait)

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
        parts = self._usable(need_member=False)
        wait = _seconds("timeout", timeout, parts.directory.rpc_timeout)
        call = prepare_call(func, args, kwargs)
        self._check_to(to)
        return parts.caller.run_async(to, func, call, wait)

    def remote(self, to: str, func: Callable[..., Any], timeout: Optional[float] = None,
               args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None) -> ResultRef:
        """Run ``func`` on member ``to`` and return a handle to the result at once.

        The result stays on ``to`` while the handle (or a copy of it) lives; errors of
        ``func`` surface from ``ref.to_here()`` (their type, the remote traceback as
        ``__cause__``).

        Args:
            to: Name of a member of this group.
            func: The callable to run there.
            timeout: Seconds for creating the result on ``to``; None: the world's
                ``rpc_timeout``.
            args: Positional arguments of ``func``.
            kwargs: Keyword arguments of ``func``; None: none.

        Returns:
            A :class:`~machinlike.distributed.ResultRef` owned by ``to``.

        Raises:
            ValueError: ``to`` is not a member of the group.
            TypeError: ``func`` is not callable.
        """
        parts = self._usable(need_member=False)
        wait = _seconds("timeout", timeout, parts.directory.rpc_timeout)
        call = prepare_call(func, args, kwargs)
        self._check_to(to)
        return parts.caller.run_remote(to, func, call, wait)

    # -------------------------------------------------------------------- barrier
    def barrier(self, timeout: Optional[float] = None, *, skip_gone: bool = False) -> None:
        """Wait until every member reached this barrier (thread-safe, reusable).

        Two threads of one member calling it are two successive rounds.

        Args:
            timeout: Seconds; None: the world's ``dist_timeout``.
            skip_gone: Wait for the live members only: a member that left or was lost,
                before or during the wait, does not hold it up (the survivors of a
                static world meet to finish, e.g. to close their servers).

        Raises:
            TimeoutError: naming the members that did not arrive within ``timeout``.
            PeerLostError: a member is gone (at once, naming it); not with ``skip_gone``.
        """
        parts = self._usable(need_member=True)
        if parts.barrier is None:
            raise RuntimeError(f"RpcGroup {self._name!r} is open (members=None), so a barrier has no fixed "
                               f"set of members to wait for; create a group with members=[...] for barriers")
        if not isinstance(skip_gone, bool):
            raise TypeError(f"skip_gone must be True or False, not {skip_gone!r}")
        parts.barrier.wait(_seconds("timeout", timeout, parts.directory.dist_timeout), skip_gone)

    def fail_barrier(self, error: BaseException) -> None:
        """Tell the members that wait (or will wait) for this member at its next
        :meth:`barrier` that it will not come, and why: theirs raises RuntimeError at
        once, naming this member and quoting ``error``, instead of waiting out its
        timeout. For a member whose set-up failed before a barrier the others meet at
        (the server helpers call it when a host's server cannot be built). Raises
        nothing; a no-op for an open group.
        """
        try:
            parts = self._usable(need_member=True)
        except RuntimeError:  # (no World, destroyed, not a member: nobody waits for it here)
            return
        if parts.barrier is not None:
            parts.barrier.fail(f"{type(error).__name__}: {error}")

    # ------------------------------------------------------------------ lifecycle
    def destroy(self) -> None:
        """Withdraw every service and value this member owns and leave the group.

        The group name can be created again once every member destroyed its handle; the
        last member to destroy it deletes its keys from the store. Safe to call twice.

        Raises:
            RuntimeError: this process has no World.
        """
        d = self._directory()
        left: Optional[List[str]] = None  # the keys this member leaves, when it counts itself out
        size = 0
        with self._lock:
            if self._destroyed:
                return
            parts = self._parts
            # Parts of a World that stopped hold nothing of this one's (its tables went with it).
            if parts is not None and parts.directory is d:
                claimed = parts.services.close() + parts.values.close()
                if parts.barrier is not None and self._members is not None and d.name in self._members:
                    # (the last barrier key stays until every member is out: a slower one
                    # may still be waiting on it)
                    last = parts.barrier.last_key()
                    size = len(self._members)
                    left = [d.keys.group_join_prefix(self._name, self._epoch) + d.name, *claimed,
                            *([last] if last else [])]
            self._destroyed = True
        d.remove(self)
        if left is not None:
            end_incarnation(d.registry, d.keys, self._name, self._epoch, size, left)

    # ------------------------------------------------------------------ accessors
    def size(self) -> int:
        """Number of members (of an open group: live members of the world)."""
        return len(self.get_group_members())

    def is_member(self, name: Optional[str] = None) -> bool:
        """Whether ``name`` is a member.

        Args:
            name: A member name; None: this process (False through a handle it destroyed,
                or one that create_rpc_group did not return here).
        """
        d = self._directory()
        return self._has(d, d.name if name is None else name)

    def get_group_name(self) -> str:
        """Name of the group."""
        return self._name

    def is_open(self) -> bool:
        """Whether the group is open: created without members, it is whoever is in the world."""
        return self._members is None

    def get_group_members(self) -> List[str]:
        """Member names, sorted (of an open group: the live members of the world)."""
        return self._directory().roster.members() if self._members is None else list(self._members)

    def get_cur_name(self) -> str:
        """This process's member name."""
        return self._directory().name

    # machin's attributes (its own OrderedServerSimple reads group.group_name): read only
    @property
    def group_name(self) -> str:
        """machin's attribute: :meth:`get_group_name`."""
        return self._name

    @property
    def group_members(self) -> List[str]:
        """machin's attribute: :meth:`get_group_members`."""
        return self.get_group_members()

    @property
    def destroyed(self) -> bool:
        """machin's attribute: whether :meth:`destroy` was called on this handle."""
        return self._destroyed


def _rebuild_group(name: str, members: Sequence[str], epoch: str) -> RpcGroup:
    directory = _directory.current()
    if directory is not None:
        local = directory.local(name)
        if isinstance(local, RpcGroup) and local._epoch == epoch:
            return local
    return RpcGroup(name, members, epoch, outsider=True)
