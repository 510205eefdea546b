"""A process pool worker: read task frames, run them, write result frames.

One worker, two private pipes (see ``_wire``), and the claim/take-back ledger it shares
with the pool (``_ledger``: the worker claims each task frame there before it runs it, and
notes its phase, so the pool knows what a dead worker had started and what it was doing).

``sys.exit`` in a task ends the worker (after an ``EXITING`` frame naming the code); any
other exception fails only its task. SIGINT is ignored: Ctrl-C is the parent's to handle
(it terminates the pool). A worker ends with its parent (lifeline).
"""

from __future__ import annotations

import functools
import itertools
import os
import signal
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import _lifeline, _shm
from ..exception import ExceptionWithTraceback
from ..pickle import dumps as _plain_dumps, dumps_to_cpu as _report_dumps
from ._ledger import IDLE, LOADING, PHASES, PICKLING, RUNNING, Ledger
from ._policy import Codec
from ._wire import (
    DONE,
    DROP,
    EXITING,
    FAILED,
    INIT_FAILED,
    INSTALL,
    PARTIAL,
    READY,
    STOP,
    TASK_CALL,
    TASK_MAP,
    FrameReader,
    write_frame,
)

__all__ = ["main", "run_chunk"]

#: Seconds a stopping worker waits for the pool to open its last results' segments.
_TAKEN_WAIT = 10.0


def run_chunk(call: Callable[..., Any], items: List[Any], star: bool) -> Tuple[List[Any], Optional[Dict[int, BaseException]]]:
    """Apply ``call`` to each item; the loop runs in C until an item raises.

    Returns:
        The results (None where an item raised) and {offset: exception}, or None when
        every item succeeded.

    Raises:
        SystemExit: an item called ``sys.exit`` (the rest of the chunk is not run).
    """
    values: List[Any] = []
    errors: Optional[Dict[int, BaseException]] = None
    rest: Any = items
    while True:
        try:
            # list.extend keeps what the iterator produced before it raised
            values.extend(itertools.starmap(call, rest) if star else map(call, rest))
            return values, errors
        except SystemExit:
            raise
        except BaseException as exc:
            offset = len(values)
            if errors is None:
                errors = {}
            errors[offset] = exc
            values.append(None)
            if offset + 1 >= len(items):
                return values, errors
            rest = itertools.islice(items, offset + 1, None)


class _Exit(Exception):
    """Unwinds the worker after a task called sys.exit."""

    def __init__(self, code: Any) -> None:
        super().__init__(code)
        self.code = code


