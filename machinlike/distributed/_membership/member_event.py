"""What membership reports to its subscribers: :class:`MemberEvent`.

Events are read from the world's log (see ``_store.keys.LogEntry``) and seen by every member in
the same order. No state.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["MemberEvent"]


# A named tuple, not a frozen dataclass: each member makes one per event (a million while
# 1,024 simulated members join), and the dataclass's __init__ cost 3 us of it each.
class MemberEvent(NamedTuple):
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
