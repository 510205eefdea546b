"""Where an RpcGroup handle comes from: creating a group, joining an open one, finding one.

Owns nothing: each function is handed the World's :class:`GroupDirectory` (which owns this
process's handles and each name's epoch) and leaves the new handle there::

    create_group(d, name, members)   every member: wait for the members (elastic worlds),
                                     reserve the epoch, write its member list under
                                     rg/<name>/<epoch>/join/, wait for the others' lists,
                                     agree, publish the GroupRecord ──► RpcGroup, d.add
    open_group(d, name)              claim rg/<name>/current as open ("o/*") ──► RpcGroup
    find_group(d, name)              this process's handle, else one built from the
                                     GroupRecord in the store, else None

Why apart from ``_groups.rpc_group``: creation is a protocol between members (store keys,
waits, agreement), while the handle is what one process uses afterwards.
"""

from __future__ import annotations

import time
from typing import Dict, Optional, Sequence

from .directory import GroupDirectory
from .._store import OPEN_EPOCH, GroupRecord, MemberRecord

from .rpc_group import RpcGroup
from ...exception import PeerLostError
from ..._deadline import deadline_left

__all__ = ["check_group_name", "create_group", "open_group", "find_group"]


def check_group_name(name: str) -> None:
    """Raise TypeError / ValueError unless ``name`` can name a group (no '/' or ',')."""
    if not isinstance(name, str):
        raise TypeError(f"group name must be a str, not {type(name).__name__}")
    if not name or "/" in name or "," in name:
        raise ValueError(f"group name {name!r} must be non-empty and contain no '/' or ','")


def create_group(d: GroupDirectory, name: str, members: Sequence[str], wait: float) -> RpcGroup:
    """Create group ``name`` over ``members`` (every member calls this); see ``World.create_rpc_group``."""
    check_group_name(name)
    deadline = time.monotonic() + wait
    members = sorted(members)
    if d.elastic and len(set(members)) == len(members):
        _wait_for_members(d, name, members, deadline)
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


def _wait_for_members(d: GroupDirectory, name: str, members: Sequence[str], deadline: float) -> None:
    """Wait (until ``deadline``) for ``members`` of an elastic world to be live in this
    view, each as the incarnation the store holds.

    A member that may still be on its way is waited for; one that left or was lost fails
    at once, named, unless the store already holds its next incarnation's claim: then this
    view is only behind (a restarted rank joined before this process read the log), and
    it is waited for too, as is a live member whose next incarnation this view has not
    seen yet (its old one would fail the group's rendezvous). A timeout is named by the
    caller.

    Raises:
        PeerLostError: a member left or was lost and has not come back.
    """
    while True:
        try:
            d.roster.wait_until(lambda live: set(members) <= set(live) or any(d.roster.gone(m) for m in members),
                                deadline_left(deadline))
        except TimeoutError:
            return
        behind: Dict[str, int] = {}
        for member in members:
            # The "lost" event is posted only after the claim is cleared, so a claim held
            # after this view saw a loss is the next incarnation's.
            held = d.registry.get_or_empty(d.keys.live(member))
            stored = MemberRecord.decode(member, held).incarnation if held else None
            why = d.roster.gone(member)
            if why and stored is None:
                verb = "left" if why == "left" else "was lost from"
                raise PeerLostError(member, f"creating RpcGroup {name!r}: it {verb} the world; wait for its "
                                            f"return (World.wait_for_members) before grouping with it")
            seen = d.roster.incarnation_of(member)
            if stored is not None and (seen is None or stored > seen):
                behind[member] = stored
        if not behind:
            return
        try:
            d.roster.wait_until(lambda live: all((d.roster.incarnation_of(m) or 0) >= inc for m, inc in behind.items()),
                                deadline_left(deadline))
        except TimeoutError:
            return


def open_group(d: GroupDirectory, name: str) -> RpcGroup:
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


def find_group(d: GroupDirectory, name: str) -> Optional[RpcGroup]:
    """This process's group ``name``, else a handle if the world has one, else None."""
    group = d.local(name)
    if isinstance(group, RpcGroup):
        return group
    held = d.claims.owner(d.keys.group(name))
    if held is None:
        return None
    record = GroupRecord.decode(held)
    return RpcGroup(name, record.members, record.epoch, directory=d)
