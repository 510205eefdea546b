"""Memory estimate of a module from its parameters and buffers."""

from __future__ import annotations

import math
from typing import Iterable

import torch
from torch import nn

from ._validate import _check_number

__all__ = ["ModelSizeEstimator", "MB"]

MB = 2**20
"""Bytes in one MB as every size in :mod:`machinlike.assigner` counts it (a mebibyte)."""

# Packed quantised dtypes report one byte per element but store several elements in it.
_PACKED_BITS = {torch.quint4x2: 4, torch.quint2x4: 2}


def _tensor_bytes(tensor: torch.Tensor) -> int:
    bits = _PACKED_BITS.get(tensor.dtype)
    if bits is not None:
        return math.ceil(tensor.numel() * bits / 8)
    return tensor.numel() * tensor.element_size()


def _total_mb(tensors: Iterable[torch.Tensor]) -> float:
    return sum(_tensor_bytes(t) for t in tensors) / MB


class ModelSizeEstimator:
    """Estimates how much device memory a module needs, in MB (``2**20`` bytes).

    The estimate counts every parameter and buffer once (a parameter shared by two
    submodules counts once; two distinct tensors viewing one storage count twice) at the
    exact width of its dtype, including bfloat16, complex, bool, float8 and quantised
    dtypes. Activations, gradients and optimiser state are not visible in a module, hence
    the ``size_multiplier`` that reserves room for them. Tensors on the ``meta`` device
    are counted like real ones, so huge models can be sized without allocating them.

    Args:
        model: Module to estimate.
        size_multiplier: Factor applied by :meth:`estimate_size` to the raw size of
            parameters and buffers (2 reserves as much again for inputs and activations).

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or ``size_multiplier`` not a number.
        ValueError: ``size_multiplier`` is not a finite positive number.
    """

    def __init__(self, model: nn.Module, size_multiplier: float = 2) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(
                f"model must be a torch.nn.Module, got {type(model).__name__}"
            )
        self.model = model
        self.size_multiplier = _check_number(size_multiplier, "size_multiplier", positive=True)

    def get_parameter_sizes(self) -> float:
        """Returns the size of all parameters in MB, without the multiplier."""
        return _total_mb(self.model.parameters())

    def get_buffer_sizes(self) -> float:
        """Returns the size of all buffers in MB, without the multiplier."""
        return _total_mb(self.model.buffers())

    def estimate_size(self) -> float:
        """Returns ``(parameters + buffers) * size_multiplier`` in MB."""
        return (self.get_parameter_sizes() + self.get_buffer_sizes()) * self.size_multiplier
