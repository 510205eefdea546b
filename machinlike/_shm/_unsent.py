"""Segments lent for a message that was never pickled whole come back to their owner.

Why: ``encode`` copies a message's tensors into lent segments *before* the carrier
pickles the message. When pickling then fails (a lock or a generator beside the tensors,
in a call's arguments or in a service's result), nobody will ever take those segments,
and each such failure kept one lent until the World stopped (a service that now and then
returned something unpicklable slowly filled ``shm_cache_bytes``, and from then on every
large tensor fell back to the slow path). The carrier (torch RPC's pickler, the lane's,
on either side) is not ours to ask, so each part of the message carries a mark that is
pickled after it::

    guard((args, kwargs), lent) ─► (_Guarded(args), _Guarded(kwargs)) sharing one record
    pickling _Guarded(part) ─► (_first, (part, _Mark(index)))    part first, then its mark:
                                                                 index seen
    unpickling ─► part itself (the receiver sees no wrapper)
    the record dies (the carrier dropped the message):
        every index seen ─► sent: the receiver frees the segments as it drops them; the
                            cache notes which process that is, so that they come back
                            should it die before taking them (``SegmentCache.address``)
        else             ─► the segments are released (nobody can have taken them)

A message pickled whole but never taken (a reply after its call timed out) is another
matter, see ``_segments``; this module is only about messages that never left. What else
a message holds lent for its receiver (the CUDA IPC slabs of ``_calls.cuda_ipc``) comes
back the same way, through the callables ``guard`` is handed (``also``).
"""

from __future__ import annotations

import weakref
from typing import Any, Callable, List, Sequence, Set, Tuple

from ._segments import Segment, cache

__all__ = ["guard"]


def _first(value: Any, _mark: None) -> Any:
    return value


def _nothing() -> None:
    return None


class _Mark:
    """Pickled right after its part: records that the part pickled."""

    __slots__ = ("seen", "index")

    def __init__(self, seen: Set[int], index: int) -> None:
        self.seen = seen
        self.index = index

    def __reduce__(self) -> Tuple[Any, ...]:
        self.seen.add(self.index)
        return (_nothing, ())


class _Record:
    """Lives as long as the message's parts do; its finalizer settles the lease."""

    __slots__ = ("__weakref__",)


class _Guarded:
    """One part of a message; unpickles as the part itself."""

    __slots__ = ("value", "record", "seen", "index")

    def __init__(self, value: Any, record: _Record, seen: Set[int], index: int) -> None:
        self.value = value
        self.record = record
        self.seen = seen
        self.index = index

    def __reduce__(self) -> Tuple[Any, ...]:
        return (_first, (self.value, _Mark(self.seen, self.index)))


def _settle(lent: List[Tuple[Segment, int]], also: Sequence[Callable[[], None]], seen: Set[int],
            parts: int, receiver: int) -> None:
    if len(seen) == parts:
        if receiver and lent:
            segments = cache()
            for seg, lease in lent:
                segments.address(seg, lease, receiver)
        return
    if lent:
        segments = cache()
        for seg, lease in lent:
            segments.release(seg, lease)
    for release in also:
        release()


def guard(parts: Sequence[Any], lent: List[Segment], also: Sequence[Callable[[], None]] = (),
          receiver: int = 0) -> Tuple[Any, ...]:
    """``parts`` (one message's, pickled in this order by one carrier) wrapped so that the
    segments ``lent`` for them are released, and each of ``also`` called (what else was
    lent for them; each must end only its own lease), unless every part was pickled by
    the time the carrier drops them; ``parts`` as a tuple, unchanged, when nothing was lent.
    ``receiver``: the identity word (``machinlike._pids``) of the process the message goes
    to, whose death before it took them gives the segments back (0: unknown, they stay)."""
    if not lent and not also:
        return parts if type(parts) is tuple else tuple(parts)
    record = _Record()
    seen: Set[int] = set()
    leases = [(seg, seg.lease) for seg in lent]  # (a segment may be freed and lent again meanwhile)
    finalizer = weakref.finalize(record, _settle, leases, tuple(also), seen, len(parts), receiver)
    finalizer.atexit = False  # (at exit the cache itself is closed)
    return tuple(_Guarded(part, record, seen, index) for index, part in enumerate(parts))
