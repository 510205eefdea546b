"""Pin a benchmark rank (all its threads) to one core.

On a small machine the scheduler may put two ranks that ping-pong on one core or on two,
world to world, which moves a small call's latency by half and hides a few percent of
difference between the things compared. One core per rank makes runs comparable.
"""

from __future__ import annotations

import os

__all__ = ["pin_to_core"]


def pin_to_core(index: int) -> bool:
    """Pin every thread of this process to core ``index % cpu_count``; False where it cannot."""
    cores = os.cpu_count() or 1
    if cores < 2 or not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return False
    core = {index % cores}
    for tid in os.listdir("/proc/self/task"):  # torch's threads started with the World
        try:
            os.sched_setaffinity(int(tid), core)
        except OSError:
            pass  # the thread ended meanwhile
    return True
