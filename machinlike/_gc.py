"""Pausing the cyclic garbage collector around a burst of allocations of one message.

Why: encoding a list of 1,000 transitions allocates some ten thousand tracked objects
(containers, placeholders), freed when the message is gone. Each 700 allocations started
a collection of the young generations, and every tenth of those one of the middle
generation, in a process that holds a replay buffer's worth of objects: about 40 % of the
encode's time (11 ms of which 4 ms collecting, for 2,000 small tensors). Paused, the objects that are freed with the message are never
collected. (Not around loading: there what is allocated is what the receiver keeps, and
one collection of all of it at the end cost more than the collections during the load,
which untrack tuples of numbers as they go: 200k tuples loaded in 42 ms against 31.)
"""

from __future__ import annotations

import contextlib
import gc
from typing import Iterator

__all__ = ["paused"]


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No automatic collection inside (it resumes after, if it ran before; another
    thread's pause that began earlier is left for that thread to end)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
