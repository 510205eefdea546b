"""What the event log says, condensed: counts, snapshots, and the history read from outside.

A snapshot is the state at the start of a range of the log (see ``event_log``): the
counts, then each member's join (and its departure, if gone) with their positions::

    #|events|deaths|rejoins|leaves|start     start: the position the range begins at
    <seq>|kind|member|record                 one line per kept join or departure

Why a module of its own: the fold is pure (no store, no thread), shared by the log's
sealer, its new readers and the status view, which reads the log without joining.
No state beyond the values; the only I/O is ``read_history``'s reads.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

from .._store import Keys, LogEntry

__all__ = ["EventCounts", "History", "Snapshot", "read_history", "entry_of", "GONE_KEPT", "SEGMENT", "SKIP"]

#: Positions per range (one snapshot each); tests make it small.
SEGMENT = 256
#: Departed members a snapshot keeps (the most recent); older ones are forgotten.
GONE_KEPT = 1024
#: What fills a position whose poster died between claiming and writing it: no event.
SKIP = "\x00skip"

#: One delivered event: its position in the log and the entry.
Numbered = Tuple[int, LogEntry]


@dataclass(frozen=True)
class EventCounts:
    """How many of each membership event a world's log holds so far.

    Attributes:
        events: Every event (skipped positions, whose poster died mid-post, not counted).
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


NO_EVENTS = EventCounts(0, 0, 0, 0)


@dataclass(frozen=True)
class History:
    """What a log says so far, condensed: the members' events (each live member's join,
    each kept departed member's join and departure) in log order, and the counts."""

    entries: List[Numbered]
    counts: EventCounts


def entry_of(value: str) -> Optional[LogEntry]:
    """The entry a position holds, None for a skipped one."""
    return None if value == SKIP else LogEntry.decode(value)


class Snapshot:
    """The state at the start of a range: counts and, per member, its join and departure."""

    def __init__(self, counts: EventCounts, joins: Dict[str, Numbered], departures: Dict[str, Numbered],
                 start: int = 0) -> None:
        self.counts = counts
        self.joins = joins
        self.departures = departures
        self.start = start

    @staticmethod
    def decode(text: str) -> "Snapshot":
        if not text:
            return Snapshot(NO_EVENTS, {}, {})
        head, _, body = text.partition("\n")
        events, deaths, rejoins, leaves, start = (int(v) for v in head.split("|")[1:])
        joins: Dict[str, Numbered] = {}
        departures: Dict[str, Numbered] = {}
        for line in body.splitlines():
            seq, _, encoded = line.partition("|")
            entry = LogEntry.decode(encoded)
            (joins if entry.kind == "join" else departures)[entry.record.member] = (int(seq), entry)
        return Snapshot(EventCounts(events, deaths, rejoins, leaves), joins, departures, start)

    def encode(self) -> str:
        c = self.counts
        lines = [f"#|{c.events}|{c.deaths}|{c.rejoins}|{c.leaves}|{self.start}\n"]
        lines += [f"{seq}|{entry.encode()}" for seq, entry in self.entries()]
        return "".join(lines)

    def entries(self) -> List[Numbered]:
        return sorted(list(self.joins.values()) + list(self.departures.values()), key=lambda n: n[0])

    def after(self, numbered: List[Numbered], end: int) -> "Snapshot":
        """The state at position ``end``, after ``numbered`` (the entries before it, in order)."""
        joins, departures = dict(self.joins), dict(self.departures)
        for seq, entry in numbered:
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
        if len(departures) > GONE_KEPT:  # the oldest departures are forgotten
            for member, _ in sorted(departures.items(), key=lambda kv: kv[1][0])[:len(departures) - GONE_KEPT]:
                del departures[member]
                joins.pop(member, None)
        return Snapshot(self.counts.plus([e for _, e in numbered]), joins, departures, end)


def read_history(get: Callable[[str], Optional[str]], keys: Keys) -> History:
    """The log as it stands, condensed (see :class:`History`); ``get`` reads a key (None: absent).

    For readers outside the world (the status view) and for event counts. It reads up to
    the first position not yet written (a post under way), and fills nothing.
    """
    head = int(get(keys.log_head()) or 0)
    total = int(get(keys.log_count()) or 0)
    state = Snapshot.decode(get(keys.log_snapshot(head)) or "") if head else Snapshot(NO_EVENTS, {}, {})
    numbered: List[Numbered] = []
    seq = state.start
    while seq < total:
        value = get(keys.log_entry(seq))
        if value is None:
            break
        entry = entry_of(value)
        if entry is not None:
            numbered.append((seq, entry))
        seq += 1
    state = state.after(numbered, seq)
    return History(state.entries(), state.counts)
