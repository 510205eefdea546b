"""Same-host tensor transport: recycled shared-memory segments and by-reference sharing.

Private; used by ``machinlike.distributed`` (RPC), the servers and the pools. The public
face is :func:`machinlike.distributed.share` and the World's ``same_host_shm`` knobs.
"""

from ._codec import (
    encode, encode_parts, encode_array, encode_tensor, is_shared_by_reference, reduce_array, reduce_by_reference, reduce_copy,
    share, share_and_reduce, shm_eligible, pack_items,
)
from ._walk import Leaf, walk
from . import _recycled as recycled, _segments
from ._pack import PACK_MIN, Pack
from ._segments import ABANDON_AFTER_S, cache, lending_give_up, lending_until, reachable
from ._unsent import guard
from ._terms import TERMS_MASK, due_of, overdue, split_terms, terms

__all__ = ["Leaf", "Pack", "PACK_MIN", "walk", "pack_items", "encode", "encode_parts", "guard", "encode_array", "encode_tensor", "share", "share_and_reduce", "shm_eligible",
           "reduce_copy", "reduce_array", "reduce_by_reference",
           "is_shared_by_reference", "cache", "reachable", "await_taken", "recycled", "TERMS_MASK", "terms",
           "split_terms", "overdue", "due_of", "lending_until", "lending_give_up",
           "ABANDON_AFTER_S", "give_up_time"]


def await_taken(timeout: float) -> bool:
    """Before this process exits: wait (at most ``timeout`` s) until its lent segments
    were taken by their receivers (see ``SegmentCache.wait_taken``); True at once when it
    lent none."""
    made = _segments._cache
    return True if made is None else made.wait_taken(timeout)


def give_up_time(reply: int) -> float:
    """When what a reply to terms ``reply`` lends is abandoned if still untaken
    (``time.monotonic()`` s: the caller's deadline plus ``ABANDON_AFTER_S``); 0: never (the
    caller sent no deadline)."""
    due = due_of(reply)
    return due + _segments.ABANDON_AFTER_S if due else 0.0
