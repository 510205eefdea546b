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
"""

from __future__ import annotations

import os
import threading
from typing import Set

__all__ = ["PipeLedger", "RECYCLE_ENV", "DEFAULT_RECYCLE_AFTER", "recycle_after"]


# Gone workers this member's agent called before it recycles the agent (see PipeLedger): on
# one host each holds about 8 MB, 24 maps and 24 descriptors until then. 8 keeps a
# learner's agents well under ``ulimit -n 1024`` (benchmarks/soak.py) while a recycling
# (one join) stays rare; docs/tutorials/elastic.rst, "What a dead peer costs".
RECYCLE_ENV = "MACHINLIKE_RECYCLE_AFTER"
DEFAULT_RECYCLE_AFTER = 8


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

    def called(self, worker: str) -> None:
        """Note a call to ``worker`` (every call; costs one set look-up once it is known)."""
        if worker in self._called:  # no lock: a membership test of a set is atomic
            return
        with self._lock:
            self._called.add(worker)

    def gone(self, worker: str) -> None:
        """Note that ``worker`` is gone for good (its member was lost or left, or it moved)."""
        with self._lock:
            if worker in self._called:
                self._called.discard(worker)  # counted once; a set only of live pipes
                self._dead += 1

    def due(self) -> bool:
        """Whether enough called workers are gone to recycle the agent."""
        return self.limit > 0 and self._dead >= (1 if self._first else self.limit)

    def dead(self) -> int:
        """Gone workers this agent holds a pipe to."""
        return self._dead

    def reset(self) -> None:
        """A new agent: it has no pipes yet."""
        with self._lock:
            self._called.clear()
            self._dead = 0
            self._first = False
