"""Tensor and storage reducers for :mod:`machinlike.pickle`: one table per tensor policy.

The share policy (``share``: torch's IPC for CUDA, named shared memory for CPU storages,
with claim files and an undo ledger) and the copy policy (``copy``: elements by value).
"""

from .arrays import reduce_array_named
from .copy import _is_plain_strided as _is_plain_strided, _reduce_storage_copy as _reduce_storage_copy
from .copy import _reduce_tensor_copy as _reduce_tensor_copy, copy_reducers, cpu_copy_reducers, expand_back, expanded
from .share import _reduce_storage_share as _reduce_storage_share, manager_primer, reduce_tensor_share, share_reducers
from .table import DispatchTable
from .undo import undo_mark, undo_release, undo_rollback

__all__ = [
    "DispatchTable", "manager_primer", "share_reducers", "reduce_tensor_share", "copy_reducers", "cpu_copy_reducers",
    "undo_mark", "undo_rollback", "undo_release", "reduce_array_named", "expanded", "expand_back",
]
