"""The inference host's batcher: one thread that turns waiting requests into calls of ``fn``.

It owns the queue of requests, its lock and condition, the counters and the timing
windows. Requests arrive from RPC handlers (``submit`` returns at once: the handler's
future is completed here later, so no RPC thread waits on a batch)::

    submit(request) ─► queue (FIFO, at most max_pending) ─┐ notify
                                                          ▼
    batcher thread:  the oldest request fixes the signature (trailing shapes, dtypes)
                     wait until max_batch rows of it wait, max_wait after its arrival,
                     or every caller of the last second sent again (see ``company``)
                     take it and the later ones of the same signature up to max_batch
                     rows (others keep their places); skip expired requests and those
                     whose caller is gone
                     run(join(rows)) ─► split ─► each request's future
                     fn raised? run each request alone: only the culprit fails

Why one thread: ``fn`` is one model (one set of weights, often one device); a second
thread would only contend for the same cores. The weights change between batches only
(see ``ModelSlot`` in :mod:`machinlike.server.inference`, whose lock also keeps two
calls of ``fn`` apart). One exception saves a thread hand-over: with ``max_wait=0`` a
request that finds nothing waiting and no batch running is run at once on its RPC thread.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Hashable, List, Optional, Tuple

from .batch import Inputs, cuda_device, join, signature, split
from .company import Company
from .request import Request
from ...exception import freeze_traceback
from .._errors import ServerStoppedError

__all__ = ["Request", "Batcher"]

log = logging.getLogger(__name__)

_WINDOW = 4096  # timing samples kept for the percentiles (the newest)


def _percentile(samples: List[float], q: float) -> Optional[float]:
    if not samples:
        return None
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


class Batcher:
    """The queue and the thread that runs ``fn`` over batches of it.

    Args:
        what: The server, for messages and the thread's name.
        run: Runs the model over one batch; returns ``(output, version)``.
        alive: ``alive(member, incarnation)``: whether that caller still waits.
        max_batch: Rows per call of ``fn`` at most (a single larger request runs alone).
        max_wait: Seconds the oldest request waits for more rows (0: none).
        max_pending: Requests waiting at most; a request beyond is refused.
    """

    def __init__(self, what: str, run: Callable[[Inputs], Tuple[Any, Any]], alive: Callable[[str, int], bool],
                 max_batch: int, max_wait: float, max_pending: int) -> None:
        self._what = what
        self._fn_what = f"fn of inference server {what!r}"
        self._run_model = run
        self._alive = alive
        self.max_batch = max_batch
        self.max_wait = max_wait
        self.max_pending = max_pending
        self._lock = threading.Lock()  # guards everything below; taken bare where no wait or notify follows
        self._cond = threading.Condition(self._lock)
        self._queue: Deque[Request] = deque()
        self._rows_by_sig: Dict[Hashable, int] = {}
        self._closed = False
        self._busy = False  # a batch is being taken or run (by either thread)
        self._counts = {"requests": 0, "batches": 0, "failed_batches": 0, "rows": 0, "batched_requests": 0,
                        "dropped": 0, "expired": 0, "overdue": 0, "errors": 0, "rejected": 0, "isolations": 0}
        self._said_rowwise = False  # (the warning that batches fail only joined: once)
        self._company = Company()  # who the open batch still waits for (not with max_wait 0)
        self._waits: Deque[float] = deque(maxlen=_WINDOW)
        self._fn_times: Deque[float] = deque(maxlen=_WINDOW)
        self._thread = threading.Thread(target=self._loop, name=f"machinlike-infer-{what}", daemon=True)
        self._thread.start()

    # ---------------------------------------------------------------- the queue
    def submit(self, request: Request) -> None:
        """Queue ``request`` (called on an RPC thread; returns at once).

        Raises:
            ServerStoppedError: the server was closed.
            RuntimeError: ``max_pending`` requests are waiting already.
        """
        with self._lock:  # (notify below holds it: a Condition over this very lock)
            if self._closed:
                raise ServerStoppedError(f"inference server {self._what!r} is closed")
            if len(self._queue) >= self.max_pending:
                self._counts["rejected"] += 1
                raise RuntimeError(f"inference server {self._what!r} has {len(self._queue)} requests waiting "
                                   f"(max_pending={self.max_pending}): fn cannot keep up with its callers; "
                                   f"send larger requests, or raise max_pending / max_batch")
            self._counts["requests"] += 1
            # Nothing to wait for (max_wait 0), nothing waiting, no batch running: run it
            # here, on the RPC thread, and save the hand-over to the batcher thread.
            inline = not self.max_wait and not self._queue and not self._busy
            if inline:
                self._busy = True
            else:
                request.sig = signature(request.x)  # type: ignore[arg-type]
                self._queue.append(request)
                self._rows_by_sig[request.sig] = self._rows_by_sig.get(request.sig, 0) + request.rows
                self._company.arrived(request)
                self._cond.notify()
        if inline:
            self._run_inline(request)

    def _remove(self, request: Request) -> None:
        # Under the lock.
        left = self._rows_by_sig[request.sig] - request.rows
        if left:
            self._rows_by_sig[request.sig] = left
        else:
            del self._rows_by_sig[request.sig]

    def _take(self) -> Optional[Tuple[List[Request], List[Tuple[Request, BaseException]]]]:
        """The next batch and the requests to fail (expired, caller gone); None once closed."""
        with self._cond:
            # Also while a request runs inline on its RPC thread: fn is taken, and the
            # requests arriving meanwhile make one batch when it is free (taken at once,
            # the first of them waited for the model alone, then ran alone: a trial met
            # batches of 1.5 requests under max_wait=0, 43% less throughput).
            while (not self._queue or self._busy) and not self._closed:
                self._cond.wait()
            if self._closed:
                return None
            first = self._queue[0]  # only this thread removes requests: it stays first
            until = first.arrived + self.max_wait
            company = self._company
            if self.max_wait:
                company.open(first.sig, self._queue, time.monotonic())
            # (until max_batch rows wait, max_wait passed, or every recent caller sent again)
            while not self._closed and self._rows_by_sig[first.sig] < self.max_batch and not company.complete():
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            company.close()
            if self._closed:
                return None
            now = time.monotonic()
            batch: List[Request] = []
            failed: List[Tuple[Request, BaseException]] = []
            kept: Deque[Request] = deque()
            rows = 0
            for req in self._queue:
                if req.deadline <= now:
                    self._counts["expired"] += 1
                    failed.append((req, TimeoutError(f"inference server {self._what!r}: the request waited past "
                                                     f"its caller's timeout")))
                elif req.sig == first.sig and (not batch or rows + req.rows <= self.max_batch) \
                        and rows < self.max_batch:
                    if self._alive(req.caller, req.incarnation):
                        batch.append(req)
                        rows += req.rows
                    else:
                        self._counts["dropped"] += req.rows
                        failed.append((req, RuntimeError(f"caller {req.caller!r} (incarnation {req.incarnation}) "
                                                         f"is gone: its request was dropped")))
                else:
                    kept.append(req)
                    continue
                self._remove(req)
            self._queue = kept
            self._busy = True
            if self.max_wait and batch:
                company.batched(batch, now)
            return batch, failed

    # ---------------------------------------------------------------- the thread
    def _loop(self) -> None:
        try:
            while True:
                taken = self._take()
                if taken is None:
                    return
                batch, failed = taken
                for req, exc in failed:
                    self._settle(req, exc=exc)
                try:
                    if batch:
                        self._run(batch)
                finally:
                    with self._cond:
                        self._busy = False
        except BaseException as exc:  # never leave callers waiting on a dead thread
            log.exception("inference server %r: the batcher thread failed", self._what)
            self._fail_all(ServerStoppedError(f"inference server {self._what!r} stopped: its batcher thread "
                                              f"failed ({type(exc).__name__}: {exc})"))
            raise

    def _run(self, batch: List[Request]) -> None:
        start = time.monotonic()
        try:
            out, version = self._run_model(join([req.x for req in batch]))  # type: ignore[misc]
            pieces = split(out, [req.rows for req in batch], self._fn_what, [cuda_device(req.x) for req in batch])
        except Exception as exc:
            self._count_fn(batch, start, ok=False)
            if len(batch) == 1:
                self._settle(batch[0], exc=exc)
                return
            # Who made fn fail? Run each request alone: only the culprit's caller hears of it.
            with self._cond:
                self._counts["isolations"] += 1
                errors = self._counts["errors"]
            for req in batch:
                self._run([req])
            if self._counts["errors"] == errors and not self._said_rowwise:
                # No culprit: the batch fails only joined (cold trial 11: a lone observation
                # sent without its batch dim), so every such batch runs request by request.
                self._said_rowwise = True
                log.warning("inference server %r: fn failed on %d requests joined (%s: %s) but on none of them "
                            "alone: they are run one by one, unbatched; a request's first dim must be its rows "
                            "(one observation: x.unsqueeze(0)) and fn must treat rows alike", self._what,
                            len(batch), type(exc).__name__, exc)
            return
        # A caller gone while fn ran is dropped, not answered: each request counts once.
        gone = [not self._alive(req.caller, req.incarnation) for req in batch]
        self._count_fn(batch, start, ok=True, answered=[req for req, g in zip(batch, gone) if not g])
        for req, piece, g in zip(batch, pieces, gone):
            if g:
                with self._cond:
                    self._counts["dropped"] += req.rows
            self._settle(req, value=(piece, version))

    def _run_inline(self, req: Request) -> None:
        """``_run`` of one request on its RPC thread, which waits for it right now (so no
        liveness check before; one after, for the books); the books and the end of
        ``_busy`` in one lock round."""
        start = time.monotonic()
        try:
            out, version = self._run_model(req.x)  # type: ignore[arg-type]
            value = (split(out, (req.rows,), self._fn_what, (cuda_device(req.x),))[0], version)
        except BaseException as exc:
            self._count_fn([req], start, ok=False, idle=True)
            if not isinstance(exc, Exception):
                raise
            self._settle(req, exc=exc)
            return
        gone = not self._alive(req.caller, req.incarnation)  # (it died while fn ran)
        self._count_fn([req], start, ok=True, idle=True, answered=[] if gone else None)
        if gone:
            with self._cond:
                self._counts["dropped"] += req.rows
        self._settle(req, value=value)

    def _count_fn(self, batch: List[Request], start: float, ok: bool, idle: bool = False,
                  answered: Optional[List[Request]] = None) -> None:
        """The books of one call of ``fn``; a failed call of one request is its error (a
        failed batch's culprits are counted when run alone). ``idle``: no batch runs now.
        ``answered``: the requests of a call that succeeded whose callers are there (None:
        all of ``batch``)."""
        took = time.monotonic() - start
        counts = self._counts
        with self._lock:
            counts["batches"] += 1
            self._fn_times.append(took)
            if ok:
                answered = batch if answered is None else answered
                counts["batched_requests"] += len(answered)
                for req in answered:
                    counts["rows"] += req.rows
                    self._waits.append(start - req.arrived)
            else:
                counts["failed_batches"] += 1
                if len(batch) == 1:
                    counts["errors"] += 1
            if idle:
                self._busy = False
                if self._queue:  # (the batcher thread waits for fn to be free; else it sleeps on)
                    self._cond.notify()

    def _settle(self, req: Request, value: Any = None, exc: Optional[BaseException] = None) -> None:
        req.x = None  # the rows (maybe a caller's shared segment) are not needed any more
        try:
            if exc is not None:
                # Its frames hold this batch's requests: frozen, or the future, its error
                # and the request's rows lived for good (see freeze_traceback).
                req.fut.set_exception(freeze_traceback(exc))
            else:
                req.fut.set_result(value if req.reply is None else req.reply(value))
        except Exception:  # a reply that cannot be made must not stop the others'
            log.exception("inference server %r: answering %r failed", self._what, req.caller)

    def _fail_all(self, exc: BaseException) -> None:
        with self._cond:
            self._closed = True
            pending, self._queue = list(self._queue), deque()
            self._rows_by_sig.clear()
        for req in pending:
            self._settle(req, exc=exc)

    # ---------------------------------------------------------------- outside
    def note_overdue(self) -> None:
        """Count a result sent plainly because its caller's deadline had passed."""
        with self._lock:
            self._counts["overdue"] += 1

    def stats(self) -> Dict[str, Any]:
        """Counters and timing percentiles (see ``InferenceServerImpl.stats``)."""
        with self._cond:
            out: Dict[str, Any] = dict(self._counts)
            waits, times = list(self._waits), list(self._fn_times)
            out["pending"] = len(self._queue)
        batches = out["batches"] - out["failed_batches"]  # (the means are of the calls that answered)
        out["mean_batch"] = out["rows"] / batches if batches else 0.0
        out["mean_requests"] = out["batched_requests"] / batches if batches else 0.0
        out["queue_wait_p50"], out["queue_wait_p95"] = _percentile(waits, 0.5), _percentile(waits, 0.95)
        out["fn_time_p50"], out["fn_time_p95"] = _percentile(times, 0.5), _percentile(times, 0.95)
        return out

    def close(self, timeout: float) -> None:
        """Stop the thread; waiting requests fail with :class:`ServerStoppedError`.

        Raises:
            TimeoutError: the thread was still running a batch after ``timeout`` seconds.
        """
        self._fail_all(ServerStoppedError(f"inference server {self._what!r} was closed"))
        with self._cond:
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"inference server {self._what!r}: the batcher thread was still running a "
                                   f"batch after {timeout:g} s")
