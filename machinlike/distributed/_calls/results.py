"""Results kept on their owner for remote handles (``RpcGroup.remote``, ``registered_remote``).

Owns, on the member that computed them, every result a :class:`~._refs.ResultRef` names,
and who holds each one. A hold is a token (the creating handle's, or one per copy of a
handle sent elsewhere) attributed to a member incarnation::

    keep(rid, token, holder, value)   a result and its first hold
    hold(rid, token, holder)          one more (a copy of the handle on its way)
    move(rid, token, holder)          that copy arrived: its hold is the receiver's now
    release(rid, token)               a handle was collected; the last release frees it
    sweep()                           holds whose member incarnation is gone are dropped

Why tokens and not a count: a copy's release and its arrival notice travel as separate
calls that may arrive in either order; a token makes both idempotent. Why attributed to a
member: a holder that is SIGKILLed never releases, so its holds go with it when the world
declares it gone (``sweep``, run on every departure and as the table grows).
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Dict, Optional, Tuple

__all__ = ["ResultTable", "Holder", "is_absent"]

#: A member incarnation that holds a handle: ``(member name, incarnation)``.
Holder = Tuple[str, int]

_ABSENT = object()


class _Kept:
    __slots__ = ("value", "holds")

    def __init__(self, value: Any) -> None:
        self.value = value
        self.holds: Dict[str, Holder] = {}


class ResultTable:
    """The results this process keeps for handles held anywhere in the world.

    Args:
        live: Whether a holder (member, incarnation) is still in the world; None until
            the world binds it (then nothing is swept).
    """

    # The table is swept when it reaches this many results, then at twice what the last
    # sweep left (a sweep costs one pass, so its cost per kept result stays constant).
    _FIRST_SWEEP = 256

    def __init__(self, live: Optional[Callable[[Holder], bool]] = None) -> None:
        self._lock = threading.Lock()
        self._kept: Dict[str, _Kept] = {}
        self._live = live
        self._next_sweep = self._FIRST_SWEEP
        #: Results freed because their last handle was released / its holders were lost.
        self.released = 0
        self.swept = 0

    def bind_live(self, live: Callable[[Holder], bool]) -> None:
        """Judge holders with ``live`` from now on."""
        self._live = live

    def __len__(self) -> int:
        return len(self._kept)

    def keep(self, rid: str, token: str, holder: Holder, value: Any) -> None:
        """Keep ``value`` as result ``rid``, held by ``token`` on behalf of ``holder``."""
        kept = _Kept(value)
        kept.holds[token] = holder
        with self._lock:
            self._kept[rid] = kept
            due = len(self._kept) >= self._next_sweep
        if due:
            self.sweep()

    def get(self, rid: str) -> Any:
        """Result ``rid``; ``_ABSENT`` (see :func:`is_absent`) when it was freed or never kept."""
        kept = self._kept.get(rid)
        return _ABSENT if kept is None else kept.value

    def hold(self, rid: str, token: str, holder: Holder) -> bool:
        """Add hold ``token`` on result ``rid``; False when the result is gone already."""
        with self._lock:
            kept = self._kept.get(rid)
            if kept is None:
                return False
            kept.holds[token] = holder
            return True

    def move(self, rid: str, token: str, holder: Holder) -> None:
        """Attribute hold ``token`` to ``holder`` (a copy arrived there); nothing if it is gone."""
        with self._lock:
            kept = self._kept.get(rid)
            if kept is not None and token in kept.holds:
                kept.holds[token] = holder

    def release(self, rid: str, token: str) -> None:
        """Drop hold ``token`` on result ``rid``; free the result when it was the last."""
        with self._lock:
            kept = self._kept.get(rid)
            if kept is None or kept.holds.pop(token, None) is None or kept.holds:
                return
            del self._kept[rid]
            self.released += 1

    def sweep(self) -> int:
        """Drop the holds of members no longer live, and the results left without any.

        Returns:
            How many results were freed.
        """
        live = self._live
        if live is None:
            return 0
        with self._lock:
            kept = list(self._kept.items())
        # The liveness look-ups take the roster's lock: not under this table's.
        verdict: Dict[Holder, bool] = {}
        dead = []
        for rid, entry in kept:
            for token, holder in list(entry.holds.items()):
                if holder not in verdict:
                    verdict[holder] = live(holder)
                if not verdict[holder]:
                    dead.append((rid, token))
        freed = 0
        with self._lock:
            for rid, token in dead:
                found = self._kept.get(rid)
                if found is None or found.holds.pop(token, None) is None or found.holds:
                    continue
                del self._kept[rid]
                freed += 1
            self.swept += freed
            self._next_sweep = max(self._FIRST_SWEEP, 2 * len(self._kept))
        return freed

    def clear(self) -> None:
        """Forget every result (this member stops serving)."""
        with self._lock:
            self._kept.clear()


def is_absent(value: Any) -> bool:
    """Whether :meth:`ResultTable.get` found nothing."""
    return value is _ABSENT
