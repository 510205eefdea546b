"""Company: which callers a batch still waits for, so that it need not wait out ``max_wait``.

Why: a batch waited ``max_wait`` after its oldest request for more to come, even when
every caller that could come had come: a lone actor paid 2.8 ms a call at the default
2 ms against 0.3 ms without the wait (cold trial 11), and actors that send together paid
the rest of the wait after the last of them. Callers of an inference server come back:
each sends about as many requests to the next batch as to its last one. So a batch also
ends once every caller seen in the last ``ACTIVE`` seconds has sent that many again::

    batch taken ──► batched(batch): caller (name, incarnation) ──► (when, signature, requests)
    next batch opens on its oldest request's signature
        open(sig, queue): owed = requests each recent caller of sig sent to its last
                          batch, less those it has queued now; missing = their sum
    a request arrives ──► arrived(req): one owed by its caller? missing - 1
    the batcher's wait ends at max_batch rows, at max_wait, or at missing == 0

It only ever ends a wait early: a caller that stops coming (it died, finished, or now
sends fewer) is owed until it ages out, and the wait is ``max_wait`` as before; so is
a batch that nobody recent owes anything (the first ones, or after a pause: nothing is
known of who will come). A caller seen for the first time is owed nothing. Bounded:
entries older than ``ACTIVE`` go at each ``open``, and at most ``MOST`` callers are kept.
"""

from __future__ import annotations

from typing import Dict, Hashable, Iterable, List, Tuple

from .request import Request

__all__ = ["Company", "ACTIVE", "MOST"]

ACTIVE = 1.0  # seconds after its last batch that a caller is still waited for
MOST = 4096  # callers remembered at most (the oldest go first)

_Caller = Tuple[str, int]


class Company:
    """The callers one batcher has lately served; used under the batcher's lock."""

    def __init__(self) -> None:
        self._last: Dict[_Caller, Tuple[float, Hashable, int]] = {}  # oldest first
        self._owed: Dict[_Caller, int] = {}
        self._sig: Hashable = None
        self._known = False  # whether a recent caller of the open batch's signature owed any
        self.missing = 0

    def batched(self, batch: List[Request], now: float) -> None:
        """``batch`` was taken at ``now`` (``time.monotonic()``)."""
        counts: Dict[_Caller, int] = {}
        for req in batch:
            key = (req.caller, req.incarnation)
            counts[key] = counts.get(key, 0) + 1
        sig = batch[0].sig if batch else None
        for key, count in counts.items():
            self._last.pop(key, None)  # (re-inserted: newest last)
            self._last[key] = (now, sig, count)
        while len(self._last) > MOST:
            del self._last[next(iter(self._last))]

    def open(self, sig: Hashable, queued: Iterable[Request], now: float) -> None:
        """A batch of ``sig`` opens with ``queued`` waiting: count what is owed to it."""
        stale = [key for key, (when, _, _) in self._last.items() if now - when > ACTIVE]
        for key in stale:
            del self._last[key]
        owed = {key: count for key, (_, last_sig, count) in self._last.items() if last_sig == sig}
        for req in queued:
            key = (req.caller, req.incarnation)
            if req.sig == sig and owed.get(key, 0) > 0:
                owed[key] -= 1
        self._owed, self._sig, self._known = owed, sig, bool(owed)
        self.missing = sum(owed.values())

    def complete(self) -> bool:
        """Whether every recent caller owed to the open batch has sent (False when none was
        known: the batch waits as it would without this)."""
        return self._known and self.missing <= 0

    def arrived(self, req: Request) -> None:
        """``req`` was queued: one less to wait for if its caller owed one."""
        key = (req.caller, req.incarnation)
        if req.sig == self._sig and self._owed.get(key, 0) > 0:
            self._owed[key] -= 1
            self.missing -= 1

    def close(self) -> None:
        """The batch was taken: nothing is owed until the next opens."""
        self._owed, self._sig, self._known, self.missing = {}, None, False, 0
