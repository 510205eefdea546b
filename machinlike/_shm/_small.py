"""A message's many small tensors and arrays, stacked by kind before they are bundled.

Why: a list of transitions holds thousands of tiny tensors (a few floats of observation,
a 0-d reward). Copied one by one into the message's bundle, each cost about 1.4 us to
send and 2.5 us to receive, more than its bytes, and their table entries doubled the
pickle. Most share a dtype and a shape (every observation of the list), so those are
stacked, one ``torch.stack`` per kind, and the receiver copies each row out with numpy
(each item in memory of its own: keeping one keeps nothing else)::

    items ─► by (tensor or array, dtype, shape), contiguous ones
               each kind ─► stack ─► bytes ─► (numpy dtype, shape, bytes, positions)
             the rest (strided, a Parameter, a dtype numpy lacks: bfloat16, float8)
               ─► ``_pack``'s per-item bundle, as before
    receiver: out[position] = row copied, for each kind; the rest from the bundle
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["Stack", "stack", "unstack"]

#: (a tensor, not an array; numpy dtype; shape of one item; the rows' bytes; their positions)
Stack = Tuple[bool, np.dtype, Tuple[int, ...], bytes, List[int]]

_NUMPY: Dict[torch.dtype, Optional[np.dtype]] = {}


def _numpy_dtype(dtype: torch.dtype) -> Optional[np.dtype]:
    """numpy's dtype for ``dtype``; None for one numpy lacks."""
    if dtype not in _NUMPY:
        try:
            _NUMPY[dtype] = torch.empty(0, dtype=dtype).numpy().dtype
        except TypeError:
            _NUMPY[dtype] = None
    return _NUMPY[dtype]


def stack(items: Sequence[Any]) -> Tuple[List[Stack], List[int]]:
    """``items`` (strided CPU tensors without history and numpy arrays without objects)
    stacked by kind; returns the stacks and the positions of the items left out."""
    kinds: Dict[Tuple[Any, ...], Tuple[List[Any], List[int]]] = {}
    rest = []
    for position, item in enumerate(items):
        kind = type(item)
        if kind is torch.Tensor and item.is_contiguous() and _numpy_dtype(item.dtype) is not None:
            key = (True, item.dtype, item.shape)
        elif kind is np.ndarray and item.flags.c_contiguous:
            key = (False, item.dtype, item.shape)
        else:
            rest.append(position)
            continue
        entry = kinds.get(key)
        if entry is None:
            entry = kinds[key] = ([], [])
        entry[0].append(item)
        entry[1].append(position)
    stacks: List[Stack] = []
    for (tensor, dtype, shape), (members, positions) in kinds.items():
        if tensor:
            dtype = _numpy_dtype(dtype)
            data = torch.stack(members).numpy().tobytes()
        else:
            data = np.stack(members).tobytes()
        stacks.append((tensor, dtype, tuple(shape), data, positions))
    return stacks, rest


def unstack(stacks: Sequence[Stack], out: List[Any]) -> None:
    """Put each stacked item, copied out, at its position in ``out``."""
    for tensor, dtype, shape, data, positions in stacks:
        # (a 0-d item: rows of one element, each reshaped back; a row of a 1-d array is a scalar)
        rows = np.frombuffer(data, dtype=dtype).reshape((len(positions),) + (shape or (1,)))
        for position, row in zip(positions, rows):
            item = row.copy() if shape else row.copy().reshape(())
            out[position] = torch.from_numpy(item) if tensor else item
