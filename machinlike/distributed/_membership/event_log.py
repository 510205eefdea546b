"""EventLog: the world's membership events, posted to and read from the store in one order.

Owns how far this process has read the log (segment, position, next ``seq``) and
delivers every new entry once, in log order, to the callable it was built with
(``Membership._deliver``).

The log is cut into segments of ``segment`` entries, so that no key grows with the
world's age and nobody reads the whole history::

    m/logk            counter: the segment posts go to (K)
    m/log/<k>         "kind|member|record" lines; full (``segment`` lines) = final
    m/snap/<k>        the state at the start of segment k: counts, then each member's
                      join (and its departure, if gone) with their seq
    m/evn             counter: events posted (wakes readers)

    post(entry)       text = m/log/K; full? seal K (below) and read K again;
                      else compare_set(m/log/K, text, text + line); then bump m/evn
    seal K            m/snap/<K+1> = fold(m/snap/<K>, m/log/K)  (first writer wins)
                      compare_set(m/logk, K, K+1); the winner deletes segment and
                      snapshot K - KEEP
    catch_up()        m/evn moved? deliver the new lines of the segment being read,
                      and of the next ones once it is full
    a new reader      starts from m/snap/<K> (the members as they stand), then segment K

Why compare-and-set on a segment and not append plus a counter per entry: a poster
SIGKILLed mid-post leaves its entry whole or absent, never a numbered hole every reader
would wait on; and a full segment never changes again, so a reader knows when to move on.
Why snapshots: a member joining after 100,000 events reads one snapshot (live members and
the last ``gone_kept`` departures) and one segment, not the history. A reader more than
``KEEP`` segments behind (it slept for thousands of events) finds its segment deleted;
it catches up from the newest snapshot, and says so.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from .._store import Keys, LogEntry, MemberRecord
from .._store import Registry

__all__ = ["EventLog", "EventCounts", "History", "read_history", "SEGMENT"]

log = logging.getLogger(__name__)

#: Entries per segment.
SEGMENT = 256
#: Departed members a snapshot keeps (the most recent); older ones are forgotten.
GONE_KEPT = 1024
#: Segments (and snapshots) kept behind the one posts go to.
KEEP = 4

#: One delivered event: its position in the log and the entry.
Numbered = Tuple[int, LogEntry]


@dataclass(frozen=True)
class EventCounts:
    """How many of each membership event a world's log holds so far.

    Attributes:
        events: Every event (the next event's ``seq``).
        deaths: ``"lost"`` events.
        rejoins: Joins of an incarnation after the first.
        leaves: ``"leave"`` events.
    """

    events: int
    deaths: int
    rejoins: int
    leaves: int

    def plus(self, entries: List[LogEntry]) -> "EventCounts":
        """These counts after ``entries``."""
        kinds = [e.kind for e in entries]
        return EventCounts(self.events + len(entries), self.deaths + kinds.count("lost"),
                           self.rejoins + sum(1 for e in entries if e.kind == "join" and e.record.incarnation > 1),
                           self.leaves + kinds.count("leave"))


_NO_EVENTS = EventCounts(0, 0, 0, 0)


@dataclass(frozen=True)
class History:
    """What a log says so far, condensed: the members' events (each live member's join,
    each kept departed member's join and departure) in log order, and the counts."""

    entries: List[Numbered]
    counts: EventCounts


class _Snapshot:
    """The state at the start of a segment: counts and, per member, its join and departure."""

    def __init__(self, counts: EventCounts, joins: Dict[str, Numbered], departures: Dict[str, Numbered]) -> None:
        self.counts = counts
        self.joins = joins
        self.departures = departures

    @staticmethod
    def decode(text: str) -> "_Snapshot":
        if not text:
            return _Snapshot(_NO_EVENTS, {}, {})
        head, _, body = text.partition("\n")
        events, deaths, rejoins, leaves = (int(v) for v in head.split("|")[1:])
        joins: Dict[str, Numbered] = {}
        departures: Dict[str, Numbered] = {}
        for line in body.splitlines():
            seq, _, encoded = line.partition("|")
            entry = LogEntry.decode_log(encoded)[0]
            (joins if entry.kind == "join" else departures)[entry.record.member] = (int(seq), entry)
        return _Snapshot(EventCounts(events, deaths, rejoins, leaves), joins, departures)

    def encode(self) -> str:
        c = self.counts
        lines = [f"#|{c.events}|{c.deaths}|{c.rejoins}|{c.leaves}\n"]
        lines += [f"{seq}|{entry.encode()}" for seq, entry in self.entries()]
        return "".join(lines)

    def entries(self) -> List[Numbered]:
        return sorted(list(self.joins.values()) + list(self.departures.values()), key=lambda n: n[0])

    def after(self, entries: List[LogEntry]) -> "_Snapshot":
        """The state after ``entries`` (the next ones of the log), as a new snapshot."""
        joins, departures = dict(self.joins), dict(self.departures)
        seq = self.counts.events
        for entry in entries:
            rec = entry.record
            known = joins.get(rec.member)
            if entry.kind == "join":
                if known is None or known[1].record.incarnation < rec.incarnation:
                    joins[rec.member] = (seq, entry)
                    departures.pop(rec.member, None)
            elif entry.kind == "move":
                if known is not None and known[1].record.incarnation == rec.incarnation:
                    joins[rec.member] = (known[0], LogEntry("join", rec))
            elif known is None or known[1].record.incarnation <= rec.incarnation:
                departures[rec.member] = (seq, entry)
            seq += 1
        if len(departures) > GONE_KEPT:  # the oldest departures are forgotten
            for member, _ in sorted(departures.items(), key=lambda kv: kv[1][0])[:len(departures) - GONE_KEPT]:
                del departures[member]
                joins.pop(member, None)
        return _Snapshot(self.counts.plus(entries), joins, departures)


def _lines(text: str) -> List[LogEntry]:
    return LogEntry.decode_log(text) if text else []


def read_history(get: Callable[[str], Optional[str]], keys: Keys) -> History:
    """The log as it stands, condensed (see :class:`History`); ``get`` reads a key (None: absent).

    For readers outside the world (the status view) and for event counts.
    """
    head = int(get(keys.log_head()) or 0)
    state = _Snapshot.decode(get(keys.log_snapshot(head)) or "") if head else _Snapshot(_NO_EVENTS, {}, {})
    k = head
    while True:
        entries = _lines(get(keys.log_segment(k)) or "")
        state = state.after(entries)
        if not entries or len(entries) < SEGMENT:
            break
        k += 1
    return History(state.entries(), state.counts)


class EventLog:
    """The world's event log, as this process reads it.

    Args:
        registry: The world's store tables.
        keys: The world's keys.
        deliver: Called with each new entry and its position in the log, in order.
        segment: Entries per segment (tests make it small).
    """

    def __init__(self, registry: Registry, keys: Keys, deliver: Callable[[LogEntry, int], None],
                 segment: int = SEGMENT) -> None:
        self._registry = registry
        self._keys = keys
        self._deliver = deliver
        self._segment = segment
        # Held while reading and delivering: entries are delivered once, in order.
        self._lock = threading.Lock()
        self._started = False
        self._k = 0  # the segment being read
        self._pos = 0  # entries of it delivered
        self._seq = 0  # the next entry's position in the whole log
        self._counted = 0

    # ---------------------------------------------------------------- posting
    def post(self, kind: str, rec: MemberRecord) -> None:
        """Append an event for everyone (this process sees it at its next catch-up)."""
        line = LogEntry(kind, rec).encode()
        reg = self._registry
        while True:
            k = reg.add(self._keys.log_head(), 0)
            key = self._keys.log_segment(k)
            text = reg.get_or_empty(key)
            if text.count("\n") >= self._segment:
                self._seal(k, text)
                continue
            if reg.compare_set(key, text, text + line) == text + line:
                break
        reg.add(self._keys.log_count(), 1)

    def _seal(self, k: int, full: str) -> None:
        """Move posts past full segment ``k``: its snapshot first, then the head."""
        reg = self._registry
        previous = _Snapshot.decode(reg.get_or_empty(self._keys.log_snapshot(k))) if k else \
            _Snapshot(_NO_EVENTS, {}, {})
        reg.compare_set(self._keys.log_snapshot(k + 1), "", previous.after(_lines(full)).encode())
        if reg.compare_set(self._keys.log_head(), str(k), str(k + 1)) == str(k + 1) and k + 1 - KEEP >= 0:
            old = k + 1 - KEEP
            reg.delete([self._keys.log_segment(old), self._keys.log_snapshot(old)])

    # ---------------------------------------------------------------- reading
    def catch_up(self, total: Optional[int] = None) -> None:
        """Deliver every entry posted since the last call, in log order.

        Args:
            total: The events counter ``m/evn`` as the caller just read it (the liveness
                watch reads it with the heartbeats, in one request); None: read it here.
        """
        with self._lock:
            if total is None:
                total = self._registry.add(self._keys.log_count(), 0)
            if total <= self._counted and self._started:
                return
            if not self._started:
                self._start()
            while True:
                text = self._registry.get_or_empty(self._keys.log_segment(self._k))
                if not text and self._registry.add(self._keys.log_head(), 0) > self._k + 1:
                    self._skip_ahead()
                    continue
                # Only the new lines are decoded: at 1,024 members a segment is read by
                # every member after each post, and decoding all 256 lines cost the most.
                lines = text.splitlines(keepends=True)
                for entry in _lines("".join(lines[self._pos:])):
                    self._deliver(entry, self._seq)
                    self._seq += 1
                self._pos = len(lines)
                if len(lines) < self._segment:
                    break
                self._k, self._pos = self._k + 1, 0
            self._counted = total

    def _start(self) -> None:
        """A new reader begins at the head's snapshot: the members as they stand."""
        self._started = True
        head = self._registry.add(self._keys.log_head(), 0)
        if head:
            self._resume(head)

    def _resume(self, k: int) -> None:
        state = _Snapshot.decode(self._registry.get_or_empty(self._keys.log_snapshot(k)))
        for seq, entry in state.entries():
            if seq >= self._seq:
                self._deliver(entry, seq)
        self._k, self._pos, self._seq = k, 0, max(self._seq, state.counts.events)

    def _skip_ahead(self) -> None:
        """This reader's segment was deleted (it fell ``KEEP`` segments behind)."""
        head = self._registry.add(self._keys.log_head(), 0)
        log.warning("machinlike: this member read the event log too slowly (segment %d is gone, posts are at "
                    "%d); it catches up from the newest snapshot and misses the events in between", self._k,
                    head)
        self._resume(head)
