"""ServiceTable and ValueTable: what this member published in one RpcGroup, and withdrawing it.

Each owns its lock and the keys this member holds in the group: a service's callable or a
paired value stays in this process (in ``LocalTables``, where incoming calls find it by
service id ``<group>/<epoch>/<key>``), and the store says who holds the key (a claim
through ``Claims``, so the liveness monitor frees it if this member dies)::

    register(key, f) / pair(key, v)   under the lock: LocalTables[sid] = f | v
                                      Claims.claim(key) ── taken ──► undo, KeyError naming the holder
                                      won ──► noted here and in the OwnerCache
    deregister(key) / unpair(key)     Claims.release, forget here, in the cache and in LocalTables
    close()                           withdraw everything (RpcGroup.destroy); later
                                      register / pair raise "destroyed"

Why two classes with their own locks rather than one group lock: a service and a value
never share a key or a claim, and each table's close() under its own lock is what makes a
register racing a destroy either withdrawn by it or refused, never left behind.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Set

from .._calls import LocalTables, is_async
from .._membership import Claims
from .._membership import Endpoint
from .owners import OwnerCache
from .._store import ServiceOwner
from .._membership import Roster

__all__ = ["ServiceTable", "ValueTable"]


def _destroyed(group: str) -> RuntimeError:
    return RuntimeError(f"RpcGroup {group!r} has been destroyed")


class ServiceTable:
    """The services this member registered in one group incarnation.

    Args:
        group: The group's name (for messages).
        sid: The group's service-id prefix, ``"<group>/<epoch>/"``.
        member: This member's name (for messages).
        tables: This process's services and values, as incoming calls see them.
        claims: Claims and releases the store keys.
        endpoint: This member's current RPC worker (names the owner).
        roster: Names the member that holds a key already taken.
        owners: The group's owner cache, told of this member's own keys.
    """

    def __init__(self, group: str, sid: str, member: str, tables: LocalTables, claims: Claims,
                 endpoint: Endpoint, roster: Roster, owners: OwnerCache) -> None:
        self._group = group
        self._sid = sid
        self._member = member
        self._tables = tables
        self._claims = claims
        self._endpoint = endpoint
        self._roster = roster
        self._owners = owners
        self._lock = threading.Lock()
        self._mine: Dict[str, ServiceOwner] = {}  # key -> the holder it was claimed with
        self._closed = False

    def register(self, key: str, service: Callable[..., Any]) -> None:
        """Serve ``service`` under ``key`` (checked by the caller: a key, a callable).

        Raises:
            KeyError: ``key`` is registered in the group already (the holder named).
            RuntimeError: the group was destroyed here.
        """
        holder = ServiceOwner(self._endpoint.worker, is_async(service))
        sid = self._sid + key
        with self._lock:
            if self._closed:
                raise _destroyed(self._group)
            if key in self._mine:
                raise KeyError(f"Service [{key}] already registered in Group [{self._group}] (by this member)")
            # In the table before the claim: a caller that sees the claim finds the service.
            self._tables.services[sid] = service
            taken = self._claims.claim(self._owners.service_key(key), holder.encode())
            if taken is not None:
                del self._tables.services[sid]
                raise KeyError(f"Service [{key}] already registered in Group [{self._group}] "
                               f"(by member {self._roster.member_of(ServiceOwner.worker_of(taken))!r})")
            self._mine[key] = holder
            self._owners.hold_service(key, holder)

    def deregister(self, key: str) -> None:
        """Withdraw service ``key``.

        Raises:
            KeyError: this member has not registered ``key``.
        """
        with self._lock:
            holder = self._mine.get(key)
            if holder is None:
                raise KeyError(f"Service [{key}] not registered in Group [{self._group}] by member {self._member!r}")
            self._withdraw(key, holder)

    def close(self) -> None:
        """Withdraw every service; later :meth:`register` calls raise. Idempotent."""
        with self._lock:
            for key, holder in list(self._mine.items()):
                self._withdraw(key, holder)
            self._closed = True

    def _withdraw(self, key: str, holder: ServiceOwner) -> None:
        # Released first: should the store fail, the key is still listed here for a retry.
        self._claims.release(self._owners.service_key(key), holder.encode())
        del self._mine[key]
        self._owners.drop_service(key)
        self._tables.services.pop(self._sid + key, None)


class ValueTable:
    """The values this member paired in one group incarnation.

    Args:
        group: The group's name (for messages).
        sid: The group's service-id prefix, ``"<group>/<epoch>/"``.
        member: This member's name (for messages).
        tables: This process's services and values, as incoming calls see them.
        claims: Claims and releases the store keys.
        endpoint: This member's current RPC worker (names the owner).
        roster: Names the member that holds a key already taken.
        owners: The group's owner cache, told of this member's own keys.
    """

    def __init__(self, group: str, sid: str, member: str, tables: LocalTables, claims: Claims,
                 endpoint: Endpoint, roster: Roster, owners: OwnerCache) -> None:
        self._group = group
        self._sid = sid
        self._member = member
        self._tables = tables
        self._claims = claims
        self._endpoint = endpoint
        self._roster = roster
        self._owners = owners
        self._lock = threading.Lock()
        self._mine: Set[str] = set()
        self._closed = False

    def pair(self, key: str, value: Any) -> None:
        """Publish ``value`` under ``key`` (checked by the caller).

        Raises:
            KeyError: ``key`` is paired in the group already (the holder named).
            RuntimeError: the group was destroyed here.
        """
        sid = self._sid + key
        with self._lock:
            if self._closed:
                raise _destroyed(self._group)
            if key in self._mine:
                raise KeyError(f"Value with key [{key}] already paired to Group [{self._group}] (by this member)")
            self._tables.values[sid] = value
            me = self._endpoint.worker
            taken = self._claims.claim(self._owners.value_key(key), me)
            if taken is not None:
                del self._tables.values[sid]
                raise KeyError(f"Value with key [{key}] already paired to Group [{self._group}] "
                               f"(by member {self._roster.member_of(taken)!r})")
            self._mine.add(key)
            self._owners.hold_value(key, me)

    def unpair(self, key: str) -> None:
        """Withdraw value ``key``.

        Raises:
            KeyError: this member has not paired ``key``.
        """
        with self._lock:
            if key not in self._mine:
                raise KeyError(f"Value with key [{key}] not paired to Group [{self._group}] by member {self._member!r}")
            self._withdraw(key)

    def close(self) -> None:
        """Withdraw every value; later :meth:`pair` calls raise. Idempotent."""
        with self._lock:
            for key in list(self._mine):
                self._withdraw(key)
            self._closed = True

    def _withdraw(self, key: str) -> None:
        # A claim made under an earlier worker of this member is released by the current
        # one: Claims reads the old name as the new (see Claims.renewed).
        self._claims.release(self._owners.value_key(key), self._endpoint.worker)
        self._mine.discard(key)
        self._owners.drop_value(key)
        self._tables.values.pop(self._sid + key, None)
