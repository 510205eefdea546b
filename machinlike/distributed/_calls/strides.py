"""The memory layout a CUDA tensor keeps when a call copies it (CUDA IPC or staging).

A CPU tensor crosses a call in its own layout (torch pickles its storage and strides), so
a channels-last image batch or a transposed matrix arrives as it was sent. The CUDA paths
copy each tensor into a buffer of their own (a slab, a pinned host tensor): a dense tensor
(every element once, no gaps) keeps its strides, and the copy is then a plain copy of its
bytes; any other (an expanded or sliced view, a sliced channels-last one too) arrives
contiguous, with the same values.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["kept_strides"]


def kept_strides(tensor: torch.Tensor) -> Optional[Tuple[int, ...]]:
    """The strides ``tensor``'s copy keeps: its own when it is dense and non-overlapping
    but not contiguous (channels-last, transposed); None: contiguous (it is already, or
    it is not dense)."""
    if tensor.is_contiguous() or tensor.numel() == 0:
        return None
    strides = tensor.stride()
    expected = 1
    # Dense: its dimensions of more than one element, smallest stride first, step through
    # memory exactly as a contiguous tensor of them would (a permutation of one).
    for size, stride in sorted((pair for pair in zip(tensor.shape, strides) if pair[0] != 1), key=lambda p: p[1]):
        if stride != expected:
            return None
        expected *= size
    return tuple(strides)
