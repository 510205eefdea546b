"""MainWaits: the main thread's store waits, run on helper threads so that a signal ends them.

Why: torch's store wait is one C++ call that no signal interrupts, so a Ctrl-C during a
barrier or a group creation took effect only when the wait ended (at its timeout, when a
member was slow). Cutting the wait into slices would end it, but torch prints a C++
warning for each slice that expires. So the main thread (the one signals reach) hands
each wait to a helper thread with a connection of its own, and waits for it on an Event,
which a signal interrupts::

    main ── wait(keys, timeout) ──► an idle helper, else a new one ── store.wait ──► store
      │  Event.wait: Ctrl-C raises here                                 │ done
      └─────────────────────────────────────────────────────────────────┘ idle again

A wait left behind by a Ctrl-C ends on its helper when its keys come or at its timeout;
a later wait takes another helper meanwhile. So there is one helper, plus one per wait
left behind that has not ended. Other threads wait on their own connections as before.
"""

from __future__ import annotations

import datetime
import queue
import threading
from typing import Callable, List, Optional, Sequence, Tuple

import torch.distributed as dist

__all__ = ["MainWaits"]

_Job = Tuple[List[str], float, List[Optional[BaseException]], threading.Event]


class _Helper:
    """One helper thread and its store connection (made on its first wait)."""

    def __init__(self, connect: Callable[[], dist.Store], idle: Callable[["_Helper"], None]) -> None:
        self._connect = connect
        self._idle = idle
        self._jobs: "queue.SimpleQueue[Optional[_Job]]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._serve, name="machinlike-store-wait", daemon=True)
        self.thread.start()

    def submit(self, job: Optional[_Job]) -> None:
        self._jobs.put(job)

    def _serve(self) -> None:
        store: Optional[dist.Store] = None
        while True:
            job = self._jobs.get()
            if job is None:
                return  # (its connection closes with this frame)
            keys, timeout, outcome, done = job
            try:
                if store is None:
                    store = self._connect()
                store.wait(keys, datetime.timedelta(seconds=max(timeout, 0.001)))
                outcome.append(None)
            except BaseException as err:  # handed to the waiter, who raises it
                outcome.append(err)
            finally:
                done.set()
                self._idle(self)


class MainWaits:
    """Store waits of the main thread, each on a helper thread (see the module doc).

    Args:
        connect: Makes a helper's store connection.
    """

    def __init__(self, connect: Callable[[], dist.Store]) -> None:
        self._connect = connect
        self._lock = threading.Lock()
        self._idle: List[_Helper] = []
        self._closed = False

    def wait(self, keys: Sequence[str], timeout: float) -> None:
        """``store.wait(keys, timeout)`` on a helper; a signal interrupts the caller's wait.

        Raises:
            What the store's wait raised (``DistStoreError`` at the timeout).
        """
        with self._lock:
            helper = self._idle.pop() if self._idle else None
        if helper is None:
            helper = _Helper(self._connect, self._back)
        outcome: List[Optional[BaseException]] = []
        done = threading.Event()
        helper.submit((list(keys), timeout, outcome, done))
        done.wait()  # bounded: the store's wait ends at ``timeout``
        if outcome[0] is not None:
            raise outcome[0]

    def _back(self, helper: _Helper) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(helper)
                return
        helper.submit(None)

    def close(self, timeout: float = 0.5) -> None:
        """End the idle helpers (and each busy one once its wait ended); their
        connections close with them. Waits up to ``timeout`` seconds for the idle ones."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for helper in idle:
            helper.submit(None)
        for helper in idle:
            helper.thread.join(timeout)
