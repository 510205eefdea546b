"""OwnerCache: who owns each service and value key of one RpcGroup, as this process last saw it.

Owns two dicts, key -> owner, for one group incarnation in one World. The truth is the
store (a key claimed through ``Claims``, spelled by ``Keys``); the cache saves the look-up,
so that a cached call is a single RPC round trip like a raw ``rpc_sync``::

    service(key) / value(key)   cached, owner's worker not gone ──► the cached owner
                                otherwise (or refresh=True) ──► Claims.owner(Keys.service|value)
                                                                 └─► cache it (or forget it)
    hold_* / drop_*             this member's own register / pair / withdraw (no look-up)
    last_owner(kind, key)       who held the key when a look-up (or this member's own
                                withdrawal) last found it free: (member, its RPC worker)

Why a part of its own: the callers (``caller``) read it on every call and correct
it when an owner answers "missing"; the tables (``tables``) write this member's
own keys into it. Neither owns the other's state, and both see the same cache.

No lock: each access is one dict operation (atomic under the GIL); two threads racing
on one key both store an answer the store gave, and the loser's stale entry costs at
most one more look-up.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple, TypeVar

from .._membership import Claims
from .._store import Keys, ServiceOwner
from .._membership import Roster
from ...exception import PeerLostError

__all__ = ["OwnerCache"]

# What the cache holds per key: a ServiceOwner for a service, the RPC worker for a value.
_Owner = TypeVar("_Owner", ServiceOwner, str)


def _same(text: str) -> str:
    return text


def _service_worker(owner: ServiceOwner) -> str:
    return owner.worker


class OwnerCache:
    """The owners of one group incarnation's services and values, cached.

    Args:
        group: The group's name.
        epoch: Its incarnation (see ``_store.keys``).
        keys: The world's keys (spells the store keys of the group's services and values).
        claims: Reads who holds a key.
        roster: Tells a gone RPC worker (its cached keys are looked up again).
    """

    def __init__(self, group: str, epoch: str, keys: Keys, claims: Claims, roster: Roster) -> None:
        self._group = group
        self._epoch = epoch
        self._keys = keys
        self._claims = claims
        self._roster = roster
        self._services: Dict[str, ServiceOwner] = {}
        self._values: Dict[str, str] = {}
        # (member, worker) that held the key when a look-up last found it free, by (kind,
        # key): a caller that called the key's owner before it died, left or withdrew it
        # is told that, not "nobody has it (yet)".
        self._last: Dict[Tuple[str, str], Tuple[str, str]] = {}

    # ---------------------------------------------------------------- store keys
    def service_key(self, key: str) -> str:
        """The store key that holds service ``key``'s :class:`ServiceOwner`."""
        return self._keys.service(self._group, self._epoch, key)

    def value_key(self, key: str) -> str:
        """The store key that holds the RPC worker that paired value ``key``."""
        return self._keys.value(self._group, self._epoch, key)

    # ------------------------------------------------------------------ look-ups
    def service(self, key: str, refresh: bool = False, timeout: Optional[float] = None) -> Optional[ServiceOwner]:
        """Who serves ``key``: the cached owner unless ``refresh`` or it is gone; None if nobody.

        Args:
            timeout: Seconds a store look-up may take (the caller's time left); None: no bound.

        Raises:
            PeerLostError: the world's store is gone (on a look-up).
            TimeoutError: the store did not answer within ``timeout``.
        """
        return self._look_up("s", self._services, self.service_key(key), key, ServiceOwner.decode,
                             _service_worker, refresh, timeout)

    def value(self, key: str, refresh: bool = False, timeout: Optional[float] = None) -> Optional[str]:
        """The RPC worker that paired ``key`` (cached unless ``refresh`` or gone), None if nobody.

        Args:
            timeout: Seconds a store look-up may take (the caller's time left); None: no bound.

        Raises:
            PeerLostError: the world's store is gone (on a look-up).
            TimeoutError: the store did not answer within ``timeout``.
        """
        return self._look_up("v", self._values, self.value_key(key), key, _same, _same, refresh, timeout)

    def last_owner(self, kind: str, key: str) -> Optional[Tuple[str, str]]:
        """``(member, worker)`` that held service (``kind`` "s") or value ("v") ``key``
        when this process last found it, if nobody holds ``key`` since (as far as it knows)."""
        return self._last.get((kind, key))

    def held(self, kind: str, most: int) -> Tuple[List[str], bool]:
        """The service (``kind`` "s") or value ("v") keys of this group that live members
        hold, read from the lists of at most ``most`` of them (store reads: for error
        messages only), and whether some members were left unread."""
        prefix = self.service_key("") if kind == "s" else self.value_key("")
        live = self._roster.members()
        workers = []
        for member in live[:most]:
            try:
                workers.append(self._roster.worker_of(member))
            except PeerLostError:  # (gone since: it holds nothing)
                pass
        return [key[len(prefix):] for key in self._claims.held_under(prefix, workers)], len(live) > most

    def _look_up(self, kind: str, cache: Dict[str, _Owner], store_key: str, key: str,
                 decode: Callable[[str], _Owner], worker_of: Callable[[_Owner], str], refresh: bool,
                 timeout: Optional[float]) -> Optional[_Owner]:
        if not refresh:
            owner = cache.get(key)
            if owner is not None and not self._roster.worker_gone(worker_of(owner)):
                return owner  # the common case: no store round trip
        held = self._claims.owner(store_key, timeout)
        if held is None:
            last = cache.pop(key, None)
            if last is not None:
                self._last[(kind, key)] = (self._roster.member_of(worker_of(last)), worker_of(last))
                # (bounded like the cache: by the keys this process called)
            return None
        self._last.pop((kind, key), None)
        owner = cache[key] = decode(held)
        worker = worker_of(owner)
        if not self._roster.knows_worker(worker):
            # Its member's join has not reached this view yet: a failure of the call about
            # to go there would name the worker ("1_7"), not the member.
            member = self._claims.member_of_worker(worker, timeout)
            if member is not None:
                self._roster.name_worker(worker, member)
        return owner

    # ------------------------------------------------------ this member's own keys
    def hold_service(self, key: str, owner: ServiceOwner) -> None:
        """This member just claimed service ``key`` as ``owner``."""
        self._last.pop(("s", key), None)
        self._services[key] = owner

    def drop_service(self, key: str) -> None:
        owner = self._services.pop(key, None)
        if owner is not None:
            self._last[("s", key)] = (self._roster.member_of(owner.worker), owner.worker)

    def hold_value(self, key: str, worker: str) -> None:
        """This member (RPC worker ``worker``) just paired value ``key``."""
        self._last.pop(("v", key), None)
        self._values[key] = worker

    def drop_value(self, key: str) -> None:
        worker = self._values.pop(key, None)
        if worker is not None:
            self._last[("v", key)] = (self._roster.member_of(worker), worker)
