"""GroupParts: the parts of one RpcGroup handle in one World, wired together.

Owns nothing but the references: it is the composition root of a handle, the one place
that builds the parts from the World's :class:`GroupDirectory` and hands each its
collaborators. ``RpcGroup`` holds one and builds a new one when the directory it uses
changes (see ``_groups.rpc_group``)::

    GroupDirectory ──► GroupParts ─┬─ owners    OwnerCache    (keys, claims, roster)
                                   ├─ services  OwnedKeys(SERVICES) (tables, claims, endpoint, owners)
                                   ├─ values    OwnedKeys(VALUES)   (tables, claims, endpoint, owners)
                                   ├─ caller    Caller        (roster, waits, owners)
                                   └─ barrier   Barrier       (keys, registry, waits); None when open

Why this cut: the owner cache is the one piece both sides of a key share (the tables
write this member's own keys into it, the caller reads and corrects it on every call), so
it is a part of its own and the others are handed it; what this member holds, what it
sends and its barrier rounds change for different reasons, under different locks.
"""

from __future__ import annotations

from typing import Dict, Optional, Sequence

from .barrier import Barrier
from .caller import Caller
from .directory import GroupDirectory
from .owners import OwnerCache
from .tables import SERVICES, VALUES, OwnedKeys

__all__ = ["GroupParts"]


class GroupParts:
    """One group handle's parts in one World, wired together (the composition root).

    Args:
        name: The group's name.
        members: Its members, sorted; None for an open group.
        epoch: Its incarnation.
        incarnations: The members' incarnations the group was made of (elastic); None: any.
        directory: The World's groups and the parts of its membership they use.

    Attributes:
        directory: The directory the parts were built from.
        owners, services, values, caller: See the module docstring.
        barrier: None for an open group.
    """

    __slots__ = ("directory", "owners", "services", "values", "caller", "barrier")

    def __init__(self, name: str, members: Optional[Sequence[str]], epoch: str,
                 incarnations: Optional[Dict[str, int]], directory: GroupDirectory) -> None:
        d = self.directory = directory
        sid = f"{name}/{epoch}/"  # a service id is sid + key (see _calls.LocalTables)
        self.owners = OwnerCache(name, epoch, d.keys, d.claims, d.roster)
        self.services = OwnedKeys(SERVICES, name, sid, d.name, d.tables, d.claims, d.endpoint, d.roster, self.owners)
        self.values = OwnedKeys(VALUES, name, sid, d.name, d.tables, d.claims, d.endpoint, d.roster, self.owners)
        self.caller = Caller(name, sid, d.roster, d.waits, self.owners)
        self.barrier = None if members is None else Barrier(
            name, epoch, tuple(members), incarnations, d.name, d.keys, d.registry, d.waits)
