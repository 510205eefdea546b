"""A call's reply terms: one int that tells a callee on this host how to send its result back.

    bits 0..47    shared-memory threshold, bytes (0: the caller is elsewhere: plain pickling)
    bits 48..111  the caller's identity word (``machinlike._pids``: its pid and start time)
    bits 112..    the caller's device key (``distributed._calls.cuda_ipc``; 0: CUDA tensors
                  are staged)

Why the caller's identity travels: what a callee lends for its reply (shared-memory
segments) comes back once the caller died without taking it (``_segments``). Before, a
caller SIGKILLed while its call ran left the reply's segments lent until the callee's
World stopped: a learner whose actors die now and then filled ``shm_cache_bytes`` and
from then on sent every large tensor the slow way.
"""

from __future__ import annotations

from typing import Tuple

from .._pids import own_identity

__all__ = ["TERMS_MASK", "terms", "split_terms"]

TERMS_MASK = (1 << 48) - 1  # the threshold's bits
_WHO_SHIFT = 48
_WHO_MASK = (1 << 64) - 1
_KEY_SHIFT = 112


def terms(threshold: int, key: int = 0) -> int:
    """The reply terms of a call from this process: ``threshold`` (bytes; 0 and no ``key``:
    none, the int 0) with this process's identity and device ``key`` (0: none)."""
    if not threshold and not key:
        return 0
    return (threshold & TERMS_MASK) | (own_identity() << _WHO_SHIFT) | (key << _KEY_SHIFT)


def split_terms(reply: int) -> Tuple[int, int, int]:
    """``(threshold, caller identity word, caller device key)``; 0 for what is absent."""
    return reply & TERMS_MASK, (reply >> _WHO_SHIFT) & _WHO_MASK, reply >> _KEY_SHIFT
