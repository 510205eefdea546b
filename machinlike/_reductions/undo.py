"""The undo ledger of one pickling: what a failed dump must give back (descriptors,
shared-memory references, claim files), per thread."""

from __future__ import annotations

import threading
from typing import Callable, List

__all__ = ["undo_mark", "undo_rollback", "undo_release", "note_undo"]


class _Ledger(threading.local):
    def __init__(self) -> None:
        self.entries: List[Callable[[], object]] = []
        self.depth = 0


_ledger = _Ledger()


def undo_mark() -> int:
    """Enter a pickling pass on this thread; returns the ledger position to roll back to."""
    ledger = _ledger
    ledger.depth += 1
    return len(ledger.entries)


def undo_rollback(mark: int) -> None:
    """Undo, newest first, what reducers did since ``mark``."""
    entries = _ledger.entries
    while len(entries) > mark:
        undo = entries.pop()
        try:
            undo()
        except Exception:  # best effort: the pickling error is what the caller reports
            pass


def undo_release() -> None:
    """Leave a pickling pass; the outermost one forgets what succeeded."""
    ledger = _ledger
    ledger.depth -= 1
    if ledger.depth == 0 and ledger.entries:
        ledger.entries.clear()


def note_undo(undo: Callable[[], object]) -> None:
    ledger = _ledger
    if ledger.depth:
        ledger.entries.append(undo)
