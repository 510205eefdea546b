"""FailureNamer: a collective that a member's death or silence ended, told by name.

Why: gloo ends a collective at once when a member dies, and at the group's timeout when one
never takes part, but it says so as a ``RuntimeError`` naming an address and port
(``Connection closed by peer [127.0.0.1]:35219``) or a receive that timed out: nothing
names the member, where every other call of the World raises ``PeerLostError`` or
``TimeoutError`` naming it (cold trial 13)::

    CollectiveGroup op ── gloo's RuntimeError ──► FailureNamer(op, err)
        "timed out"         ──► TimeoutError: the op, the ranks, the group's timeout
        the peer closed     ──► wait (at most LOSS_WAIT s) for this view to see a member
                                of the group gone ──► PeerLostError naming it
        anything else, or no member seen gone ──► gloo's error as it was

The World's loss detection sees a death on this host within a tick (at most 0.25 s), so a
short wait finds it; gloo's error stays the cause. A work handle of ``async_op=True``
raises gloo's error from its ``wait()`` as torch's does.
"""

from __future__ import annotations

from typing import List, Optional, Sequence

from ...exception import PeerLostError
from .._membership import Roster

__all__ = ["FailureNamer", "LOSS_WAIT"]

LOSS_WAIT = 2.0  # seconds a failed collective waits for this view to see a member gone

_CLOSED = ("connection closed by peer", "connection reset by peer", "broken pipe")


class FailureNamer:
    """Turns gloo's errors of one World's collectives into named ones.

    Args:
        roster: This World's view of who is live.
        names: The static world's member names, by rank.
    """

    def __init__(self, roster: Roster, names: Sequence[str]) -> None:
        self._roster = roster
        self._names = list(names)

    def __call__(self, op: str, ranks: Sequence[int], timeout: float, err: BaseException) -> BaseException:
        """What ``op`` over ``ranks`` raises for ``err`` (``err`` itself when not a member's doing)."""
        text = str(err)
        said = text.strip().splitlines()[0][:240] if text.strip() else type(err).__name__
        low = text.lower()
        if "timed out" in low:
            return TimeoutError(f"collective {op} over ranks {list(ranks)} did not finish within the group's "
                                f"timeout ({timeout:g} s): a member did not take part (gloo: {said})")
        if not any(mark in low for mark in _CLOSED):
            return err
        members = [self._names[r] for r in ranks if 0 <= r < len(self._names)]
        gone = self._first_gone(members)
        if gone is None:
            return err
        how = self._roster.gone(gone) or "lost"
        return PeerLostError(gone, f"collective {op} over ranks {list(ranks)} failed: the member "
                                   f"{'left the world' if how == 'left' else 'was lost'} (gloo: {said})")

    def _first_gone(self, members: List[str]) -> Optional[str]:
        def gone_now() -> Optional[str]:
            return next((m for m in members if self._roster.gone(m) is not None), None)

        try:
            self._roster.wait_until(lambda live: gone_now() is not None, LOSS_WAIT)
        except TimeoutError:
            return None
        return gone_now()
