"""Departures: the store records of members long gone, deleted so that no key is kept per name.

Why: a member leaves keys behind that are per *name*, not per worker: its incarnation
counter, its emptied claim, its heartbeat, its exit cause, the election and clean-up marks
of its last incarnations, and the keys it had claimed (emptied). A job whose actors come back under
new names (a fresh name per preemption, per Ray actor, per SLURM job step) left about
seven keys per death for good: 1,500 deaths a day is 10,000 keys a day.

Nobody may need them when they go: a late member still declaring the incarnation would
elect itself again, and a view that still remembers the member as gone would meet a
returning name whose incarnations restart at 1. So a departure's records are deleted
only after ``LAG`` blocks of ``BLOCK`` later departures (18,432 by default): more than
any view remembers (``_membership.roster.GONE_KEPT``, 16,384) or the log's snapshots keep
(``_membership.event_log.GONE_KEPT``, 1,024)::

    m/dep/n            counter: departures recorded
    m/dep/<j>          block j: member, incarnation, released keys (\x1f between), a line each

    record(member, inc, keys)   n = add(m/dep/n) - 1; append to block n // BLOCK;
                                the one that takes a block's last slot reaps block j - LAG
    reap(j)                     for each line whose member is still gone (claim empty,
                                counter unchanged): delete its claim, then its heartbeat,
                                silence note, exit cause and servers' notes, its marks, the
                                released keys still empty, its counter;
                                then the block itself

What it costs: the store keeps at most ``(LAG + 1) x BLOCK`` departures' records; one
reap (a few store operations per line) every ``BLOCK`` departures, on a thread of its
own in the process that records the block's last one.

The one race left: a member that comes back under a reaped name within the few
milliseconds between the reap's check and its deletion of the claim can lose its fresh
claim; the others then declare it lost, and it is told so (cut off, with the reason)
instead of failing silently. Likewise a key released 18,432 departures ago and claimed
again in that moment loses its new claim (its owner still serves it; look-ups miss it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Iterable, List, Optional, Tuple

from .._store import Keys
from .._store import Registry

__all__ = ["Departures", "BLOCK", "LAG", "KEPT_ENV"]

log = logging.getLogger(__name__)

_SEP = "\x1f"  # in no member name nor store key machinlike writes

#: Departures per block.
BLOCK = 256
#: Blocks a departure waits before its records go.
LAG = 72
#: Departures whose records are kept (tests and soaks make it small); default BLOCK x LAG.
KEPT_ENV = "MACHINLIKE_DEPARTURES_KEPT"


def _from_env() -> Tuple[int, int]:
    """(block, lag) for ``MACHINLIKE_DEPARTURES_KEPT`` (default: BLOCK, LAG)."""
    text = os.environ.get(KEPT_ENV)
    if text is None:
        return BLOCK, LAG
    try:
        kept = int(text)
    except ValueError:
        raise ValueError(f"{KEPT_ENV}={text!r} must be a whole number of departures (at least 8)") from None
    if kept < 8:
        raise ValueError(f"{KEPT_ENV}={kept} must be at least 8")
    block = min(BLOCK, kept // 8)
    return block, kept // block


class Departures:
    """Records departures and deletes the records of the old ones.

    Args:
        registry: The world's store tables.
        keys: The world's keys.
        block, lag: See the module doc; 0: from ``MACHINLIKE_DEPARTURES_KEPT`` (every
            process of a world must see the same), else BLOCK and LAG.
    """

    def __init__(self, registry: Registry, keys: Keys, block: int = 0, lag: int = 0) -> None:
        self._registry = registry
        self._keys = keys
        self._block, self._lag = (block, lag) if block and lag else _from_env()
        self._reaping: List[threading.Thread] = []  # started, not yet seen done (settle)

    def record(self, member: str, incarnation: int, released: Iterable[str] = ()) -> None:
        """Note that ``incarnation`` of ``member`` departed (once per departure), with the
        keys it held that were released for it (deleted later if still empty)."""
        n = self._registry.add(self._keys.departures_count(), 1) - 1
        j = n // self._block
        line = _SEP.join([member, str(incarnation), *released])
        self._registry.append(self._keys.departures(j), line + "\n")
        if n % self._block == self._block - 1 and j - self._lag >= 0:
            # Off the caller's thread: a block is ~1,500 store operations, and the caller is
            # a liveness monitor whose heartbeat must not stall (a lease can be 0.75 s).
            thread = threading.Thread(target=self._reap_logged, args=(j - self._lag,), daemon=True,
                                      name="machinlike-departures")
            self._reaping = [t for t in self._reaping if t.is_alive()] + [thread]  # bounded: the running ones
            thread.start()

    def last_released(self, key: str) -> Optional[Tuple[str, int]]:
        """``(member, incarnation)`` of the newest recorded departure that released ``key``,
        searched in the newest two blocks (two or three store reads: for waits that have
        found ``key`` free), None when none of those released it."""
        count = self._registry.get_or_empty(self._keys.departures_count())
        if not count.isdigit() or int(count) == 0:
            return None
        newest = (int(count) - 1) // self._block
        for j in range(newest, max(-1, newest - 2), -1):
            for member, incarnation, released in reversed(_lines(self._registry.get_or_empty(self._keys.departures(j)))):
                if key in released:
                    return member, incarnation
        return None

    def settle(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for the reaps this process started."""
        deadline = time.monotonic() + timeout
        while self._reaping:
            self._reaping[0].join(max(0.0, deadline - time.monotonic()))
            if self._reaping[0].is_alive():
                return
            self._reaping.pop(0)

    def _reap_logged(self, j: int) -> None:
        try:
            self.reap(j)
        except Exception:  # the store went away, most likely: the next block's reap retries none of it
            log.warning("machinlike: deleting the records of departure block %d failed", j, exc_info=True)

    def reap(self, j: int) -> int:
        """Delete the records of block ``j``'s members that are still gone; how many went."""
        reg = self._registry
        reaped = 0
        for member, incarnation, released in _lines(reg.get_or_empty(self._keys.departures(j))):
            counter = self._keys.incarnations(member)
            if reg.get_or_empty(self._keys.live(member)) or reg.get_or_empty(counter) != str(incarnation):
                continue  # it came back (a later departure of it is recorded, and reaped, later)
            live = self._keys.live(member)
            reg.delete([live])  # first: the check above is the newest word on the claim
            marks = [key for inc in (incarnation, incarnation - 1) if inc >= 1
                     for key in (self._keys.lost(member, inc), self._keys.lost_posted(member, inc),
                                 self._keys.gone(member, inc))]
            reg.delete([self._keys.heartbeat(member), self._keys.silence(member), self._keys.probe_request(member),
                        self._keys.server_notes(member), self._keys.exit_cause(member), *marks])
            reg.delete([key for key in released if not reg.get_or_empty(key)])
            reg.delete([counter])  # last: while it stands, a returning member counts on from it
            reaped += 1
        reg.delete([self._keys.departures(j)])
        if reaped:
            log.info("machinlike: deleted the store records of %d members gone for %d departures", reaped,
                     self._lag * self._block)
        return reaped


def _lines(text: str) -> List[Tuple[str, int, List[str]]]:
    out = []
    for line in text.splitlines():
        parts = line.split(_SEP)
        if len(parts) >= 2 and parts[1].isdigit():
            out.append((parts[0], int(parts[1]), parts[2:]))
    return out
