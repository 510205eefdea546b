"""BoundedLookups: store look-ups that end within the caller's time left.

Why: a c10d store client waits on a silent store (its host stopped, or a partition) for
its own timeout, whatever the caller has left, and a clone's ``set_timeout`` does not
bound ``compare_set``. A call that must look its owner up first would then wait the
store's whole timeout instead of the call's. The look-up runs on one thread of its own
with its own store connection; the caller waits for it at most the time it has left::

    caller ──► queue ──► lookup thread (own clone) ──► store
       │                       │ answer
       └── Event.wait(left) ◄──┘          not answered in time ──► TimeoutError

A look-up left behind finishes (or fails) on that thread when the store answers; those
behind it in the queue then wait too, which is right: the store is silent for them as
well. The thread is a daemon and is never joined, so a silent store cannot hold up
interpreter exit.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable, Generic, List, Optional, Tuple, TypeVar

import torch.distributed as dist

from . import forked

__all__ = ["BoundedLookups"]

T = TypeVar("T")


class _Pending(Generic[T]):
    __slots__ = ("op", "done", "result")

    def __init__(self, op: Callable[[dist.Store], T]) -> None:
        self.op = op
        self.done = threading.Event()
        self.result: List[Tuple[bool, object]] = []


class BoundedLookups:
    """Runs store operations on one thread and waits for each at most a given time.

    Args:
        store: The world's store; the thread uses a clone of it (its own connection).
        store_owner: Who hosts the store, for the timeout's message.
    """

    def __init__(self, store: dist.Store, store_owner: str) -> None:
        self._store = store
        self.store_owner = store_owner
        self._queue: "queue.SimpleQueue[Optional[_Pending[object]]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._ready: Optional[dist.Store] = None  # a connection opened by warm()

    def run(self, op: Callable[[dist.Store], T], timeout: float, what: str) -> T:
        """``op(store)`` on the lookup thread, waited for at most ``timeout`` seconds.

        Raises:
            TimeoutError: the store did not answer within ``timeout`` (names its host).
            Exception: what ``op`` raised.
        """
        forked.check("a store look-up")
        pending: _Pending[T] = _Pending(op)
        self._start()
        self._queue.put(pending)  # type: ignore[arg-type]
        if not pending.done.wait(max(timeout, 0.001)):
            raise TimeoutError(f"{what}: the world's store ({self.store_owner}) did not answer within "
                               f"{timeout:.3g} s")
        ok, value = pending.result[0]
        if ok:
            return value  # type: ignore[return-value]
        raise value  # type: ignore[misc]

    def warm(self) -> None:
        """Open the lookup thread's connection now, on the caller's thread (the thread
        itself starts at the first look-up), instead of at the first look-up: a store's
        host may take seconds to answer a new connection (torch's server looks each
        client's host name up; a resolver that drops the query holds it for its timeout,
        5 s by default), and a first call would wait that out."""
        with self._lock:
            if self._thread is None and self._ready is None:
                self._ready = self._connect()

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="machinlike-store-lookups", daemon=True)
                self._thread.start()

    def close(self, timeout: float = 1.0) -> None:
        """End the lookup thread once the look-ups before this are done (at most ``timeout``
        seconds: one stuck on a silent store is left behind, a daemon). Its connection
        closes with it (one opened by ``warm`` and never used, at once)."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._ready = None
        if thread is not None:
            self._queue.put(None)
            thread.join(timeout)

    def _connect(self) -> dist.Store:
        clone = getattr(self._store, "clone", None)
        return clone() if clone is not None else self._store

    def _serve(self) -> None:
        with self._lock:
            store, self._ready = self._ready, None
        if store is None:
            store = self._connect()
        while True:
            pending = self._queue.get()
            if pending is None:
                return
            try:
                pending.result.append((True, pending.op(store)))
            except BaseException as err:  # handed to the caller, who raises it
                pending.result.append((False, err))
            finally:
                pending.done.set()
