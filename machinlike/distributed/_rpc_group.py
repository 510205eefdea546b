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

from .. import _checks
from ._group_calls import GroupCalls
from ._group_keys import GroupKeys
from ._keys import OPEN_EPOCH, GroupRecord, ServiceOwner
from ._group_directory import GroupDirectory
from ._registry import deadline_left
from . import _state
from ._state import require_world
from ..exception import PeerLostError

__all__ = ["RpcGroup", "check_group_name", "create_group", "open_group", "find_group"]


def check_group_name(name: str) -> None:
    if not isinstance(name, str):
        raise TypeError(f"group name must be a str, not {type(name).__name__}")
    if not name or "/" in name or "," in name:
        raise ValueError(f"group name {name!r} must be non-empty and contain no '/' or ','")


def create_group(d: GroupDirectory, name: str, members: Sequence[str], wait: float) -> "RpcGroup":
    """Create group ``name`` over ``members`` (every member calls this); see ``World.create_rpc_group``."""
    check_group_name(name)
    deadline = time.monotonic() + wait
    members = sorted(members)
    if d.elastic and len(set(members)) == len(members):
        # Members of an elastic world may still be on their way: wait for them, but not
        # for one that already left or was lost (that fails now, naming it).
        try:
            d.roster.wait_until(lambda live: set(members) <= set(live)
                                    or any(d.roster.gone(m) for m in members), wait)
        except TimeoutError:
            pass  # named below
        for member in members:
            why = d.roster.gone(member)
            if why:
                verb = "left" if why == "left" else "was lost from"
                raise PeerLostError(member, f"creating RpcGroup {name!r}: it {verb} the world; wait for its "
                                            f"return (World.wait_for_members) before grouping with it")
    live = d.roster.members()
    unknown = [m for m in members if m not in live]
    if unknown or len(set(members)) != len(members) or not members:
        if d.elastic and len(set(members)) == len(members):
            raise TimeoutError(f"creating RpcGroup {name!r}: {unknown} did not join the world within {wait:g} s")
        raise ValueError(f"members={members!r} must be distinct names of live world members ({live}); "
                         f"unknown: {unknown}")
    if d.name not in members:
        raise ValueError(f"this process ({d.name!r}) is not in members={members}; "
                         f"only members create the group")
    epoch = d.reserve(name)
    keys = d.keys
    prefix = keys.group_join_prefix(name, str(epoch))
    listing = GroupRecord.listing(members)
    # In an elastic world the group is made of these incarnations: one that dies and
    # comes back is a new process, gone for this group (it creates a new one).
    incarnations = d.roster.incarnations(members) if d.elastic else None
    d.registry.set(prefix + d.name, listing)
    d.waits.wait_all(prefix, members, members, max(0.001, deadline_left(deadline)),
                          f"creating RpcGroup {name!r}: members", wait, incarnations)
    odd = [m for m, v in zip(members, d.registry.values(prefix, members)) if v != listing]
    if odd:
        raise ValueError(f"members of RpcGroup {name!r} disagree: {odd} passed other member lists")
    d.registry.set(keys.group(name), GroupRecord(str(epoch), tuple(members)).encode())
    group = RpcGroup(name, members, str(epoch), incarnations, directory=d)
    d.add(group)
    return group


def open_group(d: GroupDirectory, name: str) -> "RpcGroup":
    """Join the open group ``name`` (whoever is in the world); returns at once."""
    check_group_name(name)
    if d.local(name) is not None:
        raise ValueError(f"RpcGroup {name!r} already exists here; destroy() it before creating it again")
    opened = GroupRecord(OPEN_EPOCH, None).encode()
    held = d.registry.compare_set(d.keys.group(name), "", opened)
    if held != opened:
        fixed = GroupRecord.listing(GroupRecord.decode(held).members or ())
        raise ValueError(f"RpcGroup {name!r} exists with fixed members ({fixed}); "
                         f"open groups (members=None) need a name of their own")
    group = RpcGroup(name, None, OPEN_EPOCH, directory=d)
    d.add(group)
    return group


