"""GroupDirectory: what an RpcGroup needs of its world, typed, and the groups of this process.

Owns this process's group handles by name and how many times each name was created here
(a static group's epoch), under one lock; everything else it holds is a reference to a
part of the world's :class:`~machinlike.distributed.Membership`, handed over once at
start-up, so that a group never looks the World up:

    Session ──► GroupDirectory ─┬─ keys, registry   the rg/ keys and their store (see _store.keys)
                                ├─ roster, waits    who is live; waits that fail fast
                                ├─ claims, endpoint service/value keys; this member's worker
                                ├─ tables           the services and values this process serves
                                └─ _groups, _epochs this process's handles, by name
    World.create_rpc_group ──► create_group(directory, ...) ──► RpcGroup(..., directory=)

A handle that was unpickled, or built by hand, has no directory: it uses this process's
current one (``current()``, bound by the Session while its World runs), as it always did.
The directory names its handles through the small ``GroupHandle`` protocol, not
``RpcGroup``, so that it sits below the group class in the import graph.
"""

from __future__ import annotations

import threading
from typing import Dict, List, Optional, Protocol, Tuple

from .._calls import LocalTables
from .._membership import Claims
from .._membership import Departures
from .._membership import Endpoint
from .._store import Keys
from .._membership import Membership
from .._store import Registry
from .._membership import Roster
from .._membership import Waits

__all__ = ["GroupDirectory", "GroupHandle", "bind", "current", "require"]

# How many (name, members) creation counts a process keeps (see GroupDirectory.reserve).
_EPOCHS_KEPT = 4096


class GroupHandle(Protocol):
    """What the directory asks of a group handle it keeps (``RpcGroup`` is one)."""

    def get_group_name(self) -> str: ...

    def destroy(self) -> None: ...


class GroupDirectory:
    """The RpcGroups of one World in this process, and the parts of the world they use.

    Args:
        membership: The world's membership (its parts are copied; the root is not kept).
        tables: The services and values this process serves.
        rpc_timeout: Default timeout of group calls, seconds.
        dist_timeout: Default timeout of barriers and group creation, seconds.

    Attributes:
        name: This member's name.
        elastic: Whether members come and go.
        rpc_timeout: Default timeout of group calls, seconds.
        dist_timeout: Default timeout of barriers and group creation, seconds.
    """

    def __init__(self, membership: Membership, tables: LocalTables, rpc_timeout: float,
                 dist_timeout: float) -> None:
        self.name = membership.name
        self.elastic = membership.elastic
        self.rpc_timeout = rpc_timeout
        self.dist_timeout = dist_timeout
        self.keys: Keys = membership.keys
        self.registry: Registry = membership.registry
        self.roster: Roster = membership.roster
        self.waits: Waits = membership.waits
        self.claims: Claims = membership.claims
        self.departures: Departures = membership.departures
        self.endpoint: Endpoint = membership.endpoint
        #: How a gone member went, for messages (``Membership.departure``).
        self.departure = membership.departure
        self.tables = tables
        self._lock = threading.Lock()
        self._groups: Dict[str, GroupHandle] = {}
        self._epochs: Dict[Tuple[str, str], int] = {}
        self._open = True

    @property
    def open(self) -> bool:
        """False once its World stopped (a start-up undo step closes it)."""
        return self._open

    def close(self) -> None:
        self._open = False

    # ------------------------------------------------------------ local handles
    def local(self, name: str) -> Optional[GroupHandle]:
        """This process's handle of group ``name``, None if it has none."""
        with self._lock:
            return self._groups.get(name)

    def local_groups(self) -> List[GroupHandle]:
        with self._lock:
            return list(self._groups.values())

    def reserve(self, name: str, tag: str) -> str:
        """The epoch of a new incarnation of group ``name`` here: ``"<count>.<tag>"``,
        ``count`` counting this process's creations of ``name`` with ``tag`` (the digest of
        the incarnation's members, see ``create``), so the members agree on it.

        Raises:
            ValueError: this process already has a handle of ``name``.
        """
        with self._lock:
            self._refuse_existing(name)
            count = self._epochs.pop((name, tag), 0)
            self._epochs[(name, tag)] = count + 1  # (re-inserted: the dict is oldest first)
            # Bounded: an elastic world makes a new tag at each restart of a member. A
            # count forgotten restarts at 0, which only collides with an incarnation of
            # the same members created thousands of creations of this process ago.
            while len(self._epochs) > _EPOCHS_KEPT:
                del self._epochs[next(iter(self._epochs))]
            return f"{count}.{tag}"

    def unreserve(self, name: str, tag: str, epoch: str) -> None:
        """Give back ``epoch`` of a creation that timed out, unless a later one was
        reserved since: a retry then meets a member that comes late, which never counted
        the failed attempt (it would wait under the next epoch for good)."""
        with self._lock:
            count = int(epoch.partition(".")[0])
            if self._epochs.get((name, tag)) == count + 1:
                self._epochs[(name, tag)] = count

    def add(self, group: GroupHandle) -> None:
        """Keep ``group`` as this process's handle of its name.

        Raises:
            ValueError: this process already has one.
        """
        with self._lock:
            self._refuse_existing(group.get_group_name())
            self._groups[group.get_group_name()] = group

    def remove(self, group: GroupHandle) -> None:
        """Forget ``group`` (destroyed) if it is this process's handle of its name."""
        with self._lock:
            if self._groups.get(group.get_group_name()) is group:
                del self._groups[group.get_group_name()]

    def _refuse_existing(self, name: str) -> None:
        if name in self._groups:
            raise ValueError(f"RpcGroup {name!r} already exists here; destroy() it before creating it again")


_current: Optional[GroupDirectory] = None


def bind(directory: Optional[GroupDirectory]) -> None:
    """Make ``directory`` this process's (None: its World stopped). Only the Session calls this."""
    global _current
    _current = directory


def current() -> Optional[GroupDirectory]:
    """This process's group directory, None when no World runs here."""
    return _current


def require(user: Optional[str] = None) -> GroupDirectory:
    """This process's group directory; ``user``: what needs it, for the error (None: a
    World's own call).

    Raises:
        RuntimeError: no World runs in this process.
    """
    directory = _current
    if directory is None:
        if user is None:
            raise RuntimeError("no World in this process: create one first, e.g. World(rank=..., world_size=...)")
        # Typically a handle sent to a pool worker or a child process, which are not members.
        raise RuntimeError(f"no World in this process: {user} works only in a process that joined its world, "
                           f"and a pool worker or a child process has not; make the call in the member that has "
                           f"the World and send the worker its result, or start a World in each worker "
                           f"(machinlike.launch gives every rank one)")
    return directory
