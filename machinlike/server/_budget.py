"""CallBudget: one deadline shared by the steps of one accessor call.

A gradient push is up to four calls (the server's spec, the push, a push to another
secondary after one that left, the pull), a model push up to five (the spec read or
claimed, the push, the pull after a rejection)::

    push(model, timeout=T) ── CallBudget(T) ──► step 1: left() ─► step 2: left() ─► ...
                                                └── a step that times out ─► TimeoutError naming
                                                    the whole call and T, the step's as cause

Why: each step used to get the whole timeout of its own, so a call could take several
times what its caller asked for; retries included, the call now ends within ``T``.

``T`` bounds the waits on the servers: no step starts once it ran out, and each waits at
most what is left. Local work after the last wait (loading a pulled state into the
caller's model) is not cut short: a call whose data arrived in time returns its result,
although loading a large model may take it a little past ``T``.
"""

from __future__ import annotations

import time
from types import TracebackType
from typing import Optional, Type

__all__ = ["CallBudget"]


_TOLD = "_machinlike_budget_told"


def _spent(message: str) -> TimeoutError:
    """A plain TimeoutError (the type users see and catch), marked as told so that the budget
    it crosses, or one around it, does not wrap it again."""
    err = TimeoutError(message)
    setattr(err, _TOLD, True)
    return err


class CallBudget:
    """``seconds`` for all the steps of the call ``what``; a context manager.

    Args:
        seconds: The call's timeout (positive).
        what: The call, for messages (``"push to gradient server 'g'"``).
    """

    def __init__(self, seconds: float, what: str) -> None:
        self.seconds = seconds
        self.what = what
        self._deadline = time.monotonic() + seconds

    def then(self, note: str) -> None:
        """Say, in the error of a step that runs out from now on, what is already done
        (``note``): a caller must not redo what took effect."""
        self.what = f"{self.what} ({note})"

    def left(self) -> float:
        """Seconds left for the next step.

        Raises:
            TimeoutError: none are left.
        """
        left = self._deadline - time.monotonic()
        if left <= 0:
            raise _spent(f"{self.what}: not done within {self.seconds:g} s (its timeout, for the whole call); "
                         f"pass a larger timeout= if the server is just slow")
        return left

    def __enter__(self) -> "CallBudget":
        return self

    def __exit__(self, kind: Optional[Type[BaseException]], exc: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if isinstance(exc, TimeoutError) and not getattr(exc, _TOLD, False):
            raise _spent(f"{self.what}: not done within {self.seconds:g} s (its timeout, for the whole call): "
                         f"{exc}") from exc
