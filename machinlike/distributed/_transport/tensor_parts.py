"""Tensors torch's RPC pickler cannot carry whole, sent as their parts.

torch's RPC pickler puts every tensor of a message into its tensor table, and TensorPipe's
serializer then asks each one for its storage. A compressed sparse tensor (CSR, CSC, BSR,
BSC) and a strided nested tensor have none: the serializer throws, on the caller's thread
(a ``RuntimeError`` with a C++ trace) or on one of the agent's (``std::terminate``: the
whole process aborts with SIGABRT, caller or callee, with no word of what was sent)::

    a tensor in a call or reply ─┬─ compressed sparse ─► its two index tensors, values, size
                                 ├─ strided nested   ─► its buffer, sizes, strides, offsets
                                 │        (each part a plain tensor in the table; rebuilt
                                 │         by the receiver's unpickling)
                                 └─ anything else    ─► torch's own reducer, as before

COO sparse, jagged nested and quantized tensors travel whole already and are left alone.

Why torch's table rather than a walk of the arguments: a walk sees lists, tuples and dicts
only, and calls to other hosts are not walked at all; the table sees every tensor of every
message, wherever it sits. The table is torch's and process-wide, so it is changed when a
World starts (never at import), once, and a raw ``rpc_sync`` of the user's gains it too.
"""

from __future__ import annotations

from typing import Any, Callable, Tuple

import torch

__all__ = ["install"]

_COMPRESSED = frozenset({torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr, torch.sparse_bsc})
_ROW_COMPRESSED = frozenset({torch.sparse_csr, torch.sparse_bsr})


def _rebuild_compressed(layout: torch.layout, compressed: torch.Tensor, plain: torch.Tensor, values: torch.Tensor,
                        size: Tuple[int, ...]) -> torch.Tensor:
    # (torch's own _rebuild_sparse_tensor queues the tensor in a list that only torch.load
    # empties: it would grow with every tensor received)
    return torch.sparse_compressed_tensor(compressed, plain, values, size, layout=layout, dtype=values.dtype)


def _rebuild_nested(buffer: torch.Tensor, sizes: torch.Tensor, strides: torch.Tensor,
                    offsets: torch.Tensor) -> torch.Tensor:
    return torch._nested_view_from_buffer(buffer, sizes, strides, offsets)


Reducer = Callable[[torch.Tensor], Any]  # (a reduce tuple; typed loosely, as copyreg's own table)


def _by_parts(whole: Reducer) -> Reducer:
    def reduce(tensor: torch.Tensor) -> Any:
        layout = tensor.layout
        if layout is torch.strided:
            if not tensor.is_nested:  # the common case: one attribute more than torch's own
                return whole(tensor)
            return _rebuild_nested, (tensor.values(), tensor._nested_tensor_size(),
                                     tensor._nested_tensor_strides(), tensor._nested_tensor_storage_offsets())
        if layout in _COMPRESSED:
            if layout in _ROW_COMPRESSED:
                compressed, plain = tensor.crow_indices(), tensor.col_indices()
            else:
                compressed, plain = tensor.ccol_indices(), tensor.row_indices()
            return _rebuild_compressed, (layout, compressed, plain, tensor.values(), tuple(tensor.shape))
        return whole(tensor)
    reduce._machinlike_parts = True  # type: ignore[attr-defined]  # (marks it installed)
    return reduce


def install() -> None:
    """Make torch's RPC pickler send compressed sparse and strided nested tensors as
    their parts (idempotent; process-wide)."""
    from torch.distributed.rpc import internal

    table = internal._internal_rpc_pickler._dispatch_table
    current = table.get(torch.Tensor)
    if current is None or getattr(current, "_machinlike_parts", False):
        return
    table[torch.Tensor] = _by_parts(current)