class _Worker:
    def __init__(
        self, task_fd: int, result_fd: int, ledger: Ledger, codec: Codec, slot: int,
        context: Any, has_context: bool,
    ) -> None:
        self._reader = FrameReader(task_fd)
        self._out = result_fd
        self._ledger = ledger
        self._codec = codec
        self._where = f"pool worker {slot}"
        self._context = context
        self._has_context = has_context
        self._functions: Dict[int, list] = {}
        self.last_run = -1  # sequence number of the last task run (its outcome was written)

    def serve(self) -> None:
        claim = self._ledger.claim
        functions = self._functions
        next_frame = self._reader.next_frame
        while True:
            frame = next_frame()
            if frame is None:
                return  # the pool closed the channel
            kind, flag, seq, extra, payload = frame
            if kind == TASK_CALL or kind == TASK_MAP:
                if claim(seq):
                    self.last_run = seq
                    self._run(kind, flag, seq, extra, payload)
            elif kind == INSTALL:
                functions[extra] = [payload, None]
            elif kind == DROP:
                functions.pop(extra, None)
            elif kind == STOP:
                return

    def _function(self, function_id: int) -> Callable[..., Any]:
        entry = self._functions[function_id]
        if entry[1] is None:
            entry[1] = self._codec.loads(entry[0])
            entry[0] = None
        return entry[1]

    def _run(self, kind: int, star: int, seq: int, function_id: int, payload: bytes) -> None:
        phase = self._ledger.set_phase
        codec = self._codec
        phase(LOADING)
        try:
            if kind == TASK_CALL:
                func, args, kwds = codec.loads(payload)
            else:
                func = self._function(function_id)
                items = codec.loads(payload)
            del payload
        except BaseException as exc:
            return self._fail(seq, exc, "while loading the task in the worker")
        phase(RUNNING)
        if kind == TASK_CALL:
            try:
                if self._has_context:
                    value = func(self._context, *args, **(kwds or {}))
                else:
                    value = func(*args, **(kwds or {}))
            except BaseException as exc:
                return self._fail(seq, exc, None)
            phase(PICKLING)
            try:
                data = codec.dumps(value)
            except BaseException as exc:
                return self._fail(seq, exc, "while pickling the result in the worker")
            write_frame(self._out, DONE, 0, seq, 0, data)
            # Dropped only once the result is on its way: releasing a large shared
            # argument unmaps it (~15 ms for 256 MB), which the caller need not wait for.
            del func, args, kwds, value
        else:
            call = functools.partial(func, self._context) if self._has_context else func
            try:
                values, errors = run_chunk(call, items, bool(star))
            except SystemExit as exc:
                return self._fail(seq, exc, None)
            phase(PICKLING)
            if errors is None:
                try:
                    data = codec.dumps(values)
                except SystemExit as exc:
                    return self._fail(seq, exc, None)
                except BaseException:
                    data = None  # find the culprit item by item below
                if data is not None:
                    write_frame(self._out, DONE, 0, seq, 0, data)
                    del call, func, items  # after the send, as above
                    phase(IDLE)
                    return
                errors = {}
            self._send_partial(seq, values, errors)
            del call, func, items
        phase(IDLE)

    def _send_partial(self, seq: int, values: List[Any], errors: Dict[int, BaseException]) -> None:
        # Each value is pickled once, on its own, so that one unpicklable result fails
        # only its own position.
        codec = self._codec
        pickled: List[Optional[bytes]] = []
        carried: Dict[int, ExceptionWithTraceback] = {}
        for offset, value in enumerate(values):
            error = errors.get(offset)
            if error is None:
                try:
                    pickled.append(codec.dumps(value))
                    continue
                except SystemExit as exc:
                    self._fail(seq, exc, None)
                except BaseException as exc:
                    _note(exc, "while pickling the result in the worker")
                    error = exc
            pickled.append(None)
            carried[offset] = ExceptionWithTraceback(error, where=self._where)  # type: ignore[arg-type]  # set above
        del values, errors
        # (Error reports are read on the CPU: CUDA tensors they hold arrive as CPU copies.)
        write_frame(self._out, PARTIAL, 0, seq, 0, _report_dumps((pickled, carried)))

    def _fail(self, seq: int, exc: BaseException, note: Optional[str]) -> None:
        if isinstance(exc, SystemExit):
            carried = ExceptionWithTraceback(exc, where=self._where)
            code = exc.code
            exitcode = code if isinstance(code, int) else (0 if code is None else 1)
            phase = PHASES.get(self._ledger.phase(), "")
            write_frame(self._out, EXITING, 0, seq, 0, _plain_dumps((repr(code), exitcode, carried.tb_text, phase)))
            raise _Exit(code)
        if note is not None:
            _note(exc, note)
        write_frame(self._out, FAILED, 0, seq, 0, _dump_error(exc, self._where))
        self._ledger.set_phase(IDLE)


def _note(exc: BaseException, note: str) -> None:
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(note)


def _dump_error(exc: BaseException, where: str) -> bytes:
    """``exc``'s report; a CUDA tensor it holds arrives as a CPU copy (the parent may have
    no GPU, and reading it there would make a CUDA context)."""
    try:
        return _report_dumps(ExceptionWithTraceback(exc, where=where))
    except Exception as failure:  # ExceptionWithTraceback substitutes what it can't pickle
        return _report_dumps(ExceptionWithTraceback(RuntimeError(f"{type(exc).__name__}: {exc} ({failure})"), where))


def main(
    task_conn: Any, result_conn: Any, ledger: Ledger, codec: Codec, slot: int,
    init_payload: bytes, primer_payload: Optional[bytes],
) -> None:
    """The worker process's target (started by the pool; not for direct use)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _lifeline.watch_parent()
    task_fd, result_fd = task_conn.fileno(), result_conn.fileno()
    where = f"pool worker {slot}"
    try:
        # Loading the primer connects this worker to the pool's shared-memory manager.
        primer = None if primer_payload is None else codec.loads(primer_payload)
        initializer, initargs, context, has_context = codec.loads(init_payload)
        del init_payload
        if initializer is not None:
            initializer(*initargs)
    except BaseException as exc:
        _note(exc, f"while starting {where}")
        try:
            write_frame(result_fd, INIT_FAILED, 0, 0, 0, _dump_error(exc, where))
        except OSError:
            pass
        os._exit(1)
    worker = _Worker(task_fd, result_fd, ledger, codec, slot, context, has_context)
    try:
        write_frame(result_fd, READY, 0, 0, 0)
        worker.serve()
        # Told to stop (maxtasksperchild, or a closed pool done) right after its last
        # results: the pool may not have loaded them yet, and what they hold by reference
        # (shared tensors' descriptors, lent segments) closes with this process (the pool
        # then failed to load them).
        deadline = time.monotonic() + _TAKEN_WAIT
        ledger.await_delivered(worker.last_run, _TAKEN_WAIT)
        _shm.await_taken(max(0.0, deadline - time.monotonic()))
    except _Exit as done:
        raise SystemExit(done.code) from None
    except BrokenPipeError:
        pass  # the pool is gone; nobody is listening
    finally:
        del primer
