"""Stops: a wait for a member of a static world that began to stop its World ends, naming it.

::

    member r: World.stop()  ──► add w/stopping, set w/stop/<r>     (stop.leave_static)
    a member waiting for r (a barrier, create_rpc_group, a collective group's creation):
      its liveness thread, each tick while a wait is pending (Waits.check_stops):
        w/stopping unset, or as that wait last saw it ──► nothing more (one request a tick)
        moved ──► the wait's absent members' w/stop/<rank> ──► STOPPED_MARK + the cause each
                  recorded (m/exit: "raised ValueError: ...") into its key: the store wait
                  ends, and raises PeerLostError naming it

Why: a static member whose function returned or raised (its ``with World`` block, a launched
rank's function) waits in ``stop()`` for the others, and will never arrive where they wait:
they waited out ``dist_timeout`` (a 2 s failure took 83 s under torchrun's restarts) and
then said it "did not arrive" (cold trial 32). An elastic member's leave is in the log, and
the roster ends such waits already. Why the liveness thread and a mark, not slices of the
store wait: a store wait that times out has torch log two lines of warning, each slice.
"""

from __future__ import annotations

from typing import Dict

from .._store import ExitRecord, Keys, Registry
from .roster import Roster

__all__ = ["Stops"]


class Stops:
    """Who among a static world's members began to stop its World, and why.

    Args:
        registry: The world's store tables.
        keys: The world's keys.
        roster: Who is live (names by rank).
    """

    def __init__(self, registry: Registry, keys: Keys, roster: Roster) -> None:
        self._registry = registry
        self._keys = keys
        self._roster = roster

    def count(self) -> str:
        """How many members began to stop, as the store holds it ("" or "0": none); one request."""
        return self._registry.get_or_empty(self._keys.stop_count())

    def concerns(self, prefix: str) -> bool:
        """Whether a wait on ``prefix`` may wait for a member that stops: not the stop's
        own waits (for the stop keys, then the left ones), where everyone stops."""
        return prefix not in (self._keys.stop_prefix(), self._keys.left_prefix())

    def among(self, prefix: str, mapping: Dict[str, str]) -> Dict[str, str]:
        """``{member: why}`` of the members of a wait (``mapping``: member -> its key's
        name under ``prefix``) that began to stop and have not arrived; a request or two
        each, on the main connection (the liveness thread opens none of its own)."""
        rank_of = {name: rank for rank, name in enumerate(self._roster.names_by_rank())}
        stopping: Dict[str, str] = {}
        for member, name in mapping.items():
            rank = rank_of.get(member)
            if rank is None or not self._registry.present([self._keys.stop_prefix() + str(rank)]):
                continue
            if self._registry.present([prefix + name]):
                continue  # (it arrived before it stopped)
            record = ExitRecord.decode(self._registry.get_or_empty(self._keys.exit_cause(member)))
            stopping[member] = record.cause if record is not None and record.by == "member" else \
                "its function returned, or it called stop()"
        return stopping
