"""LogTail: the event log's entries as they come, for a reader outside the world.

    new()  m/evn: how many positions are claimed; m/e/<next> .. while written
           a position deleted under it (it fell more than KEEP ranges behind): on from
           the newest range's start, m/logk x SEGMENT
           a position claimed, not written yet: stop there, read it next time

Why apart from ``EventLog``: that one is a member's (it fills holes, seals ranges, shares a
cache with the process's other members); ``launch`` watches for losses from the process
that hosts the store, reads only, and must never write to a world it is not in.
"""

from __future__ import annotations

from typing import Callable, List, Optional

from .._store import Keys, LogEntry
from . import log_state

__all__ = ["LogTail"]


class LogTail:
    """Reads the log of the world ``keys`` names from its first position on.

    Args:
        get: Reads a key of the world's store without waiting: its value, or "" or None
            when absent.
        keys: The world's keys.
    """

    def __init__(self, get: Callable[[str], Optional[str]], keys: Keys) -> None:
        self._get = get
        self._keys = keys
        self._next = 0  # the next position to read

    def new(self) -> List[LogEntry]:
        """The entries written since the last call, in log order (skipped positions left out).

        Raises:
            Exception: what ``get`` raised (the position read so far is kept).
        """
        get, keys = self._get, self._keys
        total = int(get(keys.log_count()) or 0)
        out: List[LogEntry] = []
        while self._next < total:
            value = get(keys.log_entry(self._next))
            if not value:
                start = int(get(keys.log_head()) or 0) * log_state.SEGMENT
                if self._next < start:  # deleted: this fell behind
                    self._next = start
                    continue
                break  # claimed, not written yet
            self._next += 1
            entry = log_state.entry_of(value)
            if entry is not None:
                out.append(entry)
        return out
