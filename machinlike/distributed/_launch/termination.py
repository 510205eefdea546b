"""A launcher told to terminate (SIGTERM) hands the request to its ranks first.

Why: a scheduler ends a job by sending SIGTERM to the process it started, here the one
that called ``launch`` (SLURM's ``--signal`` before a preemption, ``kill``, a container
runtime's stop). With the default disposition that process died at once, and its ranks
followed through their lifelines (``os._exit``): a rank that had installed a SIGTERM
handler to save a checkpoint never ran it. As torchrun does, the signal now reaches the
ranks, and they get the stop grace to finish::

    SIGTERM ─► launcher (in launch): the handler raises _Terminated in the main thread
               launch's finally: SIGTERM to every live rank, up to ``grace`` s, SIGKILL
               then the launcher ends by the same signal (exit status 143, as before)
    a second SIGTERM meanwhile: the launcher ends at once (its ranks through their
               lifelines)

Only the default disposition is replaced, only in the main thread, and only while
``launch`` runs: a program that installed its own handler (or ignores the signal) keeps it.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from types import FrameType, TracebackType
from typing import Any, Dict, Iterator, List, Optional, Type

__all__ = ["Termination", "deferred"]

log = logging.getLogger(__name__)

_DEFERRED = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM wait until the block ends (a rank's start, a few milliseconds).

    Why: interrupted while it wrote a new rank's start-up data to the forkserver's child,
    the launcher left that child to print an ``UnpicklingError`` traceback under the
    example's "interrupted" line (and a rank started but not yet recorded would be missed
    by the cleanup). The signals' handlers are swapped for one that notes them, and a
    noted signal is raised again once the old handlers are back. (Not a blocked mask: a
    process-directed signal then reaches another thread, whose Python handler still
    interrupts the main thread.) A second signal meanwhile is delivered at once. Main thread
only; an ignored signal, or one whose handler is not Python's, is left alone.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: List[int] = []
    kept: Dict[signal.Signals, Any] = {}

    def note(signum: int, _frame: Any) -> None:
        if noted:  # a second one: no more waiting (a start that hangs stays interruptible)
            noted.clear()
            _restore(kept)
            signal.raise_signal(signum)
            return
        noted.append(signum)

    for sig in _DEFERRED:
        handler = signal.getsignal(sig)
        if handler is not signal.SIG_IGN and handler is not None:  # (None: not Python's: left alone)
            kept[sig] = signal.signal(sig, note)
    try:
        yield
    finally:
        _restore(kept)
        # SIGTERM first: its handler gives the ranks their grace (a Ctrl-C with it adds nothing)
        for signum in sorted(set(noted), key=lambda n: n != signal.SIGTERM):
            signal.raise_signal(signum)


def _restore(kept: Dict[signal.Signals, Any]) -> None:
    for sig, handler in kept.items():
        signal.signal(sig, handler)


class _Terminated(BaseException):
    """Raised in the launcher's main thread by SIGTERM; launch's cleanup runs, then the
    signal is delivered again (a BaseException: no ``except Exception`` swallows it)."""


class Termination:
    """Context of one ``launch``: turns SIGTERM into a graceful end of the ranks.

    Attributes:
        requested: Whether SIGTERM arrived while the context was entered.
    """

    def __init__(self) -> None:
        self.requested = False
        self._installed = False

    def __enter__(self) -> "Termination":
        if threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
            signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def _handle(self, signum: int, frame: Optional[FrameType]) -> None:
        if self.requested:  # a second one: no more grace
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.raise_signal(signal.SIGTERM)
        self.requested = True
        raise _Terminated()

    def __exit__(self, kind: Optional[Type[BaseException]], value: Optional[BaseException],
                 tb: Optional[TracebackType]) -> None:
        if not self._installed:
            return
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        self._installed = False
        if self.requested:
            # (a log ending mid-progress, with no word of why, read as a crash)
            log.warning("launch: ended by SIGTERM; its ranks were passed the signal and have stopped")
            signal.raise_signal(signal.SIGTERM)  # ends this process, as SIGTERM always did
