"""GroupDirectory: what an RpcGroup needs of its world, typed, and the groups of this process.

Owns this process's group handles by name and how many times each name was created here
(a static group's epoch), under one lock; everything else it holds is a reference to a
part of the world's :class:`~machinlike.distributed.Membership`, handed over once at
start-up, so that a group never looks the World up:

    Session ──► GroupDirectory ─┬─ keys, registry   the rg/ keys and their store (see _keys)
                                ├─ roster, waits    who is live; waits that fail fast
                                ├─ claims, endpoint service/value keys; this member's worker
                                ├─ tables           the services and values this process serves
                                └─ _groups, _epochs this process's handles, by name
    World.create_rpc_group ──► create_group(directory, ...) ──► RpcGroup(..., directory=)

A handle that was unpickled, or built by hand, has no directory: it uses the current
World's (``_state.current``), as it always did.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Dict, List, Optional

from ._calls import LocalTables
from ._claims import Claims
from ._endpoint import Endpoint
from ._keys import Keys
from ._membership import Membership
from ._registry import Registry
from ._roster import Roster
from ._waits import Waits

if TYPE_CHECKING:
    from ._rpc_group import RpcGroup

__all__ = ["GroupDirectory"]


class GroupDirectory:
    """The RpcGroups of one World in this process, and the parts of the world they use.

    Args:
        membership: The world's membership (its parts are copied; the root is not kept).
        rpc_timeout: Default timeout of group calls, seconds.
        dist_timeout: Default timeout of barriers and group creation, seconds.

    Attributes:
        name: This member's name.
        elastic: Whether members come and go.
        rpc_timeout: Default timeout of group calls, seconds.
        dist_timeout: Default timeout of barriers and group creation, seconds.
    """

    def __init__(self, membership: Membership, rpc_timeout: float, dist_timeout: float) -> None:
        self.name = membership.name
        self.elastic = membership.elastic
        self.rpc_timeout = rpc_timeout
        self.dist_timeout = dist_timeout
        self.keys: Keys = membership.keys
        self.registry: Registry = membership.registry
        self.roster: Roster = membership.roster
        self.waits: Waits = membership.waits
        self.claims: Claims = membership.claims
        self.endpoint: Endpoint = membership.endpoint
        self.tables: LocalTables = membership.tables
        self._lock = threading.Lock()
        self._groups: Dict[str, "RpcGroup"] = {}
        self._epochs: Dict[str, int] = {}
        self._open = True

    @property
    def open(self) -> bool:
        """False once its World stopped (a start-up undo step closes it)."""
        return self._open

    def close(self) -> None:
        self._open = False

    # ------------------------------------------------------------ local handles
    def local(self, name: str) -> Optional["RpcGroup"]:
        """This process's handle of group ``name``, None if it has none."""
        with self._lock:
            return self._groups.get(name)

    def local_groups(self) -> List["RpcGroup"]:
        with self._lock:
            return list(self._groups.values())

    def reserve(self, name: str) -> int:
        """The epoch of a new incarnation of group ``name`` here (counts creations).

        Raises:
            ValueError: this process already has a handle of ``name``.
        """
        with self._lock:
            self._refuse_existing(name)
            epoch = self._epochs.get(name, 0)
            self._epochs[name] = epoch + 1
            return epoch

    def add(self, group: "RpcGroup") -> None:
        """Keep ``group`` as this process's handle of its name.

        Raises:
            ValueError: this process already has one.
        """
        with self._lock:
            self._refuse_existing(group.get_group_name())
            self._groups[group.get_group_name()] = group

    def remove(self, group: "RpcGroup") -> None:
        """Forget ``group`` (destroyed) if it is this process's handle of its name."""
        with self._lock:
            if self._groups.get(group.get_group_name()) is group:
                del self._groups[group.get_group_name()]

    def _refuse_existing(self, name: str) -> None:
        if name in self._groups:
            raise ValueError(f"RpcGroup {name!r} already exists here; destroy() it before creating it again")
