"""Shared storages their owner rewrites: a sequence number ahead of the data (a seqlock).

Why: making fresh shared memory for each new state of a model (a model server's push)
costs far more than the copy into it: for 4 MB, 1.5 ms to make it and 1.3 ms to fault
its pages in, against 0.1 ms to copy into pages touched before. An owner that reuses the
memory of a state it no longer holds must let a reader on this host know when that memory
was rewritten under it: such a reader maps the memory by reference and reads it only
after the reply that named it was sent, when the owner holds nothing of it any more::

    storage    [ seq: int64 | pad to 64 bytes | data ... ]
    owner      with rewrite(storage): seq += 1 (odd) ─► copy the new data ─► seq += 1
    sender     reduce_by_reference reads seq while the message holds the storage (so no
               rewrite runs) and sends it with the descriptor
    receiver   remembers the sent seq on the tensor; after reading its data,
               unchanged(tensor) ⇔ the seq in memory is still the sent one

Only on x86-64: there a core's ordinary stores reach every other core in the order they
were made, and a locked instruction (``_fence``) orders the non-temporal stores a large
copy may use too, so a reader that saw any byte of a rewrite also sees the odd seq.
Elsewhere the owner would need fences that Python cannot issue, and :func:`supported`
is False (the owner then makes fresh memory each time, as before).
"""

from __future__ import annotations

import contextlib
import os
import platform
import threading
from typing import Dict, Iterator, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef

__all__ = ["HEADER", "supported", "make", "forget", "rewrite", "sequence", "note", "sent_sequence", "unchanged",
           "use_count"]

HEADER = 64  # bytes ahead of the data: a multiple of every dtype's size, and a cache line
_FENCE = threading.Lock()
_ATTR = "_machinlike_seq"
# This process's recycled storages by data address, weakly: an owner that never said
# forget() must not leave its address to a later storage.
_marked: Dict[int, StorageWeakRef] = {}


def supported() -> bool:
    """Whether storages may be rewritten in place here (x86-64 only: see the module doc)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def make(nbytes: int) -> torch.UntypedStorage:
    """Fresh shared memory for ``nbytes`` of data after the header (at byte :data:`HEADER`).

    The owner must :func:`forget` it before it drops the storage.
    """
    # By descriptor whatever torch's sharing strategy: /proc-reachable (torch internal)
    storage = torch.UntypedStorage._new_using_fd_cpu(HEADER + nbytes)
    _header(storage).zero_()
    _marked[storage.data_ptr()] = StorageWeakRef(storage)
    if len(_marked) > 256:  # forget the storages that died
        for address in [a for a, ref in _marked.items() if ref.expired()]:
            _marked.pop(address, None)
    return storage


def forget(storage: torch.UntypedStorage) -> None:
    """No more rewrites of ``storage``: it travels as any shared storage from now on."""
    _marked.pop(storage.data_ptr(), None)


def _header(storage: torch.UntypedStorage) -> torch.Tensor:
    # torch's stubs lack the (UntypedStorage, offset, size) overload of set_
    return torch.empty(0, dtype=torch.int64).set_(storage, 0, (1,))  # type: ignore[call-overload]


@contextlib.contextmanager
def rewrite(storage: torch.UntypedStorage) -> Iterator[None]:
    """Around a rewrite of ``storage``'s data by its owner (the caller holds it alone)."""
    header = _header(storage)
    header.add_(1)  # odd: readers of the old data see a change from here on
    _fence()
    try:
        yield
    finally:
        _fence()
        header.add_(1)


def _fence() -> None:
    # A locked instruction (an uncontended mutex's) orders every store around it, the
    # non-temporal stores a large memcpy may use included: x86 keeps those in order
    # with locked instructions only.
    with _FENCE:
        pass


def sequence(storage: torch.UntypedStorage) -> Optional[int]:
    """The sequence of one of this process's recycled storages; None for any other storage."""
    ref = _marked.get(storage.data_ptr())
    if ref is None or ref.cdata != storage._cdata or ref.expired():
        return None
    return int(_header(storage).item())


def note(tensor: torch.Tensor, seq: int) -> torch.Tensor:
    """Mark a received ``tensor`` as read from a recycled storage sent at ``seq``."""
    setattr(tensor, _ATTR, seq)
    return tensor


def sent_sequence(tensor: torch.Tensor) -> Optional[int]:
    """The sequence a received tensor was sent at; None when it was not a recycled one."""
    return getattr(tensor, _ATTR, None)


def use_count(storage: torch.UntypedStorage) -> int:
    """References to ``storage``'s memory (tensors and storage objects): 1 when only the
    caller's object holds it (torch internal)."""
    return torch._C._storage_Use_Count(storage._cdata)


def unchanged(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory still holds what was sent, so that what was read of it
    before this call is whole: always True for a tensor not received from a recycled storage."""
    seq = sent_sequence(tensor)
    return seq is None or int(_header(tensor.untyped_storage()).item()) == seq


def _after_fork_in_child() -> None:
    _marked.clear()  # (the child owns none of them)


os.register_at_fork(after_in_child=_after_fork_in_child)
