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
        the peer closed, nobody gone ──► RuntimeError: the group's connections were
                                         closed (a failure on another member)
        anything else ──► gloo's error as it was
    GroupHealth: after a collective that failed so, the group is spoiled (gloo closed its
        pairs): every later op raises at once, saying so and how to go on (it was gloo's
        bare "Application timeout caused pair closure", or a "remote worker crashing")

The World's loss detection sees a death on this host within a tick (at most 0.25 s), so a
short wait finds it; gloo's error stays the cause. A work handle (``async_op=True``,
``isend``, ``irecv``) is handed back as a :class:`NamedWork`, whose ``wait()`` names the
failure the same way.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable, List, Optional, Sequence

from ...exception import PeerLostError
from .._membership import Roster

__all__ = ["FailureNamer", "GroupHealth", "NamedWork", "LOSS_WAIT"]

LOSS_WAIT = 2.0  # seconds a failed collective waits for this view to see a member gone

_CLOSED = ("connection closed by peer", "connection reset by peer", "broken pipe")
# What gloo says when a collective failed in a way that closed the group's connections.
_SPOILS = _CLOSED + ("timed out", "pair closure")
_FIX = "destroy() it and create a new group on every rank (world.create_collective_group)"


class GroupHealth:
    """Whether a collective group's connections are still up (see the module docstring).

    Args:
        ranks: The group's ranks, for the messages.
    """

    def __init__(self, ranks: Sequence[int]) -> None:
        self._ranks = list(ranks)
        self._broken: Optional[str] = None  # why not, once a collective closed them

    def check(self) -> None:
        """Raise if an earlier collective of the group closed its connections.

        Raises:
            RuntimeError: naming that collective and the fix.
        """
        if self._broken is not None:
            raise RuntimeError(f"CollectiveGroup {self._ranks} cannot be used any more: {self._broken}, and gloo "
                               f"closes a group's connections when a collective fails so: {_FIX}")

    def failed(self, op: str, err: BaseException, failure: BaseException) -> BaseException:
        """Note that ``op`` failed with gloo's ``err`` (raised as ``failure``); returns ``failure``."""
        if self._broken is None and any(mark in str(err).lower() for mark in _SPOILS):
            said = str(failure).split(" (gloo:")[0].split("; destroy()")[0]
            self._broken = f"its {op} failed ({type(failure).__name__}: {said[:240]})"
        return failure


class FailureNamer:
    """Turns gloo's errors of one World's collectives into named ones.

    Args:
        roster: This World's view of who is live.
        names: The static world's member names, by rank.
    """

    def __init__(self, roster: Roster, names: Sequence[str]) -> None:
        self._roster = roster
        self._names = list(names)

    def __call__(self, op: str, ranks: Sequence[int], timeout: float, err: BaseException,
                 whose: str = "the group's") -> BaseException:
        """What ``op`` over ``ranks`` raises for ``err`` (``err`` itself when not a member's doing);
        ``timeout`` (seconds) is ``whose`` timeout ended a silent wait."""
        text = str(err)
        said = text.strip().splitlines()[0][:240] if text.strip() else type(err).__name__
        low = text.lower()
        if "timed out" in low:
            # (a receive from any source outlives a sender's death: the member is named if gone)
            lost = next((m for r in ranks if 0 <= r < len(self._names)
                         for m in [self._names[r]] if self._roster.gone(m) is not None), None)
            if lost is not None:
                how = "left the world" if self._roster.gone(lost) == "left" else "was lost"
                return PeerLostError(lost, f"collective {op} over ranks {list(ranks)} did not finish within {whose} "
                                           f"timeout ({timeout:g} s): the member {how} (gloo: {said})")
            return TimeoutError(f"collective {op} over ranks {list(ranks)} did not finish within {whose} "
                                f"timeout ({timeout:g} s): a member did not take part (gloo: {said})")
        if not any(mark in low for mark in _CLOSED):
            return err
        members = [self._names[r] for r in ranks if 0 <= r < len(self._names)]
        gone = self._first_gone(members)
        if gone is None:
            return RuntimeError(f"collective {op} over ranks {list(ranks)} failed: a member closed the group's "
                                f"connections though none is gone (most likely a collective of this group failed "
                                f"or timed out there first); {_FIX} (gloo: {said})")
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


class NamedWork:
    """A collective's work handle whose ``wait()`` raises what the op, run blocking, would.

    Anything else (``is_completed``, ``get_future``, ...) is the handle's own.

    Args:
        work: torch's handle, or one of this package's (each has ``wait`` and ``is_completed``).
        name: ``FailureNamer`` bound to the op: ``name(timeout, whose, err)`` is what to raise.
        timeout: The group's timeout, seconds (what a ``wait()`` without one is bound by).
    """

    def __init__(self, work: Any, name: Callable[[float, str, BaseException], BaseException], timeout: float) -> None:
        self._work = work
        self._name = name
        self._timeout = timeout

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        """As the handle's ``wait()``; a member's death or silence raised by name."""
        try:
            return self._work.wait(*args, **kwargs)
        except RuntimeError as err:
            given = kwargs.get("timeout", args[0] if args else None)
            if isinstance(given, timedelta):
                failure = self._name(given.total_seconds(), "the wait's", err)
            else:
                failure = self._name(self._timeout, "the group's", err)
            if failure is err:
                raise
            raise failure from err

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)
