"""The two waits of the CUDA IPC path, kept off the GPU's queues: for the sender's copies
into a slab (``await_ready``) and for the receiver's copies out of it (``Releaser``).

The receiver polls the sender's slab event from the CPU (``query``; the usual answer is
"done": the copies ran while the message travelled) instead of queueing a wait for it on
its own stream: were the sender SIGKILLed before its copies ran, such a wait would never
end and would stop every later kernel of the receiver's stream with it.

A receiver copies a message's tensors out of the sender's slab on its current stream and
may not tell the sender "FREE" before those copies ran. Waiting for them in the thread
that unpickles costs the GPU's switch between the two processes' contexts (about 150 us
a direction on a time-sliced GPU) on every message's critical path. So the receiver
records an event after its copies and hands the lease to one thread that waits::

    receiver (unpickling)                      releaser thread (one per process, lazily)
    clone each tensor out of the slab          event.synchronize()   (the GIL is free)
    event.record(current stream)               row[0] == lease? ──► row[0] = FREE
    put(event, row, lease) ───────────────►      (the sender may lend the slab again)
    return: the tensors are ready on the
      receiver's current stream, as torch's own ops' results are

A lease that ends late costs the sender a second slab: a puller that calls its server
again at once would find the slab of the last reply still lent, and the server would wait
for it (``ExportArea.lease``, 10 ms at most), then make another. So before a call that
sends no CUDA tensor (a pull) to a process, the caller ends the leases it holds of that
process's slabs (``flush``): the copies out ran long ago in the usual case (the caller
used what it received), and when they have not, the caller waits for them instead of the
callee's thread, and no second slab is made::

    caller, before calling process P       releaser thread
    flush(P): leases of P's slabs pending? ──► (frees them in order; flush waits for
      wait for them (bounded), then send         those of P, ``FLUSH_S`` at most)

A call that sends CUDA tensors skips it: the callee reads them only once the caller's
slab event ran, which comes after the caller's copies out on its stream, so the leases
end meanwhile, without holding the caller up.

Why a thread and not a GPU-side wait in the sender (its stream waiting on an event the
receiver records): a receiver SIGKILLed between its record and its copies would leave
that event never completing, and the sender's stream stuck behind it. Here a receiver
that dies leaves its lease lent, and the sender takes it back by the receiver's pid
(``cuda_ipc_area.ExportArea._reclaim``), as before.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Callable, Deque, Dict, Optional, Protocol, Tuple

import numpy as np

from ..._pids import pid_alive
from .cuda_ipc_area import FREE

__all__ = ["Done", "Ready", "Releaser", "await_ready", "FLUSH_S"]

# Seconds a caller waits at most for its leases of the callee's slabs to end (``flush``):
# the sender's own wait for a lent slab (``cuda_ipc_area._REUSE_WAIT_S``), which this saves.
FLUSH_S = 0.010


class Done(Protocol):
    """What the releaser waits on: a ``torch.cuda.Event`` recorded after the copies."""

    def synchronize(self) -> None: ...


class Ready(Protocol):
    """What ``await_ready`` polls: the sender's slab event, opened here."""

    def query(self) -> bool: ...


def await_ready(event: Ready, pid: int, row: np.ndarray, slab_id: int, limit: float,
                alive: Callable[[int], bool] = pid_alive) -> bool:
    """Return once process ``pid``'s copies into its slab completed (``event``, polled from
    the CPU: a wait queued on this process's stream could never end if the sender died);
    whether it had to wait. ``row``: the slab's control row, ``slab_id`` its id there;
    ``alive(pid)``: whether the sender still runs (asked once a message even when its
    copies are done: ``OpenCache.alive`` answers from a pidfd in about a microsecond).

    Raises:
        RuntimeError: the sender died or retired the slab first (named).
        TimeoutError: its copies did not complete within ``limit`` seconds.
    """
    if _ran(event, pid):  # the usual case: the copies ran while the message travelled
        # "Done" is believed only from a sender still there: the event of a process that
        # was SIGKILLed with its copies still queued may read as complete (CUDA leaves an
        # IPC event of a dead process undefined), and the slab would be read unwritten.
        _sender_there(pid, row, slab_id, alive)
        return False
    start = checked = time.monotonic()
    spins = 0
    while not _ran(event, pid):
        spins += 1
        time.sleep(0 if spins < 64 else 50e-6)  # (yields the GIL; later, the CPU too)
        now = time.monotonic()
        if now - checked >= 0.01:
            checked = now
            _sender_there(pid, row, slab_id, alive)
            if now - start > limit:
                raise TimeoutError(f"the CUDA copies of process {pid} (alive) did not complete within "
                                   f"{limit:.0f} s; its GPU is stuck or far behind")
    _sender_there(pid, row, slab_id, alive)
    return True


