"""OwnedKeys: the services or the values this member published in one RpcGroup, and withdrawing them.

One class for both kinds (``SERVICES``, ``VALUES``: how a kind spells its holder, its store
key and its messages). Each table owns its lock and the keys this member holds in the
group: a service's callable or a paired value stays in this process (in ``LocalTables``,
where incoming calls find it by service id ``<group>/<epoch>/<key>``), and the store says
who holds the key (a claim through ``Claims``, so the liveness monitor frees it if this
member dies)::

    add(key, item)     under the lock: LocalTables[sid] = item
                       Claims.claim(key) ── taken ──► undo, KeyError naming the holder
                       won ──► noted here and in the OwnerCache
    withdraw(key)      Claims.release, forget here, in the cache and in LocalTables
    close()            withdraw everything (RpcGroup.destroy); a later add raises "destroyed"

Why a table per kind with its own lock rather than one group lock: a service and a value
never share a key or a claim, and each table's close() under its own lock is what makes a
register racing a destroy either withdrawn by it or refused, never left behind.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, List, Set

from .._calls import LocalTables, is_async
from .._membership import Claims, Endpoint, Roster
from .._store import ServiceOwner
from .owners import OwnerCache

__all__ = ["KeyKind", "OwnedKeys", "SERVICES", "VALUES"]


class KeyKind:
    """How one kind of published key is held and told.

    Args:
        local: The kind's dict in ``LocalTables`` (where incoming calls find the item).
        store_key: ``(owners, key) -> `` the store key that names the holder.
        holder: ``(worker, item) -> `` the holder text claimed for it.
        release_with: ``(claimed holder, current worker) -> `` the text to release with.
        worker_of: ``holder text -> `` its RPC worker (names the member that holds a key).
        hold, drop: Tell the group's owner cache of this member's own key.
        taken, again, absent: Messages; ``{key}``, ``{group}``, ``{who}``, ``{member}`` filled in.
    """

    def __init__(self, local: Callable[[LocalTables], Dict[str, Any]], store_key: Callable[[OwnerCache, str], str],
                 holder: Callable[[str, Any], str], release_with: Callable[[str, str], str],
                 worker_of: Callable[[str], str], hold: Callable[[OwnerCache, str, str], None],
                 drop: Callable[[OwnerCache, str], None], taken: str, again: str, absent: str) -> None:
        self.local, self.store_key, self.holder, self.release_with = local, store_key, holder, release_with
        self.worker_of, self.hold, self.drop = worker_of, hold, drop
        self.taken, self.again, self.absent = taken, again, absent


#: Services: claimed as a ServiceOwner (worker and whether the service is async), released
#: with the text they were claimed with.
SERVICES = KeyKind(
    local=lambda tables: tables.services,
    store_key=OwnerCache.service_key,
    holder=lambda worker, service: ServiceOwner(worker, is_async(service)).encode(),
    release_with=lambda claimed, worker: claimed,
    worker_of=ServiceOwner.worker_of,
    hold=lambda owners, key, text: owners.hold_service(key, ServiceOwner.decode(text)),
    drop=OwnerCache.drop_service,
    taken="Service [{key}] already registered in Group [{group}] (by member {who!r})",
    again="Service [{key}] already registered in Group [{group}] (by this member)",
    absent="Service [{key}] not registered in Group [{group}] by member {member!r}",
)

#: Values: claimed as the RPC worker's name. A claim made under an earlier worker of this
#: member is released by the current one: Claims reads the old name as the new (see
#: Claims.renewed).
VALUES = KeyKind(
    local=lambda tables: tables.values,
    store_key=OwnerCache.value_key,
    holder=lambda worker, value: worker,
    release_with=lambda claimed, worker: worker,
    worker_of=lambda text: text,
    hold=OwnerCache.hold_value,
    drop=OwnerCache.drop_value,
    taken="Value with key [{key}] already paired to Group [{group}] (by member {who!r})",
    again="Value with key [{key}] already paired to Group [{group}] (by this member)",
    absent="Value with key [{key}] not paired to Group [{group}] by member {member!r}",
)


def _destroyed(group: str) -> RuntimeError:
    return RuntimeError(f"RpcGroup {group!r} has been destroyed")


class OwnedKeys:
    """The keys of one kind this member published in one group incarnation.

    Args:
        kind: ``SERVICES`` or ``VALUES``.
        group: The group's name (for messages).
        sid: The group's service-id prefix, ``"<group>/<epoch>/"``.
        member: This member's name (for messages).
        tables: This process's services and values, as incoming calls see them.
        claims: Claims and releases the store keys.
        endpoint: This member's current RPC worker (names the owner).
        roster: Names the member that holds a key already taken.
        owners: The group's owner cache, told of this member's own keys.
    """

    def __init__(self, kind: KeyKind, group: str, sid: str, member: str, tables: LocalTables, claims: Claims,
                 endpoint: Endpoint, roster: Roster, owners: OwnerCache) -> None:
        self._kind = kind
        self._group = group
        self._sid = sid
        self._member = member
        self._local = kind.local(tables)
        self._claims = claims
        self._endpoint = endpoint
        self._roster = roster
        self._owners = owners
        self._lock = threading.Lock()
        self._mine: Dict[str, str] = {}  # key -> the holder text it was claimed with
        # Store keys this member claimed here and released since (emptied, not deleted:
        # another member may claim one again), bounded by the group's distinct keys;
        # the group's last member out deletes them (see _groups.group_end).
        self._released: Set[str] = set()
        self._closed = False

    def add(self, key: str, item: Any) -> None:
        """Publish ``item`` under ``key`` (both checked by the caller).

        Raises:
            KeyError: ``key`` is held in the group already (the holder named).
            RuntimeError: the group was destroyed here.
        """
        kind = self._kind
        holder = kind.holder(self._endpoint.worker, item)
        sid = self._sid + key
        with self._lock:
            if self._closed:
                raise _destroyed(self._group)
            if key in self._mine:
                raise KeyError(kind.again.format(key=key, group=self._group))
            # In the table before the claim: a caller that sees the claim finds the item.
            self._local[sid] = item
            taken = self._claims.claim(kind.store_key(self._owners, key), holder)
            if taken is not None:
                del self._local[sid]
                who = self._roster.member_of(kind.worker_of(taken))
                raise KeyError(kind.taken.format(key=key, group=self._group, who=who))
            self._mine[key] = holder
            kind.hold(self._owners, key, holder)

    def withdraw(self, key: str) -> None:
        """Withdraw ``key``.

        Raises:
            KeyError: this member does not hold ``key``.
        """
        with self._lock:
            holder = self._mine.get(key)
            if holder is None:
                raise KeyError(self._kind.absent.format(key=key, group=self._group, member=self._member))
            self._withdraw(key, holder)

    def close(self) -> List[str]:
        """Withdraw every key; a later :meth:`add` raises. Idempotent.

        Returns:
            Every store key this member claimed in the group (all released now).
        """
        with self._lock:
            for key, holder in list(self._mine.items()):
                self._withdraw(key, holder)
            self._closed = True
            return sorted(self._released)

    def _withdraw(self, key: str, holder: str) -> None:
        kind = self._kind
        # Released first: should the store fail, the key is still listed here for a retry.
        store_key = kind.store_key(self._owners, key)
        self._claims.release(store_key, kind.release_with(holder, self._endpoint.worker))
        self._released.add(store_key)
        del self._mine[key]
        kind.drop(self._owners, key)
        self._local.pop(self._sid + key, None)