def find_group(d: GroupDirectory, name: str) -> Optional["RpcGroup"]:
    """This process's group ``name``, else a handle if the world has one, else None."""
    group = d.local(name)
    if group is not None:
        return group
    held = d.claims.owner(d.keys.group(name))
    if held is None:
        return None
    record = GroupRecord.decode(held)
    return RpcGroup(name, record.members, record.epoch, directory=d)


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
                 incarnations: Optional[Dict[str, int]] = None, *,
                 directory: Optional[GroupDirectory] = None) -> None:
        # None (an unpickled or hand-made handle): the current World's, at each use.
        self._dir = directory
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
    def _directory(self) -> GroupDirectory:
        d = self._dir
        if d is None or not d.open:
            d = require_world().groups  # its World stopped: the current one's, as before
        return d

    def _key(self, d: GroupDirectory, kind: str, key: str) -> str:
        return (d.keys.service if kind == "s" else d.keys.value)(self._name, self._epoch, key)

    def _timeout(self, d: GroupDirectory, timeout: Optional[float]) -> float:
        return _checks.seconds_or_none("timeout", timeout, d.rpc_timeout)

    def _has(self, d: GroupDirectory, name: str) -> bool:
        return name in d.roster.members() if self._members is None else name in self._members

    def _check_usable(self, need_member: bool) -> GroupDirectory:
        d = self._directory()
        if self._destroyed:
            raise RuntimeError(f"RpcGroup {self._name!r} has been destroyed")
        if need_member and not self._has(d, d.name):
            raise RuntimeError(f"this process ({d.name!r}) is not a member of RpcGroup {self._name!r}")
        return d

    # -------------------------------------------------------------------- barrier
    def barrier(self, timeout: Optional[float] = None) -> None:
        """Wait until every member reached this barrier (thread-safe, reusable).

        Two threads of one member calling it are two successive rounds.

        Args:
            timeout: Seconds; None: the world's ``dist_timeout``.

        Raises:
            TimeoutError: naming the members that did not arrive within ``timeout``.
        """
        d = self._check_usable(need_member=True)
        if self._members is None:
            raise RuntimeError(f"RpcGroup {self._name!r} is open (members=None), so a barrier has no fixed "
                               f"set of members to wait for; create a group with members=[...] for barriers")
        wait = _checks.seconds_or_none("timeout", timeout, d.dist_timeout)
        deadline = time.monotonic() + wait
        # Rounds of one member run one at a time, which is what makes deleting the
        # previous round's key safe: whoever passed round g had every member leave g - 1.
        if not self._barrier_lock.acquire(timeout=wait):
            raise TimeoutError(f"barrier of RpcGroup {self._name!r}: an earlier round of this member "
                               f"did not finish within {wait:g} s")
        try:
            generation = self._barrier_gen
            self._barrier_gen += 1
            prefix = d.keys.barrier_prefix(self._name, self._epoch, generation)
            d.registry.set(prefix + d.name, "1")
            d.waits.wait_all(prefix, self._members, self._members, max(0.001, deadline_left(deadline)),
                             f"barrier of RpcGroup {self._name!r}: members", wait, self._incarnations)
            if generation:
                d.registry.delete([d.keys.barrier_prefix(self._name, self._epoch, generation - 1) + d.name])
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
        d = self._directory()
        with self._lock:
            if self._destroyed:
                return
            for key in list(self._my_services):
                owner = self._service_owners.get(key)
                d.claims.release(self._key(d, "s", key), owner.encode() if owner is not None else "")
                d.tables.services.pop(self._sid + key, None)
            for key in list(self._my_values):
                d.claims.release(self._key(d, "v", key), d.endpoint.transport)
                d.tables.values.pop(self._sid + key, None)
            self._my_services.clear()
            self._my_values.clear()
            # The last barrier key stays: a slower member may still be waiting on it.
            self._destroyed = True
        d.remove(self)

    # ------------------------------------------------------------------ accessors
    def size(self) -> int:
        """Number of members (of an open group: live members of the world)."""
        return len(self.get_group_members())

    def is_member(self, name: Optional[str] = None) -> bool:
        """Whether ``name`` is a member.

        Args:
            name: A member name; None: this process.
        """
        d = self._directory()
        return self._has(d, d.name if name is None else name)

    def get_group_name(self) -> str:
        """Name of the group."""
        return self._name

    def get_group_members(self) -> List[str]:
        """Member names, sorted (of an open group: the live members of the world)."""
        return self._directory().roster.members() if self._members is None else list(self._members)

    def get_cur_name(self) -> str:
        """This process's member name."""
        return self._directory().name


def _rebuild_group(name: str, members: Sequence[str], epoch: str) -> RpcGroup:
    world = _state.current
    if world is not None:
        local = world.groups.local(name)
        if local is not None and local._epoch == epoch:
            return local
    return RpcGroup(name, members, epoch)
