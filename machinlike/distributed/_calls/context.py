"""The call context: what calls and handles need of this process's running World.

Why one object: a remote handle may be unpickled in a process whose World started after the
handle was made, so it cannot keep its World; and the group layer must not reach up to the
World for it either. The Session binds one ``CallContext`` when its member has entered the
world (its name and incarnation are final then) and unbinds it when the World stops::

    Session._bind ──► bind(CallContext(...)) ──► current() / require()
                                                   ├─ handles (refs, ref_owner): who am I,
                                                   │  where is the owner, how long to wait
                                                   └─ group calls (Caller): remote results
    Session undo  ──► bind(None)

The slot is written only by the Session, under no lock: a reference assignment is atomic,
and a reader that sees None fails with the message below.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, Tuple

from ... import _checks
from ...exception import PeerLostError
from .._membership import Roster, Waits

__all__ = ["CallContext", "bind", "current", "require"]


class CallContext:
    """This member as a caller: its name and incarnation, the world's roster and waits, and
    its default call timeout.

    Args:
        name: This member's name.
        incarnation: Its incarnation (1 for a member's first process).
        roster: This process's view of the members.
        waits: The waits that end when a member goes.
        rpc_timeout: Default call timeout, seconds.
        timed_out: Told the member of a call that timed out; None: nobody is told.
    """

    __slots__ = ("name", "incarnation", "roster", "waits", "timeout", "timed_out")

    def __init__(self, name: str, incarnation: int, roster: Roster, waits: Waits, rpc_timeout: float,
                 timed_out: Optional[Callable[[str], None]] = None) -> None:
        self.name, self.incarnation = name, incarnation
        self.roster, self.waits, self.timeout = roster, waits, rpc_timeout
        #: Told the member of each call of this process that timed out (the membership's
        #: monitor then probes this process's own agent: see _transport.probe).
        self.timed_out = timed_out

    @property
    def me(self) -> Tuple[str, int]:
        """(member, incarnation) of this process: what a handle names as its holder."""
        return self.name, self.incarnation

    def seconds(self, timeout: Optional[float]) -> float:
        """``timeout`` in seconds: the default for None or -1 (torch's RRef methods' "unset").

        Raises:
            TypeError, ValueError: anything else that is not a positive number of seconds
                (torch reads 0 as "no limit": every wait here has one; cold trial 12).
        """
        if timeout is None or (type(timeout) in (int, float) and timeout == -1):
            return self.timeout
        return _checks.seconds("timeout", timeout, or_none=True)

    def worker(self, owner: str, incarnation: int, what: str, deadline: float) -> str:
        """The RPC worker of ``owner``'s incarnation ``incarnation``.

        An incarnation this view has not seen join yet (it paired a value or answered a
        call just after it joined; a restarted one, while the view still lists or has just
        seen go the one before) is waited for until ``deadline`` (``time.monotonic()``).

        Raises:
            PeerLostError: that incarnation is gone.
        """
        roster = self.roster
        if (roster.incarnation_of(owner) or 0) < incarnation and roster.may_run(owner, incarnation):
            roster.wait_until(lambda live: (roster.incarnation_of(owner) or 0) >= incarnation
                              or not roster.may_run(owner, incarnation), max(0.0, deadline - time.monotonic()))
        worker = self.roster.worker_of(owner)
        now = self.roster.incarnation_of(owner)
        if now is not None and now != incarnation:
            raise PeerLostError(owner, f"{what}: it was held by incarnation {incarnation}, which is gone "
                                       f"(incarnation {now} runs now)")
        return worker


_current: Optional[CallContext] = None


def bind(context: Optional[CallContext]) -> None:
    """Make ``context`` this process's (None: there is none; the World stopped)."""
    global _current
    _current = context


def current() -> Optional[CallContext]:
    """This process's call context, None when no World runs here."""
    return _current


def require(what: str = "a remote handle") -> CallContext:
    """This process's call context.

    Args:
        what: Who needs it, for the message.

    Raises:
        RuntimeError: no World runs in this process.
    """
    context = _current
    if context is None:
        raise RuntimeError(f"no World in this process: {what} calls through the World; create one first")
    return context
