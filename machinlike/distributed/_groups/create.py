"""Where an RpcGroup handle comes from: creating a group, joining an open one, finding one.

Owns nothing: each function is handed the World's :class:`GroupDirectory` (which owns this
process's handles and each name's epoch) and leaves the new handle there::

    create_group(d, name, members)   every member: wait for the members (elastic worlds),
                                     reserve the epoch ("<count>.<digest of the
                                     members>"), write its member list under
                                     rg/<name>/<epoch>/join/, wait for the others' lists,
                                     agree, claim rg/<name>/current with the GroupRecord
                                     (refused: another group in use holds the name)
                                     ──► RpcGroup, d.add
    open_group(d, name)              claim rg/<name>/current as open ("o/*") ──► RpcGroup
    find_group(d, name)              this process's handle, else one built from the
                                     GroupRecord in the store, else None

Why apart from ``_groups.rpc_group``: creation is a protocol between members (store keys,
waits, agreement), while the handle is what one process uses afterwards.
"""

from __future__ import annotations

import hashlib
import time
from typing import Dict, Optional, Sequence

from .directory import GroupDirectory
from .group_end import end_incarnation
from .._store import OPEN_EPOCH, WOKEN_MARK, GroupRecord, MemberRecord

from .rpc_group import RpcGroup
from ... import _checks
from ...exception import PeerLostError
from ..._deadline import deadline_left

__all__ = ["check_group_name", "create_group", "open_group", "find_group"]


def check_group_name(name: str) -> None:
    """Raise TypeError / ValueError unless ``name`` can name a group (no '/' or ',')."""
    if not isinstance(name, str):
        raise TypeError(f"group name must be a str, not {type(name).__name__}")
    if not name or "/" in name or "," in name:
        raise ValueError(f"group name {name!r} must be non-empty and contain no '/' or ','")
    _checks.fits_the_store("group name", name)


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
    # In an elastic world the group is made of these incarnations: one that dies and
    # comes back is a new process, gone for this group (it creates a new one).
    incarnations = d.roster.incarnations(members) if d.elastic else None
    keys = d.keys
    tag = _tag(members, incarnations)
    epoch = d.reserve(name, tag)
    prefix = keys.group_join_prefix(name, epoch)
    listing = GroupRecord.listing(members)
    proposal = keys.group_proposal(name, d.name)
    d.registry.set(proposal, listing)
    d.registry.set(prefix + d.name, listing)
    try:
        d.waits.wait_all(prefix, members, members, max(0.001, deadline_left(deadline)),
                         f"creating RpcGroup {name!r}: members", wait, incarnations)
    except TimeoutError as err:
        d.unreserve(name, tag, epoch)
        # A member that passed another list waits under another epoch (its digest differs).
        # (The proposal stays: a member timing out a moment later reads it too.)
        _refuse_other_lists(d, name, members, err)
        raise
    except PeerLostError as err:
        _refuse_other_lists(d, name, members, err)
        d.registry.delete([proposal])
        raise _departed(d, name, err.member, err.detail) from err
    except BaseException:
        d.registry.delete([proposal])
        raise
    held_lists = d.registry.values(prefix, members)
    if WOKEN_MARK in held_lists:
        # Woken because a member that had joined is gone since (one that had not is
        # marked lost: the wait raised): the others' places were filled to end the wait.
        gone = d.roster.not_current(members, incarnations)
        _refuse_other_lists(d, name, members, None)
        d.registry.delete([proposal])
        raise _departed(d, name, gone[0] if gone else members[held_lists.index(WOKEN_MARK)])
    d.registry.delete([proposal])
    odd = [m for m, v in zip(members, held_lists) if v != listing]
    if odd:
        raise ValueError(f"members of RpcGroup {name!r} disagree: {odd} passed other member lists")
    record = GroupRecord(epoch, tuple(members)).encode()
    # The name is claimed world-wide once every member joined, not before: a member that
    # refused alone (seeing another group's claim that the others had not seen yet)
    # would leave them waiting for it until their timeout.
    held = d.registry.compare_set(keys.group(name), "", record)
    if held != record:
        try:
            _refuse_taken(d, name, members, held)
        except ValueError:
            # Every member refuses alike; the last out deletes the member lists (one read
            # by another member that is not out yet must stay until then).
            end_incarnation(d.registry, keys, name, epoch, len(members), [prefix + d.name])
            raise
        d.registry.set(keys.group(name), record)
    group = RpcGroup(name, members, epoch, incarnations, directory=d)
    d.add(group)
    return group


