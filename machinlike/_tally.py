"""Tally: named counters that a module reports in its ``stats()``, safe across threads.

Why an object: a module's counters, their lock and the "two counters under one
acquisition" of a hot path (a message counts its tensors and its bytes) live together, and
a module whose forked child must start afresh replaces one object (``cuda_ipc``'s fork
handler) instead of a dict and the lock that guards it.
"""

from __future__ import annotations

import threading
from typing import Dict, Optional

__all__ = ["Tally"]


class Tally:
    """Counters by name, each starting at 0."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Dict[str, int] = {}

    def add(self, what: str, n: int = 1, other: Optional[str] = None, m: int = 1) -> None:
        """Count ``n`` of ``what`` and, with ``other``, ``m`` of it too (one lock acquisition)."""
        with self._lock:
            counts = self._counts
            counts[what] = counts.get(what, 0) + n
            if other is not None:
                counts[other] = counts.get(other, 0) + m

    def snapshot(self) -> Dict[str, int]:
        """Every counter so far (a copy)."""
        with self._lock:
            return dict(self._counts)
