"""PipeLedger: which RPC workers this process's current agent has pipes to, and how
many of those workers are gone: when to recycle the agent.

Why: torch's TensorPipe agent opens a pipe to a worker on its first call to it and keeps
it for the agent's life, whether or not the worker is still there. A pipe to a worker on
the same host holds TensorPipe's shared-memory ring buffers (about 8 MB, 24 memory maps
and 24 descriptors), so a member that outlives its peers runs out of memory or of open
files (a learner under ``ulimit -n 1024`` died after 34 actor deaths). Pipes *into* this
process go with their peer; pipes *out of* it stay. The only way to drop them is to drop
the agent: once ``limit`` workers this agent called are gone, the member renews its
agent (a new worker name; the membership layer moves its claims and tells the others),
and the retired agent is shut down once no call can still be under way on it::

    call to worker W ──► called(W)           W gone (lost, left, moved) ──► gone(W)
                              │                                                │
                              └──────────── dead = called ∩ gone ◄─────────────┘
                                                  │ len(dead) >= limit
                                                  ▼
                     liveness thread: renew the agent, reset(); reap the retired one later

Only workers this agent called count: a peer that died without being called left no pipe
here, and counting it would recycle for nothing (and every recycling leaves a gone worker
in the peers that called the old agent).

An agent made due by a worker that *left* recycles only ``LEAVE_GRACE`` seconds later
(one made due by a lost or moved worker: at once). Why: members leave cleanly mostly at
the end of a run, one after the other; every member that had called the first leaver
recycled while it was leaving itself (a join calling every peer, then its old agent shut
down under them), and each of those moves made the next member due: every elastic run
ended in a burst of TensorPipe warnings and "now answers as RPC worker" lines (trial 7).
A member that goes on running recycles a few seconds later, at the cost of its dead pipes
for that long.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Optional, Set

__all__ = ["PipeLedger", "RECYCLE_ENV", "DEFAULT_RECYCLE_AFTER", "LEAVE_GRACE", "recycle_after"]


# Gone workers this member's agent called before it recycles the agent (see PipeLedger): on
# one host each holds about 8 MB, 24 maps and 24 descriptors until then. 8 keeps a
# learner's agents well under ``ulimit -n 1024`` (benchmarks/soak.py) while a recycling
# (one join) stays rare; docs/tutorials/elastic.rst, "What a dead peer costs".
RECYCLE_ENV = "MACHINLIKE_RECYCLE_AFTER"
DEFAULT_RECYCLE_AFTER = 8

# Seconds an agent made due by a worker that left waits before it recycles (see the
# module doc): longer than members of an ending run take to leave after each other on a
# loaded 2-core box (about 1 to 2 s in trial 7's runs).
LEAVE_GRACE = 5.0


def recycle_after() -> int:
    """The recycling threshold from ``MACHINLIKE_RECYCLE_AFTER`` (default 8; 0: never)."""
    text = os.environ.get(RECYCLE_ENV, str(DEFAULT_RECYCLE_AFTER))
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{RECYCLE_ENV}={text!r} must be a whole number of gone workers (0: never recycle)") \
            from None
    if value < 0:
        raise ValueError(f"{RECYCLE_ENV}={value} must be >= 0 (0: never recycle)")
    return value


class PipeLedger:
    """The current agent's called workers and the gone ones among them.

    The process's first agent is due at its first gone worker: torch's RRef context holds
    that agent for the life of the process, so what it holds is never freed, and the
    sooner it retires, the less that is.

    Args:
        limit: Gone workers with a pipe from this agent that make it due for recycling;
            0 turns recycling off.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._first = True  # the process's first agent (see above)
        self._lock = threading.Lock()
        # Live workers called by this agent; read without the lock on the hot path.
        self._called: Set[str] = set()
        self._dead = 0
        self._due_at: Optional[float] = None  # time.monotonic() from which it is due

    def called(self, worker: str) -> None:
        """Note a call to ``worker`` (every call; costs one set look-up once it is known)."""
        if worker in self._called:  # no lock: a membership test of a set is atomic
            return
        with self._lock:
            self._called.add(worker)

    def gone(self, worker: str, left: bool = False) -> None:
        """Note that ``worker`` is gone for good: its member was lost, or it moved, or
        (``left``) its member left the world (see the module doc)."""
        with self._lock:
            if worker not in self._called:
                return
            self._called.discard(worker)  # counted once; a set only of live pipes
            self._dead += 1
            if self.limit > 0 and self._dead >= (1 if self._first else self.limit):
                at = time.monotonic() + (LEAVE_GRACE if left else 0.0)
                self._due_at = at if self._due_at is None else min(self._due_at, at)

    def due(self) -> bool:
        """Whether enough called workers are gone to recycle the agent (the grace after a
        leave over)."""
        due_at = self._due_at
        return due_at is not None and time.monotonic() >= due_at

    def dead(self) -> int:
        """Gone workers this agent holds a pipe to."""
        return self._dead

    def reset(self) -> None:
        """A new agent: it has no pipes yet."""
        with self._lock:
            self._called.clear()
            self._dead = 0
            self._due_at = None
            self._first = False