def _sender_there(pid: int, row: np.ndarray, slab_id: int, alive: Callable[[int], bool]) -> None:
    if int(row[2]) != slab_id or not alive(pid):
        raise RuntimeError(f"process {pid}, which sent CUDA tensors through CUDA IPC, died or stopped "
                           f"its World before its copies were done; nothing was received")


def _ran(event: Ready, pid: int) -> bool:
    try:
        return event.query()
    except Exception as exc:  # (an error of this call only: nothing sticks to the context)
        raise RuntimeError(f"cannot learn whether process {pid}'s CUDA copies are done (has it died?): "
                           f"{type(exc).__name__}: {exc}; nothing was received") from exc


class Releaser:
    """One thread that frees leases once their copies are done (see the module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._items: Deque[Tuple[Done, np.ndarray, int, int]] = deque()
        self._by_owner: Dict[int, int] = {}  # leases pending by the slab owner's pid (none: absent)
        self._thread: Optional[threading.Thread] = None
        self._stop = False
        self.stats: Dict[str, int] = {"released": 0, "release_wait_failed": 0, "flush_waits": 0, "flush_late": 0}

    def put(self, done: Done, row: np.ndarray, lease: int, owner: int) -> None:
        """Free ``row``'s lease ``lease`` of process ``owner``'s slab once ``done`` completed."""
        with self._cond:
            self._items.append((done, row, lease, owner))
            self._by_owner[owner] = self._by_owner.get(owner, 0) + 1
            if self._thread is None:
                self._stop = False
                self._thread = threading.Thread(target=self._run, name="machinlike-cuda-ipc-release", daemon=True)
                self._thread.start()
            self._cond.notify()

    def pending(self) -> int:
        """Leases handed over and not yet freed."""
        with self._cond:
            return sum(self._by_owner.values())

    def flush(self, owner: int, timeout: Optional[float] = None) -> bool:
        """Wait, ``timeout`` seconds at most (None: ``FLUSH_S``), until the leases handed
        over of process ``owner``'s slabs are freed (see the module docstring); whether they
        were. Counted: ``flush_waits`` when there were some, ``flush_late`` when they
        outlasted ``timeout``."""
        if not self._by_owner:  # (the usual case, without the lock: nothing pending at all)
            return True
        with self._cond:
            if not self._by_owner.get(owner):
                return True
            self.stats["flush_waits"] += 1
            deadline = time.monotonic() + (FLUSH_S if timeout is None else timeout)
            while self._by_owner.get(owner):
                left = deadline - time.monotonic()
                if left <= 0:
                    self.stats["flush_late"] += 1
                    return False
                self._cond.wait(left)
            return True

    def drain(self, timeout: float) -> bool:
        """Wait, ``timeout`` seconds at most, until every lease handed over is freed."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._by_owner:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self, timeout: float) -> bool:
        """Free what is pending (``timeout`` seconds at most), then end the thread; a later
        ``put`` starts a new one. Returns whether everything pending was freed."""
        drained = self.drain(timeout)
        with self._cond:
            thread, self._thread = self._thread, None
            self._stop = True
            self._cond.notify_all()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        return drained

    def _run(self) -> None:
        me = threading.current_thread()
        while True:
            with self._cond:
                while not self._items and not self._stop and self._thread is me:
                    self._cond.wait()
                if not self._items:
                    return
                done, row, lease, owner = self._items.popleft()
            try:
                done.synchronize()
            except Exception:  # a CUDA error here is the process's, and shows there too;
                failed = True  # the copies are over either way (the stream stopped)
            else:
                failed = False
            # Not held while this thread waits for the next lease: it may hold the opening
            # the copies read from, and a slab evicted or retired meanwhile must close now.
            done = None  # type: ignore[assignment]
            if int(row[0]) == lease:
                row[0] = FREE
            with self._cond:
                left = self._by_owner.pop(owner) - 1
                if left:
                    self._by_owner[owner] = left
                self.stats["release_wait_failed" if failed else "released"] += 1
                self._cond.notify_all()
