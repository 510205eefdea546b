"""Barrier: this member's rounds of one fixed-member RpcGroup's barrier.

Owns the round counter and the lock that runs this member's rounds one at a time. A round
is a key per member under ``<ns>rg/<group>/<epoch>/bar/<round>/`` (spelled by ``Keys``)::

    wait()   under the lock: round g = counter++
             set  bar/g/<me>
             Waits.wait_all(bar/g/, members)   fails fast, naming a gone member
             delete bar/(g-1)/<me>             safe: whoever passed g had everyone leave g - 1
    fail()   under the lock: round g = counter++
             set  bar/g/<me> = FAILED_MARK + why  its waiters raise at once, saying why

Why its own part: the counter must count exactly this member's rounds (two threads calling
``barrier()`` are two rounds), and nothing else of the group touches it. An open group
(``members=None``) has none: it has no fixed set of members to wait for.
"""

from __future__ import annotations

import threading
import time
from typing import Dict, Optional, Tuple

from .._store import FAILED_MARK, Keys
from .._store import Registry
from .._membership import Waits
from ..._deadline import deadline_left

__all__ = ["Barrier"]


class Barrier:
    """The barrier of one group incarnation, as this member takes it.

    Args:
        group: The group's name.
        epoch: Its incarnation (see ``_store.keys``).
        members: Its members, sorted.
        incarnations: The incarnation each member must have (elastic worlds: one that
            came back is a new process, gone for this group); None: any.
        member: This member's name.
        keys: The world's keys.
        registry: Writes and deletes the arrival keys.
        waits: Waits for the others, failing fast for a gone one.
    """

    def __init__(self, group: str, epoch: str, members: Tuple[str, ...], incarnations: Optional[Dict[str, int]],
                 member: str, keys: Keys, registry: Registry, waits: Waits) -> None:
        self._group = group
        self._epoch = epoch
        self._members = members
        self._incarnations = incarnations
        self._member = member
        self._keys = keys
        self._registry = registry
        self._waits = waits
        self._lock = threading.Lock()
        self._generation = 0  # this member's next round

    def last_key(self) -> Optional[str]:
        """The arrival key of this member's last round (the one left in the store), None
        before its first round. (Read without the lock: a round under way holds it.)"""
        generation = self._generation
        if not generation:
            return None
        return self._keys.barrier_prefix(self._group, self._epoch, generation - 1) + self._member

    def wait(self, wait: float, skip_gone: bool = False) -> None:
        """Arrive, and wait up to ``wait`` seconds for every member to arrive.

        Args:
            skip_gone: Wait for the live members only (a gone member counts as arrived).

        Raises:
            TimeoutError: naming the members that did not arrive, or an earlier round of
                this member that did not finish.
            PeerLostError: a member is gone (not with ``skip_gone``).
        """
        deadline = time.monotonic() + wait
        # Rounds of one member run one at a time, which is what makes deleting the
        # previous round's key safe: whoever passed round g had every member leave g - 1.
        if not self._lock.acquire(timeout=wait):
            raise TimeoutError(f"barrier of RpcGroup {self._group!r}: an earlier round of this member "
                               f"did not finish within {wait:g} s")
        try:
            generation = self._generation
            self._generation += 1
            prefix = self._keys.barrier_prefix(self._group, self._epoch, generation)
            self._registry.set(prefix + self._member, "1")
            self._waits.wait_all(prefix, self._members, self._members, max(0.001, deadline_left(deadline)),
                                 f"barrier of RpcGroup {self._group!r}: members", wait, self._incarnations,
                                 skip_gone)
            if generation:
                self._registry.delete([self._keys.barrier_prefix(self._group, self._epoch, generation - 1)
                                       + self._member])
        finally:
            self._lock.release()

    def fail(self, why: str) -> None:
        """Arrive at this member's next round as failed: the members waiting for it there
        raise at once, naming it and quoting ``why`` (cut to 2,000 characters). Raises
        nothing: a round of another thread that holds the lock for 1 s wins, and the store
        gone means there is nobody left to tell."""
        if not self._lock.acquire(timeout=1.0):
            return
        try:
            generation = self._generation
            self._generation += 1
            prefix = self._keys.barrier_prefix(self._group, self._epoch, generation)
            try:
                self._registry.set(prefix + self._member, FAILED_MARK + why[:2000])
            except Exception:  # (the store is gone: so are the waiters' waits)
                pass
        finally:
            self._lock.release()
