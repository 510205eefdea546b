"""A message's references to its CUDA tensors on the IPC path (``cuda_ipc.Batch``).

A ``Ref`` stands in the message for one tensor; each device's tensors form one ``Group``,
which pickles, once, as the receiver's call that copies all of them out of their slab::

    message ── Ref(group, i) ──► pickled: operator.getitem(group, i)
                     │                      group ──► pickled: its ``reduced`` (set by
                     │                                ``Batch.commit``: _receive_group(...))
                     └─ staged (no slab): the staged tensor's own reduction

Why a separate object per tensor: pickle's memo sends a group once however many of its
tensors a message holds, and a tensor that had to be staged changes only its own ``Ref``.
"""

from __future__ import annotations

import operator
from typing import Any, List, Optional, Tuple

import torch

__all__ = ["Group", "Ref"]


class Group:
    """One device's tensors of one message; pickles as the receiver's copy-out call."""

    __slots__ = ("index", "tensors", "reduced")

    def __init__(self, index: int) -> None:
        self.index = index
        self.tensors: List[torch.Tensor] = []
        self.reduced: Optional[Tuple[Any, ...]] = None

    def __reduce__(self) -> Tuple[Any, ...]:
        if self.reduced is None:
            raise RuntimeError("a CUDA IPC group was pickled before it was committed")
        return self.reduced


class Ref:
    """One tensor of a message: the ``i``-th of its group's copies, or a staged tensor."""

    __slots__ = ("group", "i", "staged")

    def __init__(self, group: Group, i: int) -> None:
        self.group = group
        self.i = i
        self.staged: Any = None

    def __reduce__(self) -> Tuple[Any, ...]:
        if self.staged is not None:
            return self.staged.__reduce__()
        # The group pickles once (pickle's memo): the receiver copies all of it in one call.
        return operator.getitem, (self.group, self.i)
