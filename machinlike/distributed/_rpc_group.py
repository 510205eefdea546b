"""RpcGroup: a named set of members that register services and pair values.

The group's state (its members, owner caches, barrier rounds) lives here, in
``RpcGroup.__init__``; two mixins hold the methods of two concerns: ``_group_keys``
(services and values, with the owner cache and its one retry) and ``_group_calls`` (plain
calls to a named member, and the blocking call every group call makes). Creation,
barrier, destruction and the accessors are here.

Store keys of one group incarnation, all built by ``_keys`` (``epoch`` counts
re-creations of the name; an open group, created with ``members=None``, has the epoch ``o``):

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
from typing import Any, Dict, List, Optional, Sequence, Set

from . import _checks
from ._group_calls import GroupCalls
from ._group_keys import GroupKeys
from ._keys import OPEN_EPOCH, GroupRecord, ServiceOwner
from ._membership import Membership
from ._registry import deadline_left
from ._state import require_world
from ..exception import PeerLostError

__all__ = ["RpcGroup", "check_group_name", "create_group", "open_group"]


def check_group_name(name: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"group name must be a str, not {type(name).__name__}")
    if not name or "/" in name or "," in name:
        raise ValueError(f"group name {name!r} must be non-empty and contain no '/' or ','")


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
    keys = members_view.keys
    prefix = keys.group_join_prefix(name, str(epoch))
    listing = GroupRecord.listing(members)
    # In an elastic world the group is made of these incarnations: one that dies and
    # comes back is a new process, gone for this group (it creates a new one).
    incarnations = members_view.incarnations(members) if members_view.elastic else None
    members_view.registry.set(prefix + members_view.name, listing)
    members_view.waits.wait_all(prefix, members, members, max(0.001, deadline_left(deadline)),
                          f"creating RpcGroup {name!r}: members", wait, incarnations)
    odd = [m for m, v in zip(members, members_view.registry.values(prefix, members)) if v != listing]
    if odd:
        raise ValueError(f"members of RpcGroup {name!r} disagree: {odd} passed other member lists")
    members_view.registry.set(keys.group(name), GroupRecord(str(epoch), tuple(members)).encode())
    group = RpcGroup(name, members, str(epoch), incarnations)
    members_view.groups[name] = group
    return group


def open_group(members_view: Membership, name: str) -> "RpcGroup":
    """Join the open group ``name`` (whoever is in the world); returns at once."""
    check_group_name(name)
    if name in members_view.groups:
        raise ValueError(f"RpcGroup {name!r} already exists here; destroy() it before creating it again")
    opened = GroupRecord(OPEN_EPOCH, None).encode()
    held = members_view.registry.compare_set(members_view.keys.group(name), "", opened)
    if held != opened:
        fixed = GroupRecord.listing(GroupRecord.decode(held).members or ())
        raise ValueError(f"RpcGroup {name!r} exists with fixed members ({fixed}); "
                         f"open groups (members=None) need a name of their own")
    group = RpcGroup(name, None, OPEN_EPOCH)
    members_view.groups[name] = group
    return group


class RpcGroup(GroupKeys, GroupCalls):
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
        self._service_owners: Dict[str, ServiceOwner] = {}
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
        keys = world.membership.keys
        return (keys.service if kind == "s" else keys.value)(self._name, self._epoch, key)

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
            prefix = world.membership.keys.barrier_prefix(self._name, self._epoch, generation)
            members.registry.set(prefix + world.name, "1")
            members.waits.wait_all(prefix, self._members, self._members, max(0.001, deadline_left(deadline)),
                             f"barrier of RpcGroup {self._name!r}: members", wait, self._incarnations)
            if generation:
                members.registry.delete([members.keys.barrier_prefix(self._name, self._epoch, generation - 1) + world.name])
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
                owner = self._service_owners.get(key)
                world.membership.claims.release(self._key(world, "s", key), owner.encode() if owner is not None else "")
                world.membership.tables.services.pop(self._sid + key, None)
            for key in list(self._my_values):
                world.membership.claims.release(self._key(world, "v", key), world.membership.transport)
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
