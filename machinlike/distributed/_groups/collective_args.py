"""Checks of a collective's arguments made before anything is sent.

torch's own messages for these name pybind's overloads or fail in the middle of a
collective (after the other members entered it); these name the parameter and the fix.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

__all__ = ["reduce_op", "object_list"]


def reduce_op(op: Any) -> Any:
    """``op`` when it is a ``torch.distributed.ReduceOp``.

    Raises:
        TypeError: It is not.
    """
    if not isinstance(op, dist.ReduceOp):
        raise TypeError(f"op must be a torch.distributed.ReduceOp (ReduceOp.SUM, ReduceOp.MAX, ...), not {op!r}")
    return op


def object_list(value: Any, size: Optional[int]) -> None:
    """Raise unless ``value`` is a list (of ``size`` entries unless None).

    Raises:
        TypeError, ValueError: ``value`` is not a list (of ``size`` entries).
    """
    if not isinstance(value, list):
        raise TypeError(f"object_list must be a list (written in place), not {type(value).__name__} ({value!r}): "
                        f"pass e.g. object_list=[None] * n")
    if size is not None and len(value) != size:
        raise ValueError(f"object_list holds {len(value)} entries; all_gather_object needs one per member "
                         f"({size}): pass [None] * group.size()")
