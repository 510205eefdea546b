"""A call's reply terms: one int that tells a callee on this host how to send its result back.

    bits 0..47     shared-memory threshold, bytes (0: the caller is elsewhere: plain pickling)
    bits 48..111   the caller's identity word (``machinlike._pids``: its pid and start time)
    bits 112..151  the caller's device key (``distributed._calls.cuda_ipc``, 40 bits; 0: CUDA
                   tensors are staged)
    bits 152..     the caller's deadline, ``time.monotonic()`` in whole ms (0: none known)

Why the caller's identity travels: what a callee lends for its reply (shared-memory
segments) comes back once the caller died without taking it (``_segments``). Before, a
caller SIGKILLed while its call ran left the reply's segments lent until the callee's
World stopped: a learner whose actors die now and then filled ``shm_cache_bytes`` and
from then on sent every large tensor the slow way.

Why the deadline travels: torch RPC drops a reply that comes after its call timed out
without unpickling it, so nothing lent for that reply is ever taken while the caller
lives. A callee whose result is ready only after the caller's deadline (less
``OVERDUE_MARGIN_S``, the time a reply may take to arrive) sends it plainly, lending
nothing (:func:`overdue`); what one made just before it lends is abandoned a while after it
when still untaken (``_segments.ABANDON_AFTER_S``, :func:`due_of`). The clock is ``CLOCK_MONOTONIC``, one per host: a peer on
this host reads the same one (a peer in another time namespace would see every reply
overdue or none: slower or as before, never wrong).
"""

from __future__ import annotations

import time
from typing import Optional, Tuple

from .._pids import own_identity

__all__ = ["TERMS_MASK", "OVERDUE_MARGIN_S", "terms", "split_terms", "overdue", "due_of"]

TERMS_MASK = (1 << 48) - 1  # the threshold's bits
_WHO_SHIFT = 48
_WHO_MASK = (1 << 64) - 1
_KEY_SHIFT = 112
_KEY_MASK = (1 << 40) - 1
_DUE_SHIFT = 152
_FAR = float(1 << 40) / 1000  # s: a deadline past it (an unbounded wait, inf, nan) is sent as none
#: Seconds before the caller's deadline from which a reply is sent plainly: a reply made
#: later could arrive after the caller's RPC gave up on it, and then it is never read.
OVERDUE_MARGIN_S = 0.01


def terms(threshold: int, key: int = 0, due: Optional[float] = None) -> int:
    """The reply terms of a call from this process: ``threshold`` (bytes; 0 and no ``key``:
    none, the int 0) with this process's identity, device ``key`` (0: none) and deadline
    ``due`` (``time.monotonic()`` seconds; None: none known)."""
    if not threshold and not key:
        return 0
    out = (threshold & TERMS_MASK) | (own_identity() << _WHO_SHIFT) | ((key & _KEY_MASK) << _KEY_SHIFT)
    if due is not None and 0 < due < _FAR:
        out |= max(1, int(due * 1000)) << _DUE_SHIFT
    return out


def split_terms(reply: int) -> Tuple[int, int, int]:
    """``(threshold, caller identity word, caller device key)``; 0 for what is absent."""
    return reply & TERMS_MASK, (reply >> _WHO_SHIFT) & _WHO_MASK, (reply >> _KEY_SHIFT) & _KEY_MASK


def overdue(reply: int) -> bool:
    """Whether the caller that sent terms ``reply`` will have stopped waiting (its deadline,
    less ``OVERDUE_MARGIN_S``, has passed): its reply should lend nothing."""
    due = reply >> _DUE_SHIFT
    return bool(due) and time.monotonic() * 1000 >= due - OVERDUE_MARGIN_S * 1000


def due_of(reply: int) -> float:
    """The caller's deadline that terms ``reply`` carry (``time.monotonic()`` s); 0: none known."""
    return (reply >> _DUE_SHIFT) / 1000
