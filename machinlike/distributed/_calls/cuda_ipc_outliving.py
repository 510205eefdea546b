"""Closed export areas whose slabs outlived their World's stop, lent to live receivers.

Why: ``ExportArea.close`` keeps a slab that a live receiver may still be copying out of
(its memory back with the allocator would hand that receiver another tensor's bytes), so
something must retire it once that receiver ends its lease or dies. This list does, swept
at each World's stop and each new area, and forced at the interpreter's exit::

    World stop: close(area, wait) ─► area.close(wait) ─► some slab outlives ─► kept
    a later stop, or a new area: sweep() ─► each kept area retires what came back;
      one with nothing left is dropped
    exit: sweep(force=True) ─► every slab retires (the process's memory goes anyway)

Bounded: an area is kept only while one of its slabs is lent to a live process.
"""

from __future__ import annotations

import threading
from typing import List, Optional

from ..._tally import Tally
from .cuda_ipc_area import ExportArea

__all__ = ["Outliving"]


class Outliving:
    """Closed areas holding slabs still lent (see the module docstring)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._areas: List[ExportArea] = []

    def close(self, area: Optional[ExportArea], wait: float, counts: Tally) -> None:
        """Close ``area`` (None: none was made), waiting ``wait`` seconds at most for what
        it lent (``ExportArea.close``), keep it if a slab outlives it, carry its closing
        counters into ``counts`` (``closed_area_*``), and sweep the areas kept before."""
        if area is not None:
            if area.close(wait):
                with self._lock:
                    self._areas.append(area)
            for name in ("outlived", "ended_at_close", "settle_failed", "settle_timed_out", "abandoned"):
                counts.add(f"closed_area_{name}", area.stats[name])
        self.sweep()

    def areas(self) -> List[ExportArea]:
        with self._lock:
            return list(self._areas)

    def held_bytes(self) -> int:
        """Bytes of slab capacity the kept areas still hold."""
        return sum(area.held_bytes() for area in self.areas())

    def outside(self) -> int:
        """``held_bytes`` once what came back is retired: what a new area must leave them
        of its bound (``ExportArea(outside=...)``; a receiver may end its lease long after
        the sweeps of a World's stop and the next one's start)."""
        if not self._areas:
            return 0
        self.sweep()
        return self.held_bytes()

    def sweep(self, force: bool = False) -> None:
        """Retire what each kept area's receivers gave back (``force``: everything), and
        drop the areas left empty. Raises nothing."""
        done = [area for area in self.areas() if not area.sweep(force)]  # (out of the lock: a retire may wait)
        if done:
            with self._lock:
                self._areas = [area for area in self._areas if area not in done]
