"""The claim/take-back ledger a process worker shares with its pool: one object, both sides.

A small block of shared memory (a ``RawArray``) and the lock that orders its writes::

    slot 0             sequence number of the last task frame taken (claimed or skipped)
    slot 1             phase of that task: loading / running / pickling its result
    slot 2 + s % RING  == s when the pool took task s back (work stealing)
    last slot          sequence number of the last outcome the pool loaded (delivered)

The worker *claims* a task frame under the lock: it notes the frame's sequence number in
slot 0 unless the pool has marked it as taken back, in which case it skips it. The pool
takes tasks back under the same lock, and only those numbered above slot 0. So a task runs
exactly once, and when the worker dies the pool knows which of its tasks it had started
(those fail with WorkerLostError) and which it had not (those go to other workers). The
phase is written by the worker alone, read by the pool after the worker died.

A retiring worker waits (bounded) until the pool loaded its last outcome: a result that
holds tensors by reference (``share_method="cpu"``) names descriptors of the worker's,
which close when it exits; with ``maxtasksperchild=1`` every result was lost so (cold
trial 27).

The pool builds a ledger with :meth:`Ledger.create`; it travels to the worker process as a
start argument (the array and the lock are inherited, not copied).
"""

from __future__ import annotations

import threading
import time
from multiprocessing.context import BaseContext
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

__all__ = ["Ledger", "IDLE", "LOADING", "RUNNING", "PICKLING", "PHASES", "RING"]

IDLE, LOADING, RUNNING, PICKLING = 0, 1, 2, 3
#: What a worker was doing when it died, by phase (for WorkerLostError's detail).
PHASES: Dict[int, str] = {
    IDLE: "between tasks",
    LOADING: "while loading its task (unpickling the arguments)",
    RUNNING: "while running its task",
    PICKLING: "while pickling its task's result",
}
#: Slots of the take-back ring: more than the frames a channel ever holds unread.
RING = 256

_STARTED, _PHASE, _RING_START = 0, 1, 2
_DELIVERED = _RING_START + RING


class Ledger:
    """One worker's shared claim/take-back record (see the module docstring).

    Args:
        lock: A multiprocessing lock shared by the pool and the worker.
        shared: A ``RawArray("q", 2 + RING)`` shared likewise.
    """

    __slots__ = ("_lock", "_shared")

    def __init__(self, lock: Any, shared: Any) -> None:
        self._lock = lock
        self._shared = shared

    @classmethod
    def create(cls, ctx: BaseContext) -> "Ledger":
        """A fresh ledger: nothing taken, the worker idle."""
        shared = ctx.RawArray("q", [-1] * (_DELIVERED + 1))
        shared[_PHASE] = IDLE
        return cls(ctx.Lock(), shared)

    def __reduce__(self) -> Tuple[Any, ...]:
        return (Ledger, (self._lock, self._shared))

    def release(self) -> None:
        """(pool side, its channels closed: nothing is taken back) Let go of the shared lock;
        reads go on.

        Why: the lock is a named semaphore that lives until its last holder lets go, and a
        closed pool's handles outlive its workers: a parent ended by a signal afterwards
        left it to the resource tracker ("leaked semaphore objects" at its exit).
        """
        self._lock = threading.Lock()  # (nobody else writes now)

    # ------------------------------------------------------------------ worker side

    def claim(self, seq: int) -> bool:
        """Take task frame ``seq``: True to run it, False if the pool took it back."""
        shared = self._shared
        with self._lock:
            taken_back = shared[_RING_START + seq % RING] == seq
            shared[_STARTED] = seq
        return not taken_back

    def set_phase(self, phase: int) -> None:
        """Note what the worker is doing now (one of the phase constants)."""
        self._shared[_PHASE] = phase

    def await_delivered(self, seq: int, timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until the pool loaded outcome ``seq`` (or a later
        one); True when it did. For a worker about to exit (see the module doc)."""
        deadline = time.monotonic() + timeout
        pause = 0.0005
        while self._shared[_DELIVERED] < seq:
            if time.monotonic() >= deadline:
                return False
            # (a word in shared memory has no wake-up to wait on: poll, backing off)
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        return True

    # ------------------------------------------------------------------ pool side

    def delivered(self, seq: int) -> None:
        """Outcome ``seq`` was loaded here (the pool alone writes this slot, in order)."""
        if seq > self._shared[_DELIVERED]:
            self._shared[_DELIVERED] = seq

    def started(self) -> int:
        """Sequence number of the last task frame the worker took (-1: none yet)."""
        return self._shared[_STARTED]

    def phase(self) -> int:
        """The worker's phase (meaningful once it has died)."""
        return self._shared[_PHASE]

    def take_back(self, choose: Callable[[int], Sequence[int]], wait: float) -> Optional[Sequence[int]]:
        """Take back the tasks ``choose(started)`` names, atomically with respect to claims.

        Args:
            choose: Given the last started sequence number, returns the sequence numbers
                to take back (all above it); called with the lock held.
            wait: Seconds to wait for the lock. The worker holds it for microseconds,
                so a longer wait means it died holding it.

        Returns:
            The sequence numbers taken back, or None when the lock was not had in time.
        """
        if not self._lock.acquire(True, wait):
            return None
        try:
            shared = self._shared
            seqs = choose(shared[_STARTED])
            for seq in seqs:
                shared[_RING_START + seq % RING] = seq
            return seqs
        finally:
            self._lock.release()
