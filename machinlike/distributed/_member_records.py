"""What membership records and reports: a member's claim, its events, and the wait marks.

A live member's claim ``m/live/<name>`` holds a :class:`MemberRecord` encoded as
``"inc|transport|rank|pid id"``; the event log ``m/log`` holds one ``"kind|member|record"``
line per event, seen by every member in the same order as :class:`MemberEvent` objects.
No state: the tables that use these live in ``_membership``.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MemberEvent", "MemberRecord", "LOST_MARK", "WOKEN_MARK"]

#: Written into a waited-for key of a member that is gone, to wake its waiters.
LOST_MARK = "\x00lost"
#: Written into the other keys of such a wait that are still absent: a store wait ends
#: only when every key it waits for exists. A member arriving later overwrites it.
WOKEN_MARK = "\x00woken"


@dataclass(frozen=True)
class MemberEvent:
    """A change of the world's membership.

    Attributes:
        kind: ``"join"``, ``"leave"`` (it stopped) or ``"lost"`` (it died or went silent).
        member: The member's name.
        incarnation: 1 for its first process, 2 for the first replacement, ...
        rank: Its rank.
        seq: Position in the world's event log (events are seen in this order everywhere).
    """

    kind: str
    member: str
    incarnation: int
    rank: int
    seq: int


@dataclass
class MemberRecord:
    """One incarnation of a member, as its claim in the store holds it.

    Attributes:
        member: The member's name.
        incarnation: 1 for its first process, 2 for the first replacement, ...
        transport: Its RPC worker name (changes when it renews its agent).
        rank: Its rank.
        identity: Its process identity (see ``_liveness.process_identity``).
    """

    member: str
    incarnation: int
    transport: str
    rank: int
    identity: str

    def encode(self) -> str:
        return f"{self.incarnation}|{self.transport}|{self.rank}|{self.identity}"

    @staticmethod
    def decode(member: str, text: str) -> "MemberRecord":
        inc, transport, rank, identity = text.split("|", 3)
        return MemberRecord(member, int(inc), transport, int(rank), identity)
