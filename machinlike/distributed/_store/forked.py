"""Whether this process is a child forked (``os.fork``) from a process whose World ran.

Why: such a child shares its parent's store connections and RPC pipes, and inherits
torch's RPC agent without its threads. A store request sent from the child interleaves
with the parent's on the same connection (and breaks the parent's), and an RPC call waits
for good (torch's timeout thread did not cross the fork). So every store request and call
of the World's objects asks :func:`check` first: in such a child they fail at once, naming
the fix, and the parent is left alone::

    parent:  World starts: running(True)  ...  os.fork()  ...  World stops: running(False)
                                                  │
    child:                          after the fork: forked from the parent (when running)
                                    check(...) ──► RuntimeError, nothing sent

The check on the hot path is one global read.
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["running", "check"]

_running = False
_forked_from: Optional[int] = None  # the parent's pid, in a child forked while its World ran


def running(yes: bool) -> None:
    """Say that this process's World started (True) or stopped (False)."""
    global _running
    _running = yes


def check(what: str) -> None:
    """Raise RuntimeError when this process was forked from one whose World ran.

    Args:
        what: What was about to be used, for the message (e.g. ``"an RPC call"``).
    """
    if _forked_from is not None:
        raise RuntimeError(
            f"{what} in process {os.getpid()}, forked (os.fork) from process {_forked_from} while its World "
            f"ran: that World, its groups and servers are the parent's and cannot be used here (their RPC "
            f"threads did not cross the fork, and their connections are the parent's); start the child with "
            f"'spawn' (machinlike.process.Process, a pool or launch) and give it a World of its own")


def _after_fork_in_child() -> None:
    global _forked_from, _running
    if _running:
        _forked_from = os.getppid()
        _running = False


os.register_at_fork(after_in_child=_after_fork_in_child)
