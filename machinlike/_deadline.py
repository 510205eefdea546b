"""Clock arithmetic for waits that share one deadline (``time.monotonic()`` seconds)."""

from __future__ import annotations

import time

__all__ = ["deadline_left"]


def deadline_left(deadline: float) -> float:
    """Seconds left until a ``time.monotonic()`` deadline, never negative."""
    return max(0.0, deadline - time.monotonic())
