"""LaneFuture: an async lane call's torch Future that a signal can interrupt a wait for.

Why: a wait in torch's C++ ``Future.wait`` holds the thread until the call ends, up to its
whole timeout, whatever signal comes, so a Ctrl-C did nothing for that long. The lane
completes its own futures (``lane_conn.Pending.complete``), so it can open a sentinel there::

    made:       a Lock, acquired            (held: not arrived)
    completed:  set_result / set_exception, then arrived(): the Lock released
    waited:     wait_arrived(): acquire + release (a blocking acquire is interrupted by
                signals), then torch's wait returns at once

A Lock is the cheapest such sentinel: an Event costs 1.6 us to make, and a done-callback on
the Future added 40 us to a small call (see ``_calls.future``).

A future's done-callbacks run inside its completion, on the completer's thread: for a lane
future, the connection's watcher (or the expiry) thread. :func:`completing` says so to a callback,
which must then not block there: a call it made to the same peer would wait for an
answer that this very thread is to read.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

import torch

__all__ = ["LaneFuture", "completing"]

# ``_completer.on``: whether this thread is completing a lane future now (set around each
# completion: an attribute, not a function call, twice an answer).
_completer = threading.local()


def completing() -> bool:
    """Whether this thread is completing a lane future now (its done-callbacks run inside)."""
    return getattr(_completer, "on", False)


class LaneFuture(torch.futures.Future):
    """An async lane call's torch Future whose wait a signal interrupts (see the module doc)."""

    def __init__(self) -> None:
        torch._C.Future.__init__(self, [])  # (torch.futures.Future's own parses a devices argument: 0.5 us)
        self._open = threading.Lock()
        self._open.acquire()

    def complete(self, value: Any, error: Optional[BaseException]) -> None:
        """Complete with ``value``, or fail with ``error``, then open the sentinel (the
        lane's completer calls this once), saying :func:`completing` meanwhile."""
        outer = getattr(_completer, "on", False)  # (a completion may run inside another's callbacks)
        _completer.on = True
        settled = True
        try:
            settled = self._settle(value, error)
        finally:
            _completer.on = outer
            if settled:
                self.arrived()

    def _settle(self, value: Any, error: Optional[BaseException]) -> bool:
        """Set the result or the error; False: it is left to be set later (the sentinel
        then opens when it is). A subclass settles the value its own way."""
        if error is None:
            self.set_result(value)
        else:
            self.set_exception(error)
        return True

    def arrived(self) -> None:
        """Say that the Future completed (its completer calls this once)."""
        try:
            self._open.release()
        except RuntimeError:  # (said already)
            pass

    def wait_arrived(self, timeout: Optional[float] = None) -> bool:
        """Block until :meth:`arrived` was called (interruptible by signals), at most
        ``timeout`` seconds (None: no bound); whether it was."""
        if not self._open.acquire(True, -1 if timeout is None else timeout):
            return False
        self._open.release()
        return True