def _tag(members: Sequence[str], incarnations: Optional[Dict[str, int]]) -> str:
    """The digest in an incarnation's epoch: of its members and, in an elastic world, of
    their incarnations.

    Why: each process counts its own creations of a name, so two groups of one name (made
    by different members) or a group made again with a member's next incarnation (whose
    count starts at 0 while the others' went on) would otherwise share an epoch, and with
    it service, value and barrier keys, some of them left by the old incarnation.
    """
    text = GroupRecord.listing(members)
    if incarnations is not None:
        text += "|" + ",".join(str(incarnations.get(m, 0)) for m in members)
    return hashlib.blake2b(text.encode(), digest_size=4).hexdigest()


#: What a member list that differs between members means in an elastic world.
_ELASTIC_LISTS = ("; in an elastic world get_members() is who this member has seen join so far, so members that "
                  "pass it pass different lists: wait for the members first (world.wait_for_members([...])) and "
                  "pass that list, or create an open group (create_rpc_group(name), no members)")


def _refuse_other_lists(d: GroupDirectory, name: str, members: Sequence[str], cause: Optional[BaseException]) -> None:
    """Raise ValueError (from ``cause``) if a member of ``members`` is creating group
    ``name`` with another list (its proposal), or the group it made holds another list.

    Why on failures only: each creator waits under an epoch of its own list's digest, so
    a disagreement shows as a wait that fails (a timeout, or a member gone meanwhile).
    """
    listing = GroupRecord.listing(members)
    theirs = {m: held.split(",") for m in members if m != d.name
              for held in [d.registry.get_or_empty(d.keys.group_proposal(name, m))] if held and held != listing}
    what = f"{theirs} (by member)" if theirs else ""
    made = d.registry.get_or_empty(d.keys.group(name))
    record = GroupRecord.decode(made) if made else None
    if not what and record is not None and record.members is not None and list(record.members) != list(members) \
            and set(record.members) & (set(members) - {d.name}):
        what = f"{list(record.members)} made it with members={list(record.members)}"
    if what:
        raise ValueError(f"members of RpcGroup {name!r} disagree: this member passed members={list(members)}, "
                         f"but {what}; every member must pass the same list{_ELASTIC_LISTS if d.elastic else ''}"
                         ) from cause


def _departed(d: GroupDirectory, name: str, member: str, detail: str = "") -> PeerLostError:
    """The error for ``member``, gone while this member waited for it to create group ``name``
    (``detail``: the wait's own words, kept when the log has no departure: a static member
    that stops its World, see ``_membership.stops``)."""
    how = d.departure(member)
    if how is None:
        return PeerLostError(member, detail or f"creating RpcGroup {name!r}: it left or died while being waited for")
    hint = (", without creating the group with these members" +
            (_ELASTIC_LISTS if d.elastic else "")) if how[1] else ""
    return PeerLostError(member, f"creating RpcGroup {name!r}: it {how[0]}{hint}")


def _refuse_taken(d: GroupDirectory, name: str, members: Sequence[str], held: str) -> None:
    """Raise ValueError if ``held`` (the name's current record) is another group in use.

    Not in use: no record, one of these same members (made again), or one that has a
    member gone or back as another incarnation (its record stays when a member died).
    """
    if not held:
        return
    record = GroupRecord.decode(held)
    if record.members is None:
        raise ValueError(f"RpcGroup {name!r} is an open group in this world (members=None); a group with "
                         f"fixed members needs a name of its own")
    if list(record.members) == list(members):
        return
    others = list(record.members)
    current = d.roster.incarnations(others) if d.elastic else None
    if d.roster.not_current(others, None) or record.epoch.partition(".")[2] != _tag(others, current):
        return
    raise ValueError(f"RpcGroup {name!r} already exists in this world with members {others}, not "
                     f"members={list(members)}; give this group a name of its own, or have each member of the "
                     f"existing one destroy() it first")


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
                _refuse_other_lists(d, name, members, None)
                raise _departed(d, name, member)
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
    check_group_name(name)
    group = d.local(name)
    if isinstance(group, RpcGroup):
        return group
    held = d.claims.owner(d.keys.group(name))
    if held is None:
        return None
    record = GroupRecord.decode(held)
    return RpcGroup(name, record.members, record.epoch, directory=d, outsider=True)
