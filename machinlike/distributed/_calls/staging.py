"""Staging a CUDA tensor through pinned CPU memory, and where a staged tensor lands.

The fallback of every CUDA path of a call (and the only one between hosts): the sender
copies the tensor into pinned CPU memory (asynchronously; the caller synchronises the
devices it collected), the receiver puts it back on ``cuda:index`` when it initialised
CUDA and sees that index, and keeps it on the CPU otherwise (a CPU actor on a GPU machine
must not get a CUDA context because a learner sent it a tensor).
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch

from .cuda_settle import noted
from .strides import kept_strides

__all__ = ["lands_on", "stage_tensor"]


def lands_on(index: int, cuda_ready: bool, device_count: int) -> torch.device:
    """Where a tensor staged from ``cuda:index`` arrives.

    Args:
        index: The sender's device index.
        cuda_ready: Whether the receiving process initialised CUDA.
        device_count: CUDA devices the receiver sees (after ``CUDA_VISIBLE_DEVICES``).

    Returns:
        ``cuda:index`` when the receiver uses CUDA and has that index; else ``cpu``.
    """
    if cuda_ready and 0 <= index < device_count:
        return torch.device("cuda", index)
    return torch.device("cpu")


def _land(host: torch.Tensor, index: int, requires_grad: bool, parameter: bool) -> torch.Tensor:
    ready = torch.cuda.is_initialized()
    device = lands_on(index, ready, torch.cuda.device_count() if ready else 0)
    if device.type == "cpu":
        tensor = host
    else:
        tensor = host.to(device)
        noted(index)  # (the caller's stream waits for this copy: cuda_settle)
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(True) if requires_grad else tensor


class _Staged:
    """A staged tensor; pickles as the call that lands it on the receiver."""

    __slots__ = ("host", "index", "requires_grad", "parameter")

    def __init__(self, host: torch.Tensor, index: int, requires_grad: bool, parameter: bool) -> None:
        self.host = host
        self.index = index
        self.requires_grad = requires_grad
        self.parameter = parameter

    def __reduce__(self) -> Tuple[Any, ...]:
        return _land, (self.host, self.index, self.requires_grad, self.parameter)


def stage_tensor(tensor: torch.Tensor, pending: List[torch.device]) -> _Staged:
    """Copy ``tensor`` (any device) to CPU memory, pinned for a strided CUDA tensor.

    Args:
        tensor: The tensor to stage.
        pending: Gets the CUDA device whose stream must be synchronised before the copy
            may be read (the copy is asynchronous); untouched for a blocking copy.
    """
    source = tensor.detach()
    if source.device.type == "cuda" and source.layout == torch.strided and not source.is_quantized \
            and not source.is_nested:
        strides = kept_strides(source)  # (its layout: the copy is a plain one, and arrives so)
        host = torch.empty(source.shape, dtype=source.dtype, pin_memory=True) if strides is None else \
            torch.empty_strided(source.shape, strides, dtype=source.dtype, pin_memory=True)
        host.copy_(source, non_blocking=True)
        if source.device not in pending:
            pending.append(source.device)
    else:  # sparse, quantized, nested, or not CUDA at all: torch's own blocking copy
        host = source.to("cpu", copy=True)
    index = source.device.index if source.device.type == "cuda" else 0  # (a CUDA tensor's is never None)
    return _Staged(host, index, tensor.requires_grad, type(tensor) is torch.nn.Parameter)
