"""The reducer tables' type, the tensor and storage classes they cover, and CUDA events."""

from __future__ import annotations

import copyreg
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.multiprocessing import reductions as _torch_red

__all__ = ["DispatchTable", "policy_table", "tensor_types", "typed_storage_entries", "reduce_cuda_event"]


class DispatchTable(dict):
    """A reducer table layered over multiprocessing's and copyreg's registrations.

    Own entries (the tensor policy) win; a miss falls through, live, to
    ``ForkingPickler._extra_reducers`` (multiprocessing objects: connections, sockets;
    torch's event reducer) and then to ``copyreg.dispatch_table``, so registrations made
    after import are honoured. The C pickler looks types up with ``[]`` (``__missing__``),
    the pure-Python pickler under dill with ``.get``; both paths are covered.
    """

    def __missing__(self, cls: type) -> Callable[[Any], Any]:
        reducer = ForkingPickler._extra_reducers.get(cls)  # type: ignore[attr-defined]  # stdlib private
        if reducer is None:
            reducer = copyreg.dispatch_table[cls]  # KeyError: the pickler falls back
        return reducer

    def get(self, cls: type, default: Any = None) -> Any:
        try:
            return self[cls]
        except KeyError:
            return default


def tensor_types() -> List[type]:
    return [torch.Tensor, torch.nn.Parameter, *torch._tensor_classes]


def typed_storage_entries() -> Dict[type, Callable[[Any], Any]]:
    entries: Dict[type, Callable[[Any], Any]] = {torch.storage.TypedStorage: _torch_red.reduce_typed_storage}
    for cls in torch._storage_classes:
        if cls not in (torch.UntypedStorage, torch.storage.TypedStorage):
            entries[cls] = _torch_red.reduce_typed_storage_child
    return entries


def reduce_cuda_event(event: Any) -> Tuple[Any, ...]:
    """torch's reducer of a CUDA event (an IPC handle), under either of its names: torch
    2.15 renamed ``reduce_event`` to ``_reduce_event`` when it took XPU events too."""
    reduce = getattr(_torch_red, "reduce_event", None) or getattr(_torch_red, "_reduce_event")
    return reduce(event)


def policy_table(tensor: Callable[[Any], Any], storage: Callable[[Any], Any]) -> DispatchTable:
    """A policy's table: ``tensor`` for every tensor class, ``storage`` for untyped
    storages, torch's reducers for typed storages and CUDA events."""
    table = DispatchTable(typed_storage_entries())
    for cls in tensor_types():
        table[cls] = tensor
    table[torch.UntypedStorage] = storage
    table[torch.cuda.Event] = reduce_cuda_event
    return table
