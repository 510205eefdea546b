"""Retired export slabs whose memory goes back to torch's allocator: at once, or once the
copies still queued into them have run (``ExportArea._retire``)::

    retire(slab, settled) ─► the slab reads as retired (storage None) ─► settled: its
      memory back now; else parked: its storage kept (and still counted by the area)
    let_settled_go() (each reclaim) ─► parked slabs whose copies ran: memory back

Why a slab is parked and not waited for: retiring one still written waits under the
export area's lock, and copies queued behind a collective that never ends (a peer that
died) would stall every sender of the process there for good. Freed under those copies,
its memory could go to the next tensor of the stream it was made on, and the copies
overwrite that tensor; kept, it costs its bytes until the device gets there.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import torch

from .cuda_ipc_slab import Slab

__all__ = ["Parked"]


class Parked:
    """Where an area's retired slabs let their memory go; ``stats``: the area's counters
    (``settle_timed_out``, ``counter_release_failed``). Used under the area's lock."""

    def __init__(self, stats: Dict[str, int]) -> None:
        self._stats = stats
        self._kept: List[Tuple[Slab, object]] = []  # (slab, the last references to its storage)

    def __len__(self) -> int:
        return len(self._kept)

    def retire(self, slab: Slab, settled: bool) -> int:
        """Mark ``slab`` retired and give its memory back if ``settled`` (its copies in ran),
        else keep it until they did; returns the bytes given back now."""
        kept = (slab.storage, slab.views)  # (the views hold the storage too)
        slab.storage = None  # type: ignore[assignment]  # (what the area and pinned states read as retired)
        slab.views = {}
        if settled:
            return self._let_go(slab, kept)
        self._kept.append((slab, kept))
        self._stats["settle_timed_out"] += 1
        return 0

    def let_settled_go(self, force: bool = False) -> int:
        """Give back the memory of parked slabs whose copies in have run (``force``: all,
        the interpreter's exit); returns the bytes given back."""
        freed = 0
        for parked in list(self._kept):
            try:
                done = force or parked[0].settled()
            except Exception:  # (a CUDA error: the device is lost, nothing of it runs any more)
                done = True
            if done:
                self._kept.remove(parked)
                freed += self._let_go(*parked)
        return freed

    def _let_go(self, slab: Slab, kept: object) -> int:
        # torch counted the one export as one reader (counter 1) and parks freed memory
        # with a count above 0 in its limbo. No receiver counts (they open with
        # NO_COUNTER), so this one release lets the memory go back to the allocator now.
        try:
            torch.UntypedStorage._release_ipc_counter_cuda(*slab.counter)
        except Exception:  # best effort, as torch's own consumers do
            self._stats["counter_release_failed"] += 1
        del kept
        slab.ready = None  # receivers check the slab's id before they ask its event
        return slab.capacity
