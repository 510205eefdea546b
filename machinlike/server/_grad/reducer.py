"""The reducer threads of the gradient server: one state machine, two roles.

    clients ──push──► secondary queue ─(reduce_batch_size dicts)─► partial sum, count ─┐
      (full queue: refused and counted,   thread "machinlike-grad-<server>-secondary"   │
       or parked until there is room)     (started by start() or by the first push)    │
                                                                                        ▼
    published version v+1 ◄── optimizer.step(), lr_scheduler.step() ◄── primary queue ◄┘
      (ordered server)            thread "machinlike-grad-<server>-primary"
                                  (full queue: the forward waits, so nothing is lost)

Each reducer owns a queue, a condition and one thread. The thread takes a batch of
``reduce_batch_size`` items (fewer only when a flush asks for everything queued so far),
reduces it, hands the result on, and completes the flushes that are satisfied.
Counters ``enqueued`` (items ever queued) and ``consumed`` (items processed) make a flush
exact: a flush requested when ``enqueued == n`` completes once ``consumed >= n``.

Both roles sum their batch with ``_grad.items.reduce_items``; a secondary hands the sum to
its ``_grad.forward.Forwarder`` (one forward in flight, so it reduces the next batch while
the previous one travels), the primary to ``_grad.primary.ManagedModel.apply``.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch

from ...exception import PeerLostError
from .._errors import ServerStoppedError
from .forward import Forwarder
from .items import Grads, Item, completed, reduce_items

__all__ = ["SecondaryReducer", "PrimaryReducer"]

log = logging.getLogger(__name__)


class _Reducer:
    """Queue, thread, flushes and life cycle shared by both roles."""

    role = ""

    def __init__(self, server_name: str, member: str, batch: int, max_queue: int, device: torch.device) -> None:
        self.server_name = server_name
        self.member = member
        self.batch = batch
        self.max_queue = max_queue
        self.device = device
        self._cond = threading.Condition()
        self._queue: Deque[Item] = deque()
        self._enqueued = 0
        self._consumed = 0
        self._flushes: List[Tuple[int, torch.futures.Future]] = []
        # Items that found the queue full and wait for room (a primary's forwards, a
        # secondary's waiting pushes): each caller waits on its future, so this stays as
        # short as the number of callers blocked at once.
        self._parked: Deque[Tuple[Item, torch.futures.Future]] = deque()
        self._state = "new"  # -> running -> stopped | failed
        self._thread: Optional[threading.Thread] = None
        self.error: Optional[BaseException] = None
        self.counters: Dict[str, int] = {"batches": 0, "dropped": 0, "parked": 0}

    @property
    def thread_name(self) -> str:
        return f"machinlike-grad-{self.server_name}-{self.role}"

    # ---------------------------------------------------------------- life cycle
    def start(self) -> None:
        with self._cond:
            if self._state == "running":
                return
            if self._state != "new":
                raise RuntimeError(f"the {self.role} reducer of gradient server {self.server_name!r} was "
                                   f"stopped; create a new server instead of restarting it")
            self._state = "running"
        self._thread = threading.Thread(target=self._main, name=self.thread_name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float) -> None:
        with self._cond:
            if self._state in ("new", "running"):
                self._state = "stopped"
            before = self.counters["dropped"]
            doomed = self._detach_pending()
            dropped = self.counters["dropped"] - before
            self._cond.notify_all()
        if dropped:
            log.warning("gradient server %r: the %s reducer on member %r stopped with %d queued gradient "
                        "pushes not applied (%s)", self.server_name, self.role, self.member, dropped,
                        self._unapplied_why())
        self._fail_futures(doomed)
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                raise TimeoutError(f"reducer thread {thread.name!r} did not stop within {timeout:g} s "
                                   f"(it is finishing a batch; it exits afterwards)")

    def _unapplied_why(self) -> str:
        """Why pushes still queued at stop() were not applied, or how to apply them next time."""
        return "the accessor's flush() before stop() applies them"

    def watch(self) -> None:
        if self.error is not None:
            raise self.error

    def is_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def refusal(self) -> Optional[Exception]:
        """Why new work is refused now (call with the condition held), or None.

        :class:`ServerStoppedError`, or :class:`~machinlike.exception.PeerLostError` naming
        the member whose loss ended this reducer (a secondary's primary).
        """
        if self._state == "stopped":
            return ServerStoppedError(f"gradient server {self.server_name!r}: the {self.role} reducer on member "
                                      f"{self.member!r} is stopped")
        if self._state == "failed" and isinstance(self.error, PeerLostError):
            return PeerLostError(self.error.member, f"{self.error.detail}; the {self.role} reducer on member "
                                                    f"{self.member!r} stopped with it and refuses new work")
        if self._state == "failed":
            return ServerStoppedError(f"gradient server {self.server_name!r}: the {self.role} reducer on member "
                                      f"{self.member!r} failed with {self.error!r}; watch() on that member "
                                      f"re-raises it with its traceback")
        return None

    def _detach_pending(self) -> List[torch.futures.Future]:
        # With the condition held: what is queued or parked is dropped, what waits is failed.
        self.counters["dropped"] += sum(item.count for item in self._queue)
        self.counters["dropped"] += sum(item.count for item, _ in self._parked)
        self._queue.clear()
        doomed = [fut for _, fut in self._flushes] + [fut for _, fut in self._parked]
        self._flushes = []
        self._parked.clear()
        return doomed

    def _queue_or_park(self, item: Item) -> Optional[torch.futures.Future]:
        """Queue ``item`` (None), or park it until there is room (its future). Condition held."""
        if len(self._queue) < self.max_queue:
            self._queue.append(item)
            self._enqueued += 1
            if len(self._queue) >= self.batch or self._flushes:
                self._cond.notify()
            return None
        self.counters["parked"] += 1
        fut: torch.futures.Future = torch.futures.Future()
        self._parked.append((item, fut))
        return fut

    def _fail_futures(self, futures: List[torch.futures.Future]) -> None:
        with self._cond:
            error = self.refusal() or ServerStoppedError(
                f"gradient server {self.server_name!r}: the {self.role} reducer on member {self.member!r} "
                f"is shutting down")
        for fut in futures:
            if not fut.done():
                fut.set_exception(error)

    # ------------------------------------------------------------------- flushes
    def flush(self) -> torch.futures.Future:
        """A future completed once everything queued before this call is processed."""
        fut: torch.futures.Future = torch.futures.Future()
        idle = False
        with self._cond:
            error = self.refusal()
            if error is None and self._state == "new":
                # Never started, so no thread would ever settle it (machin's helper starts
                # the primary only): done now when nothing is queued, refused otherwise.
                idle = self._enqueued == self._consumed
                if not idle:
                    error = RuntimeError(f"gradient server {self.server_name!r}: the {self.role} reducer on member "
                                         f"{self.member!r} holds {self._enqueued - self._consumed} items but was "
                                         f"never started: call start() on that member")
            elif error is None:
                self._flushes.append((self._enqueued, fut))
                self._cond.notify_all()
        if error is not None:
            fut.set_exception(error)
        elif idle:
            fut.set_result(self._flush_result())
        return fut

    def _settle_flushes(self) -> None:
        with self._cond:
            if not any(target <= self._consumed for target, _ in self._flushes):
                return
        # May raise; the flushes are still listed then, and fail with the thread.
        self._before_settle()
        result = self._flush_result()
        with self._cond:
            ready = [fut for target, fut in self._flushes if target <= self._consumed]
            self._flushes = [(t, f) for t, f in self._flushes if t > self._consumed]
        for fut in ready:
            fut.set_result(result)

    def _before_settle(self) -> None:
        """Hook: make what was processed visible before flushes complete."""

    # --------------------------------------------------------------------- thread
    def _take(self) -> Optional[List[Item]]:
        """The next batch; [] when only flushes need settling; None when stopping."""
        with self._cond:
            while True:
                if self._state != "running":
                    return None
                if len(self._queue) >= self.batch:
                    return [self._queue.popleft() for _ in range(self.batch)]
                if self._flushes:
                    if max(t for t, _ in self._flushes) > self._consumed:
                        return [self._queue.popleft() for _ in range(len(self._queue))]
                    return []
                self._cond.wait()

    def _main(self) -> None:
        try:
            if self.device.type == "cuda":
                # A new thread starts on cuda:0: the reduction, the optimizer's step and the
                # user's hooks run with reduce_device current (its device index, per thread).
                torch.cuda.set_device(self.device)
            while True:
                items = self._take()
                if items is None:
                    return
                self._release(self._after_take())
                if items:
                    self._process(items)
                    with self._cond:
                        self._consumed += len(items)
                        self.counters["batches"] += 1
                self._settle_flushes()
        except BaseException as exc:  # the thread's last act: record it for watch() and callers
            with self._cond:
                stopping = self._state == "stopped"
                if not stopping:
                    self._state = "failed"
                self.error = exc
                doomed = self._detach_pending()
            if stopping:
                log.info("gradient server %r: %s reducer on member %r ended during stop: %r",
                         self.server_name, self.role, self.member, exc)
            else:
                log.error("gradient server %r: the %s reducer thread on member %r failed; the server refuses "
                          "new work", self.server_name, self.role, self.member, exc_info=exc)
            self._fail_futures(doomed)

    def _after_take(self) -> List[torch.futures.Future]:
        with self._cond:
            admitted = []
            while self._parked and len(self._queue) < self.max_queue:
                item, fut = self._parked.popleft()
                self._queue.append(item)
                self._enqueued += 1
                admitted.append(fut)
            return admitted

    def _release(self, futures: List[torch.futures.Future]) -> None:
        for fut in futures:
            fut.set_result(True)

    def _process(self, items: List[Item]) -> None:
        raise NotImplementedError

    def _flush_result(self) -> Any:
        return None

    # ---------------------------------------------------------------- statistics
    def stats(self) -> Dict[str, Any]:
        with self._cond:
            return dict(self.counters, queued=len(self._queue), state=self._state)


class SecondaryReducer(_Reducer):
    """Queues client pushes, reduces batches and forwards partial sums to the primary.

    Args:
        forward: Sends a partial sum to the primary (one in flight at a time) and counts
            what it sent and lost; only this reducer's thread uses it.
        admit: Elastic worlds: ``admit(client)`` counts a push in the store before it
            is acknowledged and returns its source tag (raising while the primary is
            gone); None: pushes are not counted.
    """

    role = "secondary"

    def __init__(self, *args: Any, forward: Forwarder, admit: Optional[Callable[[str], str]] = None) -> None:
        super().__init__(*args)
        self._forward = forward
        self._admit = admit
        self.counters.update(accepted=0, rejected=0)

    def _item(self, grads: Grads, version: int, client: str) -> Item:
        # Called with the condition held, after the push is known to be queued: the
        # store count must never exceed what was really accepted.
        if self._admit is None:
            return Item(grads, 1, [version])
        return Item(grads, 1, [version], {(self._admit(client), client): 1})

    def accept(self, grads: Grads, version: int, client: str = "") -> bool:
        """Queue one client push; False (counted as ``rejected``) when the queue is full.

        Starts the reducer thread if nobody did (machin started only the primary's).

        Args:
            grads, version: The push.
            client: Name of the pushing member (for the elastic accounting).

        Raises:
            ServerStoppedError: the reducer is stopped or failed.
            PeerLostError: (elastic world) the primary reducer is gone; nothing was queued.
        """
        self._start_if_new()
        with self._cond:
            error = self.refusal()
            if error is not None:
                raise error
            if len(self._queue) >= self.max_queue:
                self.counters["rejected"] += 1
                return False
            self._queue.append(self._item(grads, version, client))
            self._enqueued += 1
            self.counters["accepted"] += 1
            if len(self._queue) >= self.batch:
                self._cond.notify()
            return True

    def offer(self, grads: Grads, version: int, client: str = "") -> torch.futures.Future:
        """Queue one client push, waiting for room when the queue is full.

        Returns:
            A future completed (True) once the push is queued; it fails with
            :class:`ServerStoppedError` if the reducer stops first, or with
            ``PeerLostError`` (elastic world) when the primary reducer is gone.
        """
        self._start_if_new()
        with self._cond:
            error = self.refusal()
            if error is None:
                try:
                    item = self._item(grads, version, client)
                except ConnectionError as lost:  # PeerLostError: the primary is gone
                    return completed(None, lost)
                self.counters["accepted"] += 1
                parked = self._queue_or_park(item)
                if parked is not None:
                    return parked
        return completed(True, error)

    def _start_if_new(self) -> None:
        # machin's grad_server_helper constructs the server on every member but calls
        # start() only on the primary: a secondary that was never started would queue
        # its pushes until the queue is full and then refuse them. Start it on first use.
        if self._state == "new":
            self.start()

    def _process(self, items: List[Item]) -> None:
        reduced = reduce_items(items, self.device)
        # CUDA sums travel as they are: through CUDA IPC to a primary on this host, staged
        # through the CPU to any other (distributed._calls.cuda_stage)
        self._forward.send(reduced)

    def _before_settle(self) -> None:
        self._forward.drain()  # a flush of a secondary completes when the primary holds its sums

    def _unapplied_why(self) -> str:
        # A primary that stopped or was lost (the end of an elastic run: trainers push while
        # the server's member closes it) could not take them: no flush would have helped.
        failing = self._forward.failing
        if failing is not None:
            return f"its primary reducer could not take them: {failing}"
        return ("the accessor's flush() before stop() applies them, while the primary reducer "
                f"on member {self._forward.primary!r} still serves")

    def stats(self) -> Dict[str, Any]:
        out = super().stats()
        out.update(forwarded=self._forward.forwarded, lost_forwarding=self._forward.lost)
        return out


class PrimaryReducer(_Reducer):
    """Reduces partial sums from the secondaries and applies them to the managed model.

    Args:
        apply: ``apply(item)``: sets ``.grad``, steps, publishes the next version.
        version: The version published before the first step.
    """

    role = "primary"

    def __init__(self, *args: Any, apply: Callable[[Item], None], version: Callable[[], int],
                 receive: Optional[Callable[[Dict[Tuple[str, str], int]], Optional[BaseException]]] = None) -> None:
        super().__init__(*args)
        self._apply = apply
        self._version = version
        # Elastic worlds: receive(origin) counts a partial sum as received or returns why
        # it is refused (its source is settled); run under this reducer's condition.
        self._receive = receive
        # Forwards that find the queue full are parked; each secondary has at most one in
        # flight, so the parked list stays as short as the number of secondaries.
        self.counters.update(received=0, steps=0, applied=0)

    def accept(self, item: Item) -> torch.futures.Future:
        """Queue a partial sum; the future completes when it is queued (not yet applied)."""
        with self._cond:
            error: Optional[BaseException] = self.refusal()
            if error is None and self._receive is not None and item.origin is not None:
                error = self._receive(item.origin)
            if error is None:
                self.counters["received"] += item.count
                parked = self._queue_or_park(item)
                if parked is not None:
                    return parked
        return completed(True, error)

    def _process(self, items: List[Item]) -> None:
        reduced = reduce_items(items, self.device)
        self._apply(reduced)
        self.counters["steps"] += 1
        self.counters["applied"] += reduced.count

    def _flush_result(self) -> int:
        return self._version()
