"""The process pool's scheduling policy, as pure functions over plain numbers.

No processes, pipes or locks here: the dispatcher (``_dispatch``) measures its workers,
asks these functions, and acts. That keeps the policy testable on its own
(``tests/test_pool_schedule.py``).

* **Room**: a worker's channel holds at most ``window`` unfinished tasks; its take-back
  ring must cover every frame it has not read; with ``maxtasksperchild`` it takes no more
  than its quota. :func:`capacity` is how many more tasks it may take now.
* **Pick**: the oldest backlog task goes to the least-loaded worker with room, scanning
  from a rotating start so that equal loads take turns; an idle worker wins at once.
* **Steal**: when the backlog is empty, an idle ready worker takes back the newest
  unstarted half (rounded up) of the worker holding the most unstarted tasks.
"""

from __future__ import annotations

from typing import Optional, Sequence

__all__ = ["capacity", "pick", "pick_victim", "steal_count"]


def capacity(load: int, window: int, unread: int, ring: int, assigned: int, maxtasks: Optional[int]) -> int:
    """How many more tasks a worker may take now (0: none).

    Args:
        load: Unfinished tasks in its channel.
        window: Most unfinished tasks a channel may hold.
        unread: Frames sent to it that it has not taken yet (started or skipped).
        ring: Slots of its take-back ring; ``unread`` must stay below ``ring - 1``.
        assigned: Tasks it was given over its life.
        maxtasks: Tasks it may be given over its life; None: no limit.
    """
    room = min(window - load, ring - 1 - unread)
    if maxtasks:
        room = min(room, maxtasks - assigned)
    return max(room, 0)


def pick(loads: Sequence[int], capacities: Sequence[int], rotation: int) -> Optional[int]:
    """The index of the worker the next task goes to, or None when none has room.

    The least loaded among those with capacity; ties go to the first found scanning from
    ``rotation`` (wrapping round); a worker with load 0 is taken at once.
    """
    count = len(loads)
    best: Optional[int] = None
    best_load = 0
    for k in range(count):
        i = (rotation + k) % count
        if capacities[i] <= 0:
            continue
        load = loads[i]
        if best is None or load < best_load:
            best, best_load = i, load
            if load == 0:
                break
    return best


def pick_victim(unstarted: Sequence[int], thief: int) -> Optional[int]:
    """The index of the worker to steal from: the most unstarted tasks (the first of equals),
    never ``thief`` itself; None when no other worker has an unstarted task."""
    victim: Optional[int] = None
    best = 0
    for i, count in enumerate(unstarted):
        if i != thief and count > best:
            victim, best = i, count
    return victim


def steal_count(unstarted: int) -> int:
    """How many of a victim's ``unstarted`` tasks (its newest) a thief takes: half, rounded up."""
    return unstarted - unstarted // 2
