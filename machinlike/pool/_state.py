"""A pool's life, shared by both engines: the state enum and the flags record that owns
the engine lock.

::

    RUN ──close()──> CLOSE ──(work done, workers stopped)──> finished
     │                 │
     ├──terminate()────┴──> TERMINATE      (pending tasks fail: PoolTerminatedError)
     └──no worker can run──> BROKEN        (pending and new tasks fail: BrokenPoolError)

``PoolFlags`` is the one record the caller side and the engine's own threads share (loky
keeps its shutdown/broken flags in such an object): the lock, the state, the error that
broke the pool, and how many imap feeds are still reading input. Every other engine part
that the caller side touches is guarded by this same lock and says so.
"""

from __future__ import annotations

import enum
import threading
from typing import Optional

from ._errors import BrokenPoolError

__all__ = ["PoolState", "PoolFlags"]


class PoolState(str, enum.Enum):
    """Where a pool is in its life; compares equal to its string value (``"running"``...)."""

    RUN = "running"
    CLOSE = "closed"
    TERMINATE = "terminated"
    BROKEN = "broken"

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class PoolFlags:
    """The engine lock and what it guards first: state, breaking error, open feeds.

    Reads of ``state`` need no lock (one reference); every change takes ``lock``.
    """

    __slots__ = ("lock", "state", "broken_error", "feeds_open")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.state = PoolState.RUN
        self.broken_error: Optional[BrokenPoolError] = None
        self.feeds_open = 0  # imap feeds still reading input: a closed pool waits for them

    def ended(self) -> bool:
        """Terminated or broken: nothing more will run."""
        state = self.state
        return state is PoolState.TERMINATE or state is PoolState.BROKEN

    def check_running(self) -> None:
        """Raise unless new work is accepted.

        Raises:
            BrokenPoolError: the pool is broken.
            ValueError: the pool was closed or terminated.
        """
        state = self.state
        if state is PoolState.RUN:
            return
        if state is PoolState.BROKEN:
            raise self.broken()
        raise ValueError(f"Pool not running: it was {state.value} (close() or terminate() was called)")

    def broken(self) -> BrokenPoolError:
        """A fresh copy of the error that broke the pool (each raise gets its own traceback)."""
        error = self.broken_error
        if error is None:
            raise RuntimeError("the pool is not broken")
        fresh = BrokenPoolError(*error.args)
        fresh.__cause__ = error.__cause__
        return fresh

    # The transitions below are called with ``lock`` held.

    def close(self) -> None:
        if self.state is PoolState.RUN:
            self.state = PoolState.CLOSE

    def terminate(self) -> bool:
        """Enter TERMINATE unless ended already; whether this call did it."""
        if self.ended():
            return False
        self.state = PoolState.TERMINATE
        return True

    def break_(self, error: BrokenPoolError) -> bool:
        """Enter BROKEN unless ended already; whether this call did it."""
        if self.ended():
            return False
        self.state = PoolState.BROKEN
        self.broken_error = error
        return True
