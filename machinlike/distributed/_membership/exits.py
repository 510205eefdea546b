"""Exits: a process's liveness threads end before its interpreter finalizes.

Owns the set of running liveness threads (weakly: a monitor that goes is forgotten) and
the exit hook, registered on first use::

    Monitor.start  ──► running(monitor)     (registers the hook once)
    thread's end   ──► stopped(monitor)
    interpreter exit ──► every running monitor: ask_to_end(), then join, EXIT_WAIT s in all

Why: a liveness thread inside a store request when Python finalizes can never take the
GIL back; torch's C++ under it is unwound, and the process aborts ("terminate called
without an active exception", SIGABRT) instead of exiting with its own code. A process of
64 members that ended without closing them aborted 6 times in 6.
"""

from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Protocol

from ..._deadline import deadline_left

__all__ = ["EXIT_WAIT", "Ending", "running", "stopped"]

#: Seconds the interpreter's exit waits, in all, for this process's liveness threads to end.
EXIT_WAIT = 2.0


class Ending(Protocol):
    """What the hook needs of a liveness thread's owner."""

    def ask_to_end(self) -> None: ...

    def join(self, timeout: float) -> None: ...


_RUNNING: "weakref.WeakSet[Ending]" = weakref.WeakSet()
_LOCK = threading.Lock()
_REGISTERED = False  # whether _end_at_exit is registered (guarded by _LOCK)


def running(owner: Ending) -> None:
    """``owner``'s thread is starting: end it at the interpreter's exit."""
    global _REGISTERED
    with _LOCK:
        if not _REGISTERED:
            # (on first use: atexit runs its hooks last-in first-out, so this runs before
            # the hooks of the store or torch's RPC, set up earlier)
            atexit.register(_end_at_exit)
            _REGISTERED = True
        _RUNNING.add(owner)


def stopped(owner: Ending) -> None:
    """``owner``'s thread has ended."""
    with _LOCK:
        _RUNNING.discard(owner)


def _end_at_exit() -> None:
    with _LOCK:
        owners = list(_RUNNING)
    for owner in owners:
        owner.ask_to_end()
    deadline = time.monotonic() + EXIT_WAIT
    for owner in owners:
        owner.join(deadline_left(deadline))
