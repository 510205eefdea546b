"""LogCache: the event log's entries, read and decoded once for all the members of a process.

One per process and log (the store server, the world's namespace and the log's token);
the EventLog of every member that process holds reads through it::

    EventLog.catch_up (a member)            LogCache (shared)
      run(seq, total) ───────────────────►  the entries seq .. cached (up to the first
                                            one not cached, below total); [] if none
      not cached: read the store,
      put(seq, values) ──────────────────►  decode the values not cached yet, keep them
                                            (the newest CAP positions, no more)
      a new reader:
      snapshot(k) / keep_snapshot(k, s) ─►  range k's snapshot, decoded (the newest only)

Why: a position is written once and never changes (the post's compare_set, or a reader's
SKIP fill: the first writer wins), so what one member of a process read is what each
other member will read. Each read it again: with 1,024 simulated members in 8 processes,
joining meant a million decodes (10 us each) and two store requests per member per tick,
each request one more wait for the process's GIL (half the box's time went to the kernel,
in those waits). One member of a process, as in a deployment, pays one dictionary look-up
per entry.

Why the token: a store restarted at the same address (a test; a launcher that restarts
with the same restart id) begins a new log at position 0, and what is cached from the old
one must never be delivered from the new one. The first reader of a log sets ``m/id`` to
a random token (compare_set: the first writer wins); a new store has none.

Lifetime and bounds: the EventLogs reading through a cache hold it, and the table of caches
holds it weakly (the last member of a world in this process gone, its cache goes); a cache
holds at most CAP positions, newer than its newest minus CAP, and one snapshot.
"""

from __future__ import annotations

import os
import threading
import weakref
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

from .._store import LogEntry, Registry, Keys
from .log_state import SEGMENT, Numbered, entry_of

__all__ = ["LogCache", "CAP", "shared_cache"]

#: Positions a cache keeps (the newest); a reader further behind reads the store.
CAP = 4 * SEGMENT


class LogCache:
    """Decoded log positions (None: a skipped one) and the newest snapshot read.

    Args:
        cap: Positions kept (the newest).

    Attributes:
        reading: Held by the member reading the store into this cache; the others of the
            process wait their turn (bounded) and find what it read (see
            EventLog._read_shared).
    """

    def __init__(self, cap: int = CAP) -> None:
        self._cap = cap
        self.reading = threading.Lock()
        self._lock = threading.Lock()
        self._entries: Dict[int, Optional[LogEntry]] = {}
        self._low = 0  # every cached position is >= this
        self._high = 0  # every cached position is < this
        self._snapshot: Optional[Tuple[int, int, List[Numbered]]] = None  # (k, start, entries)

    def run(self, lo: int, hi: int) -> List[Optional[LogEntry]]:
        """The cached entries of positions ``lo`` .. ``hi - 1``, up to the first one not cached."""
        out: List[Optional[LogEntry]] = []
        with self._lock:
            entries = self._entries
            for seq in range(lo, min(hi, self._high)):
                if seq not in entries:
                    break
                out.append(entries[seq])
        return out

    def put(self, lo: int, values: Sequence[str]) -> List[Optional[LogEntry]]:
        """Keep positions ``lo`` .. (their written values, as read from the store); their
        entries (a cached one is reused: decoded once per process)."""
        out: List[Optional[LogEntry]] = []
        with self._lock:
            entries = self._entries
            for i, value in enumerate(values):
                seq = lo + i
                entry = entries[seq] if seq in entries else entry_of(value)
                out.append(entry)
                if seq >= self._high - self._cap:
                    entries[seq] = entry
            self._high = max(self._high, lo + len(values))
            floor = self._high - self._cap
            if floor > self._low:
                # (positions below the floor were never put after it rose: deleting the range
                # between the two floors leaves none behind)
                for seq in range(self._low, floor):
                    entries.pop(seq, None)
                self._low = floor
        return out

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def snapshot(self, k: int) -> Optional[Tuple[int, List[Numbered]]]:
        """Range ``k``'s snapshot as kept: (its start position, its entries in log order)."""
        with self._lock:
            kept = self._snapshot
        return (kept[1], kept[2]) if kept is not None and kept[0] == k else None

    def keep_snapshot(self, k: int, start: int, entries: List[Numbered]) -> None:
        """Keep range ``k``'s snapshot (it replaces an older one)."""
        with self._lock:
            if self._snapshot is None or self._snapshot[0] <= k:
                self._snapshot = (k, start, entries)


#: (store server, namespace, token) -> the cache of that log in this process; weak values:
#: a cache lives as long as an EventLog holds it.
_CACHES: "weakref.WeakValueDictionary[Tuple[Hashable, str, str], LogCache]" = weakref.WeakValueDictionary()
_CACHES_LOCK = threading.Lock()


def shared_cache(registry: Registry, keys: Keys, server: Hashable) -> LogCache:
    """This process's cache of the log of ``keys``'s world on store server ``server`` (one
    request: the log's token, set here if this is the log's first reader).

    Raises:
        PeerLostError: the store is gone.
    """
    token = registry.compare_set(keys.log_token(), "", os.urandom(8).hex())
    key = (server, keys.ns, token)
    with _CACHES_LOCK:
        cache = _CACHES.get(key)
        if cache is None:
            cache = _CACHES[key] = LogCache()
        return cache
