"""Metrics: a scalar writer whose sinks run on a thread of their own, behind a bounded queue.

    training loop                 queue of batches, <= max_pending points   writer thread
    -------------                 ---------------------------------------   -------------
    scalar / scalars ──one put──►  [[points of a call], ...]  ──get all──► one batch ─► every sink.write
        no room? count it in dropped                                        every flush_every s: sink.flush
    flush(timeout) ──────────────────► marker ────────────────────► flush, then set the marker
    close(timeout) ──────────────────► stop ──────────────────────► drain, flush, sink.close

Why a thread and a queue: a sink's write is file or network I/O (TensorBoard's protobuf
encoding, a CSV row, a W&B request) that must not stall a learner; the caller only
appends a list. Why bounded: a sink slower than the loop must not grow memory without
bound; what does not fit is dropped and counted (``dropped``), never waited for.

The thread holds the queue and the sinks, not the :class:`Metrics` object, so a writer
that is dropped without ``close`` is still collected; a finalizer then stops its thread,
and at the end of the process writes what was queued. It is multiprocessing's, not
``weakref.finalize``: a child of a Process or a launch() rank ends by ``os._exit``, past
``atexit``, and a writer kept there to the end lost every point (cold trial 30).
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from multiprocessing import util as _mp_util
from numbers import Real
from typing import Any, List, Mapping, Optional, Sequence, Union

from ._sinks import CsvSink, Point, Sink, TensorBoardSink, WandbSink, tensorboard_available

__all__ = ["Metrics"]

log = logging.getLogger(__name__)

_STOP = object()
# Before a pool's (15): points logged from its tasks' results are written first.
_EXIT_PRIORITY = 20
# TensorBoard keeps a step as an int64: a larger one failed in the writer thread, and the
# rest of its batch (points logged after it) with it.
_STEPS = (-(2 ** 63), 2 ** 63 - 1)
SinkSpec = Union[str, Sink]


def _open_sinks(logdir: str, sinks: Optional[Sequence[SinkSpec]],
                wandb_options: Optional[Mapping[str, Any]]) -> List[Sink]:
    if sinks is None:
        sinks = ("csv", "tensorboard") if tensorboard_available() else ("csv",)
    if isinstance(sinks, (str, bytes)):
        raise TypeError(f"sinks must be a sequence such as ('csv', 'tensorboard'), not the string {sinks!r}")
    made: List[Sink] = []
    try:
        for spec in sinks:
            if spec == "csv":
                made.append(CsvSink(logdir))
            elif spec == "tensorboard":
                made.append(TensorBoardSink(logdir))
            elif spec == "wandb":
                made.append(WandbSink(logdir, wandb_options))
            elif isinstance(spec, str):
                raise ValueError(f"sinks: unknown sink {spec!r}; use 'csv', 'tensorboard', 'wandb' or an object "
                                 f"with write/flush/close")
            elif all(callable(getattr(spec, m, None)) for m in ("write", "flush", "close")):
                made.append(spec)
            else:
                raise TypeError(f"sinks: {spec!r} is neither a sink name nor an object with write/flush/close")
    except BaseException:
        for sink in made:
            sink.close()
        raise
    return made


class _Pending:
    """The points waiting for the writer thread: batches (one per call) and their count.

    The count, not the queue, enforces the bound, so that a call costs one queue put
    whatever its number of points.
    """

    def __init__(self, max_points: int) -> None:
        self.queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.max_points = max_points
        self.lock = threading.Lock()
        self.points = 0  # queued and not yet taken by the writer
        self.dropped = 0

    def put(self, batch: List[Point]) -> None:
        with self.lock:
            if self.points + len(batch) > self.max_points:
                self.dropped += len(batch)
                return
            self.points += len(batch)
        self.queue.put(batch)

    def taken(self, count: int) -> None:
        with self.lock:
            self.points -= count


def _run(pending: _Pending, sinks: List[Sink], flush_every: float, errors: List[int]) -> None:
    """The writer thread: batches what is queued, writes it, flushes on schedule."""
    next_flush = time.monotonic() + flush_every
    while True:
        try:
            item = pending.queue.get(timeout=max(0.0, next_flush - time.monotonic()))
        except queue.Empty:
            item = None
        batch: List[Point] = []
        markers: List[threading.Event] = []
        stop = False
        while item is not None:
            if item is _STOP:
                stop = True
            elif isinstance(item, threading.Event):
                markers.append(item)
            else:
                batch += item
            try:
                item = pending.queue.get_nowait()
            except queue.Empty:
                item = None
        pending.taken(len(batch))
        flush = stop or bool(markers) or time.monotonic() >= next_flush
        for sink in sinks:
            try:
                if batch:
                    sink.write(batch)
                if flush:
                    sink.flush()
                if stop:
                    sink.close()
            except Exception:  # one broken sink must not silence the others
                errors[0] += 1
                if errors[0] == 1:
                    log.exception("machinlike.metrics: sink %r failed (further failures are only counted)", sink)
        if flush:
            next_flush = time.monotonic() + flush_every
        for marker in markers:
            marker.set()
        if stop:
            return


def _finish(pending: _Pending, thread: threading.Thread, timeout: float) -> None:
    pending.queue.put(_STOP)
    thread.join(timeout)


def _check_step(step: Any, where: str) -> None:
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, not {step!r}{where}")
    if not _STEPS[0] <= step <= _STEPS[1]:
        raise ValueError(f"step={step} does not fit in 64 bits, which TensorBoard keeps it in{where}: count in "
                         f"smaller units (e.g. thousands of steps)")


def _number(tag: str, value: Any) -> float:
    """``value`` as a float, checked (the writer thread must never meet a bad one)."""
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"the value of {tag!r} must be a real number, not {value!r}")
    try:
        return float(value)
    except OverflowError:
        raise ValueError(f"the value of {tag!r} is too large for a float: {str(value)[:40]}...") from None


class Metrics:
    """Scalars of a run, written to TensorBoard, CSV and (on request) W&B from a background thread.

    Logging never blocks the caller: a point is queued (a tuple append); when
    ``max_pending`` points are already waiting it is dropped and counted in
    :attr:`dropped`. Tags follow TensorBoard's habit ``"<panel>/<name>"``
    (``"loss/policy"``, ``"env/steps_per_s"``): the part before the first ``/`` groups
    the charts.

    Example::

        with Metrics("runs/impala") as metrics:
            for step in range(steps):
                ...
                metrics.scalars({"loss/policy": p, "loss/value": v}, step)

    Args:
        logdir: Folder of the run (created); TensorBoard's ``--logdir`` takes it or a parent.
        sinks: Sink names (``"csv"``: ``<logdir>/metrics.csv``; ``"tensorboard"``;
            ``"wandb"``) or objects with ``write(points)``, ``flush()`` and ``close()``.
            None: ``"csv"``, plus ``"tensorboard"`` when the tensorboard package is installed.
        max_pending: Points that may wait for the writer thread before new ones are dropped.
        flush_every: Seconds between flushes of every sink (what a reader sees lags by at
            most this).
        wandb_options: Keyword arguments for ``wandb.init`` (with ``"wandb"`` in sinks).

    Raises:
        ImportError: a named sink's package is missing (``tensorboard``, ``wandb``).
        ValueError: an unknown sink name, ``max_pending`` < 1 or ``flush_every`` <= 0.
        TypeError: ``sinks`` is a string, or holds something that is not a sink.
    """

    def __init__(self, logdir: str, sinks: Optional[Sequence[SinkSpec]] = None, max_pending: int = 100_000,
                 flush_every: float = 2.0, wandb_options: Optional[Mapping[str, Any]] = None) -> None:
        if not isinstance(logdir, (str, os.PathLike)):
            raise TypeError(f"logdir must be a folder path, not {logdir!r}")
        if isinstance(max_pending, bool) or not isinstance(max_pending, int) or max_pending < 1:
            raise ValueError(f"max_pending must be an int >= 1, got {max_pending!r}")
        if not isinstance(flush_every, Real) or not flush_every > 0:
            raise ValueError(f"flush_every must be a number of seconds > 0, got {flush_every!r}")
        self.logdir: str = os.fspath(logdir)
        os.makedirs(self.logdir, exist_ok=True)
        self._sinks: List[Any] = _open_sinks(self.logdir, sinks, wandb_options)
        self._pending: _Pending = _Pending(max_pending)
        self._errors: List[int] = [0]  # the writer thread's count of sink failures
        self._lock: threading.Lock = threading.Lock()
        self._closed: bool = False
        self._thread: threading.Thread = threading.Thread(target=_run, args=(self._pending, self._sinks, float(flush_every),
                                                           self._errors),
                                        name=f"machinlike-metrics {self.logdir}", daemon=True)
        self._thread.start()
        # (run when the object is collected, and at the end of the process: main or child)
        self._finalizer: _mp_util.Finalize = _mp_util.Finalize(self, _finish, args=(self._pending, self._thread, 5.0),
                                            exitpriority=_EXIT_PRIORITY)
        self._pid: int = os.getpid()

    # --------------------------------------------------------------------- logging
    def scalar(self, tag: str, value: float, step: int, wall_time: Optional[float] = None) -> None:
        """Queue one point; returns at once.

        Args:
            tag: ``"<panel>/<name>"``.
            value: A number (a NaN is kept: TensorBoard shows the gap).
            step: The x of the point: env steps, updates, ... (an int; keep one meaning per tag).
            wall_time: Seconds since the epoch; None: now.

        Raises:
            TypeError: ``tag`` is not a non-empty string, ``value`` not a real number or
                ``step`` not an int.
            ValueError: ``step`` outside 64 bits, ``value`` too large for a float.
            RuntimeError: after :meth:`close`; in a forked copy of the object (make one
                per process).
        """
        if not isinstance(tag, str) or not tag:
            raise TypeError(f"tag must be a non-empty string such as 'loss/policy', not {tag!r}")
        _check_step(step, f" (for {tag!r})")
        self._put([(tag, _number(tag, value), step, time.time() if wall_time is None else float(wall_time))])

    def scalars(self, values: Mapping[str, float], step: int, wall_time: Optional[float] = None) -> None:
        """Queue several points of the same step (see :meth:`scalar`); None values are skipped.

        Raises:
            TypeError, ValueError: as :meth:`scalar`, for the first bad entry (nothing of the
                call is queued).
            RuntimeError: as :meth:`scalar`.
        """
        _check_step(step, "")
        wall = time.time() if wall_time is None else float(wall_time)
        points: List[Point] = []
        for tag, value in values.items():
            if value is None:
                continue
            if not isinstance(tag, str) or not tag:
                raise TypeError(f"tags must be non-empty strings such as 'loss/policy', not {tag!r}")
            points.append((tag, _number(tag, value), step, wall))
        if points:
            self._put(points)

    def _put(self, points: List[Point]) -> None:
        if self._closed:
            raise RuntimeError(f"Metrics({self.logdir!r}) is closed")
        self._refuse_a_forked_copy()
        self._pending.put(points)

    def _refuse_a_forked_copy(self) -> None:
        # A forked child inherits the object, not its writer thread: its points were queued
        # where nothing would ever write them (cold trial 30).
        if os.getpid() != self._pid:
            raise RuntimeError(f"Metrics({self.logdir!r}) was made in process {self._pid} and this is a forked "
                               f"copy of it, without its writer thread: make a Metrics in this process (a logdir "
                               f"of its own, e.g. per rank)")

    # ------------------------------------------------------------------ state
    @property
    def dropped(self) -> int:
        """Points dropped because ``max_pending`` were already waiting (a call's points are
        kept or dropped together)."""
        with self._pending.lock:
            return self._pending.dropped

    @property
    def sink_errors(self) -> int:
        """Sink calls that raised (the first is logged with its traceback)."""
        return self._errors[0]

    @property
    def pending(self) -> int:
        """Points queued and not yet handed to the sinks."""
        with self._pending.lock:
            return self._pending.points

    # -------------------------------------------------------------- flush, close
    def flush(self, timeout: float = 10.0) -> bool:
        """Write everything queued before this call and flush every sink.

        Args:
            timeout: Seconds to wait for the writer thread.

        Returns:
            True when done; False when ``timeout`` ran out first (the writer is slow or stuck).

        Raises:
            RuntimeError: after :meth:`close`.
        """
        if self._closed:
            raise RuntimeError(f"Metrics({self.logdir!r}) is closed")
        self._refuse_a_forked_copy()
        done = threading.Event()
        self._pending.queue.put(done)  # markers are not points: never dropped
        return done.wait(timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued, flush and close every sink, stop the thread; idempotent.

        Args:
            timeout: Seconds to wait for the writer (one shared deadline); a writer stuck
                past it is left behind (a daemon thread) and a warning is logged.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer.cancel()
        if os.getpid() != self._pid:
            return  # a forked copy: the thread and the sinks are its parent's
        _finish(self._pending, self._thread, timeout)
        if self._thread.is_alive():
            log.warning("machinlike.metrics: the writer of %r did not finish within %g s", self.logdir, timeout)

    def __enter__(self) -> "Metrics":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __reduce__(self) -> Any:
        raise TypeError("a Metrics writer cannot be pickled or sent to another process: it owns open files and a "
                        "thread; create one per process (each with its own logdir)")

    def __repr__(self) -> str:
        return f"Metrics({self.logdir!r}, sinks={[type(s).__name__ for s in self._sinks]}, dropped={self.dropped})"

