"""Silences: how long each watched member's heartbeat has stood still as this watcher saw
it, and the notes in the store that let the next watcher go on from there.

::

    a look at a watched member (each tick)                the world's store
      the first: read the note an earlier watcher   <──   m/hush/<name>  "<inc> <count> <seconds>"
        left; one for the same incarnation and count
        starts the timer that many seconds back
      count moved, or this thread was starved: the
        timer starts again
      still for a whole quarter of the bound more   ──>   m/hush/<name>
        ("quiet" step): its nearest watcher that is
        not silent itself writes the silence so far
      still for the whole bound: a suspect (the monitor declares it)

Why: a dead member's watchers are the members before it in the ring (``watch``). Under
heavy churn all of them sometimes die too, after it and before they declared it, or
joiners displace them; the next watcher then timed it from scratch, a whole bound later
(at 256 members with 10 deaths a second, the slowest deaths were named after 14.5 s
instead of ~8). The note carries the silence over: the next watcher declares it at most
a quarter bound (the note's step) after the first watcher would have, plus the time it
took to come to it.

Why durations, not times: the hosts' clocks need not agree. A note says the heartbeat
stood still for at least that long when it was written, and it has stood still since
(else its count would have moved: counts only grow, and a new incarnation names itself in
the note), so taking it as the silence so far never declares a member early. The writer
measured it from its own looks, with the same starvation guard as every timer.

Who writes: the watcher nearest before a member in the ring, or, while that one is
silent too (dead, most likely), the next; the monitor says which (``write``). With every
watcher writing the same note, a death cost three times the writes.

What it costs: one read when a member is first watched (three watchers change at each
join and each death, and the ring looks past silent members), and per silent member one
write per quiet step (at most 3 before the bound). Nothing while every member beats.
Keys: one per member ever silent that long, deleted with its heartbeat
(``Departures.reap``).

Not thread-safe: the liveness thread alone uses it.
"""

from __future__ import annotations

import math
from typing import Dict, Optional, Set, Tuple

from .._store import Keys, MemberRecord, Registry

__all__ = ["Silences"]

Key = Tuple[str, int]  # (member, incarnation)


class _Seen:
    """One watched member as this watcher last saw it."""

    __slots__ = ("count", "since", "steps")

    def __init__(self, count: str, since: float) -> None:
        self.count = count  # its heartbeat counter, as read
        self.since = since  # monotonic time from which it has stood still
        self.steps = 0  # whole quiet steps of silence already written to the note


class Silences:
    """The heartbeat timers of one watcher and the silence notes (see the module doc).

    Args:
        registry: The world's store tables.
        keys: The world's keys.
        notes: Read and write the notes (False: timers only).

    Attributes:
        written: Notes written.
        resumed: Timers moved back by another watcher's note.
    """

    def __init__(self, registry: Registry, keys: Keys, notes: bool = True) -> None:
        self._registry = registry
        self._keys = keys
        self._notes = notes
        self._seen: Dict[Key, _Seen] = {}
        self.written = 0
        self.resumed = 0

    def keep(self, watched: Set[Key]) -> None:
        """Forget the members no longer watched (bounded by the watched members)."""
        for gone in [k for k in self._seen if k not in watched]:
            del self._seen[gone]

    def restart(self, rec: MemberRecord, count: str, now: float) -> None:
        """Its heartbeat moved (or the look cannot be trusted): time it from ``now``."""
        self._seen[(rec.member, rec.incarnation)] = _Seen(count, now)

    def look(self, rec: MemberRecord, count: str, now: float, quiet: float, write: bool = True) -> float:
        """Seconds ``rec``'s heartbeat has stood still at ``count`` (0.0: it moved).

        At the first look, another watcher's note of a silence at the same count sets
        where the timer starts; from ``quiet`` seconds on, when ``write``, the silence so
        far is written at each whole ``quiet`` step.

        Raises:
            PeerLostError: the store is lost.
        """
        key = (rec.member, rec.incarnation)
        seen = self._seen.get(key)
        if seen is None:
            seen = self._seen[key] = _Seen(count, now)
            noted = self._noted(rec, count) if self._notes else None
            if noted is not None:
                seen.since = now - noted
                seen.steps = int(noted // quiet)  # (the next write says more than this note)
                self.resumed += 1
            return now - seen.since
        if seen.count != count:
            self.restart(rec, count, now)
            return 0.0
        still = now - seen.since
        if write and self._notes and still >= quiet and int(still // quiet) > seen.steps:
            seen.steps = int(still // quiet)
            self._registry.set(self._keys.silence(rec.member), f"{rec.incarnation} {count} {still:.3f}")
            self.written += 1
        return still

    def _noted(self, rec: MemberRecord, count: str) -> Optional[float]:
        """The silence another watcher noted for this incarnation at this count, or None."""
        parts = self._registry.get_or_empty(self._keys.silence(rec.member)).split()
        if len(parts) != 3 or parts[0] != str(rec.incarnation) or parts[1] != count:
            return None
        try:
            seconds = float(parts[2])
        except ValueError:
            return None
        return seconds if math.isfinite(seconds) and seconds > 0 else None
