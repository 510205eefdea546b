"""EventLog: the world's membership events, posted to and read from the store in one order.

Owns how far this process has read the log (``_seen`` entries, the counter ``_counted``
at the last read) and delivers every new entry once, in log order, to the callable it
was built with (``Membership._deliver``).

    post(kind, rec)   append "kind|member|record" to m/log (one atomic append), then
                      bump the counter m/evn
    catch_up()        counter moved? read m/log, deliver entries [seen, end)

Why append then count: a poster SIGKILLed mid-post leaves the event whole or absent, never
a numbered hole every reader would wait on; the counter only says the log grew (a reader
lagging behind is caught up by the next).
"""

from __future__ import annotations

import threading
from typing import Callable

from ._keys import Keys, LogEntry, MemberRecord
from ._registry import Registry

__all__ = ["EventLog"]


class EventLog:
    """The world's event log, as this process reads it.

    Args:
        registry: The world's store tables.
        keys: The world's keys.
        deliver: Called with each new entry and its position in the log, in order.
    """

    def __init__(self, registry: Registry, keys: Keys, deliver: Callable[[LogEntry, int], None]) -> None:
        self._registry = registry
        self._keys = keys
        self._deliver = deliver
        # Held while reading and delivering: entries are delivered once, in order.
        self._lock = threading.Lock()
        self._seen = 0
        self._counted = 0

    def post(self, kind: str, rec: MemberRecord) -> None:
        """Append an event for everyone (this process sees it at its next catch-up)."""
        self._registry.append(self._keys.log(), LogEntry(kind, rec).encode())
        self._registry.add(self._keys.log_count(), 1)

    def catch_up(self) -> None:
        """Deliver every entry posted since the last call, in log order."""
        with self._lock:
            total = self._registry.add(self._keys.log_count(), 0)
            if total <= self._counted:
                return
            entries = LogEntry.decode_log(self._registry.get_or_empty(self._keys.log()))
            for seq in range(self._seen, len(entries)):
                self._deliver(entries[seq], seq)
            self._seen = len(entries)
            self._counted = total
