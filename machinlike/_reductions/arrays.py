"""numpy arrays through fresh named shared memory, for payloads that may outlive their
sender or be loaded by several processes (a queue's item, a map's function)::

    array (>= 1 MiB, no Python objects) ──► one copy into a new named storage
        └─► array_from_storage(storage, dtype, shape, order): an array over that storage
            in the receiver (the storage pickles by the policy's own storage reducer)

Why: pickled, a numpy array's bytes go through the pipe (0.3-0.4 GB/s for 64 MB on this
box), where a tensor's storage travels as a name. Where ``/dev/shm`` has no room (a
container's 64 MB), the array goes by value as before. Owns no state.
"""

from __future__ import annotations

import pickle
from typing import Any, Callable, Literal, Tuple

import numpy as np
import torch

from . import shm_space

__all__ = ["LARGE_ARRAY_BYTES", "Order", "order_of", "array_over", "reduce_array_named", "array_from_storage"]

#: From this size on, an array moves through shared memory (the tensors' threshold).
LARGE_ARRAY_BYTES = 1 << 20

Order = Literal["C", "F"]


def order_of(array: np.ndarray) -> Order:
    """The order a copy of ``array`` keeps: "F" for a Fortran-ordered (column-major) one."""
    return "F" if array.flags.f_contiguous and not array.flags.c_contiguous else "C"


def array_over(data: np.ndarray, dtype: np.dtype, shape: Tuple[int, ...], order: Order) -> np.ndarray:
    """An array of ``dtype``, ``shape`` and ``order`` over the bytes ``data`` (uint8)."""
    return data.view(dtype).reshape(shape, order=order)


class _Storage:
    """Pickles as ``reduce_storage(storage)`` says (a policy's storage reducer)."""

    __slots__ = ("storage", "reduce_storage")

    def __init__(self, storage: torch.UntypedStorage, reduce_storage: Callable[[Any], Tuple[Any, ...]]) -> None:
        self.storage = storage
        self.reduce_storage = reduce_storage

    def __reduce__(self) -> Tuple[Any, ...]:
        return self.reduce_storage(self.storage)


def reduce_array_named(array: np.ndarray, reduce_storage: Callable[[Any], Tuple[Any, ...]]) -> Tuple[Any, ...]:
    """``array`` copied into new named shared memory: its rebuild call, whose storage
    pickles through ``reduce_storage``. A Fortran-ordered array keeps its order. Where
    shared memory has no room, the array's own reduction (by value; see ``shm_space``)."""
    storage = None
    try:
        if shm_space.has_room(array.nbytes):
            storage = torch.UntypedStorage._new_using_filename_cpu(array.nbytes)
    except RuntimeError as err:
        if not shm_space.is_full(err, array.nbytes):
            raise
    if storage is None:
        shm_space.warn_by_value(array.nbytes, "a numpy array")
        return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)  # type: ignore[return-value]  # (a tuple for arrays)
    order = order_of(array)
    np.copyto(array_from_storage(storage, array.dtype, array.shape, order), array, casting="no")
    return array_from_storage, (_Storage(storage, reduce_storage), array.dtype, array.shape, order)


def array_from_storage(storage: torch.UntypedStorage, dtype: np.dtype, shape: Tuple[int, ...],
                       order: Order) -> np.ndarray:
    """An array of ``dtype`` and ``shape`` over ``storage`` (which it keeps alive)."""
    # (the uint8 tensor is the array's base, and holds the storage)
    return array_over(torch.empty(0, dtype=torch.uint8).set_(storage).numpy(), dtype, shape, order)
