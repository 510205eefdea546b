"""Claims: registry keys this member holds, noted so that they are freed when it dies.

Owns the lock under which keys are claimed and moved, and the RPC workers this member
answered as before a renewal. A claim is one compare-and-set (``Registry.claim``) plus a
line in ``m/own/<worker>``; whoever declares the worker lost releases every key listed
there (:meth:`free`), so a survivor can take them over.

    claim(key, holder)    compare_set(key, "", holder); won -> append OwnedKey to m/own/<worker>
    take_over(key, stale, holder)  compare_set(key, stale, holder): a key its own gone
                          incarnation still holds; won -> noted as a claim
    release(key, holder)  compare_set(key, holder, ""); once the released lines of m/own/<worker>
                          outnumber the held ones (and 16), it is written anew from the held
    renewed(renew)        under the lock: the endpoint renews its worker, then every key
                          listed under the old worker moves to the new one
    free(worker)          release every key listed under a (gone) worker; delete the entries
                          of its retired workers (noted at each renewal) and their RPC
                          group keys (their torch ids are free again)

Why one lock: a claim made while the worker is being replaced would be noted under the
old name and never moved; a holder naming an old worker is read as naming the current one.
Only this member writes its own list, under this lock, so it can be rewritten from what it
holds: a member that registers and withdraws (or creates and destroys groups) for days
would otherwise grow its list by a line per claim it ever made.
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Sequence

from .endpoint import Endpoint
from .._store import Keys, MemberRecord, OwnedKey, rebind_holder
from .._store import Registry

__all__ = ["Claims"]

_OLD_KEPT = 64
_STALE_MIN = 16  # released lines tolerated in m/own/<worker> before it is rewritten


class Claims:
    """The registry keys of this member.

    Args:
        registry: The world's store tables.
        keys: The world's keys.
        endpoint: This member (its current RPC worker names the claims).
    """

    def __init__(self, registry: Registry, keys: Keys, endpoint: Endpoint) -> None:
        self._registry = registry
        self._keys = keys
        self._endpoint = endpoint
        self._lock = threading.Lock()
        # This member's workers before its renewals, the newest _OLD_KEPT of them: every
        # renewal moves each claim to the new worker, so only a holder read just before
        # one can name an old worker; older ones are forgotten (a member that recycles
        # for days would keep one per recycling).
        self._old_workers: Dict[str, None] = {}
        # m/own/<current worker> as this member wrote it (key -> its line), without the
        # lines of claims released since; _stale counts those.
        self._listed: Dict[str, str] = {}
        self._stale = 0
        # Keys released since this member began to leave (None: it is not leaving): its
        # groups withdraw what they hold first, and these went with it (see free).
        self._taken: Optional[List[str]] = None

    def claim(self, key: str, holder: str) -> Optional[str]:
        """Claim registry ``key`` for ``holder`` (noted, so it is freed if this member dies).

        ``holder`` names this member's RPC worker (a worker name or a ``ServiceOwner``'s
        encoding); one naming a worker this member had before a renewal is taken as
        naming the current one.

        Returns:
            None when claimed; else who holds it.
        """
        with self._lock:
            holder = self._current(holder)
            held = self._registry.claim(key, holder)
            if held is None:
                self._note(key, holder)
        return held

    def take_over(self, key: str, stale: str, holder: str) -> bool:
        """Claim ``key`` from ``stale``, a holder this member's earlier incarnation left
        (which is gone: this one won the name), for ``holder``; noted like :meth:`claim`.

        Returns:
            False when ``stale`` no longer holds it (its declarer freed it meanwhile).
        """
        with self._lock:
            holder = self._current(holder)
            if self._registry.compare_set(key, stale, holder) != holder:
                return False
            self._note(key, holder)
            return True

    def _note(self, key: str, holder: str) -> None:
        # (under the lock)
        line = OwnedKey(key, holder).encode()
        self._registry.append(self._keys.owned(self._endpoint.worker), line)
        if self._listed.pop(key, None) is not None:
            self._stale += 1
        self._listed[key] = line

    def release(self, key: str, holder: str) -> bool:
        """Free ``key`` if ``holder`` holds it; False when it does not."""
        with self._lock:
            released = self._registry.release(key, self._current(holder))
            if self._listed.pop(key, None) is not None:
                if self._taken is not None:
                    self._taken.append(key)
                self._stale += 1
                if self._stale > max(_STALE_MIN, len(self._listed)):
                    self._registry.set(self._keys.owned(self._endpoint.worker), "".join(self._listed.values()))
                    self._stale = 0
            return released

    def leaving(self) -> None:
        """This member begins to leave the world: the keys it releases from now on went
        with it (its departure names them, :meth:`free`)."""
        with self._lock:
            self._taken = []

    def owner(self, key: str, timeout: Optional[float] = None) -> Optional[str]:
        """Who holds ``key`` right now (its holder text), None if nobody.

        Args:
            timeout: Seconds the caller has left (see ``Registry.owner``); None: no bound.
        """
        return self._registry.owner(key, timeout)

    def member_of_worker(self, worker: str, timeout: Optional[float] = None) -> Optional[str]:
        """The member whose RPC worker ``worker`` is, as its join wrote it; None if the
        store has no entry (it left, or was cleaned up after its loss).

        Raises:
            TimeoutError: the store did not answer within ``timeout``.
            PeerLostError: the store is gone.
        """
        return self._registry.owner(self._keys.worker(worker), timeout)

    def held_under(self, prefix: str, workers: Sequence[str]) -> List[str]:
        """The keys starting with ``prefix`` that ``workers`` noted as claimed and that are
        held now, sorted. Two or three store round trips: for error messages only."""
        listed = self._registry.values_or_empty(self._keys.owned(""), list(workers))
        found = sorted({owned.key for text in listed for owned in OwnedKey.decode_all(text)
                        if owned.key.startswith(prefix)})
        return [key for key, held in zip(found, self._registry.values_or_empty("", found)) if held]

    def _current(self, holder: str) -> str:
        return rebind_holder(holder, self._old_workers.keys(), self._endpoint.worker)

    def renewed(self, renew: Callable[[], MemberRecord]) -> None:
        """Run ``renew`` (the endpoint takes a new worker), then move the keys to that worker.

        Args:
            renew: Returns the record before the renewal; may raise (nothing is moved).
        """
        with self._lock:
            self._old_workers[self._endpoint.worker] = None
            while len(self._old_workers) > _OLD_KEPT:
                del self._old_workers[next(iter(self._old_workers))]
            old = renew()
            moved = []
            entries = self._keys.worker("")
            for owned in OwnedKey.decode_all(self._registry.get_or_empty(self._keys.owned(old.worker))):
                if owned.key.startswith(entries):
                    # A retired worker's entry, noted below: kept while it is there (its
                    # agent not reaped yet, or the first worker's, kept for the incarnation).
                    if self._registry.get_or_empty(owned.key):
                        moved.append(owned.encode())
                    continue
                new = self._current(owned.holder)
                if self._registry.compare_set(owned.key, owned.holder, new) == new:
                    moved.append(OwnedKey(owned.key, new).encode())
            # The old worker's entry outlives this renewal (until Endpoint.forget_retired
            # deletes it when its agent is reaped; the first worker's, for the incarnation's
            # life): noted, so that if this member dies first, freeing it deletes it too,
            # and its torch id is given back.
            moved.append(OwnedKey(self._keys.worker(old.worker), self._endpoint.name).encode())
            if moved:
                self._registry.append(self._keys.owned(self._endpoint.worker), "".join(moved))
            self._listed = {owned.key: owned.encode() for owned in OwnedKey.decode_all("".join(moved))}
            self._stale = 0
            # Every claim moved: no key is left per retired worker.
            self._registry.delete([self._keys.owned(old.worker)])

    def free(self, worker: str) -> List[str]:
        """Release every key ``worker`` (a gone member's) claimed; idempotent.

        Returns:
            The keys released (emptied, not deleted: another member may claim one at once).
            This member's own (its leave) are exactly those it held when it began to leave
            (:meth:`leaving`): its list in the store still names keys it released before,
            and a release of a key already empty cannot be told from one that emptied it
            (a departure's keys say what its member took along: wait_paired).
        """
        entries = self._keys.worker("")
        held = None
        if worker == self._endpoint.worker:
            with self._lock:
                held = set(self._listed).union(self._taken or ())
        released: List[str] = []
        for owned in OwnedKey.decode_all(self._registry.get_or_empty(self._keys.owned(worker))):
            if owned.key.startswith(entries):
                self._registry.delete([owned.key])  # a worker's entry: never claimed by another
                # Already off the RPC group's list (pruned when it retired): nobody's
                # prune would delete its address and id claim any more.
                self._endpoint.forget_group_keys(owned.key[len(entries):])
            elif (held is None or owned.key in held) and owned.key not in released \
                    and self._registry.release(owned.key, owned.holder):
                released.append(owned.key)
        self._registry.delete([self._keys.owned(worker)])
        return released
