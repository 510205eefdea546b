"""Tasks for benchmarks/pool.py, in an importable module so every peer pickles them by
reference (the standard pools cannot send functions defined in ``__main__`` by value)."""

from __future__ import annotations

import collections
import time

import torch


def square(x):
    return x * x


def timed_sum(tensor: torch.Tensor):
    """The tensor's sum and the seconds this worker spent computing it."""
    begin = time.perf_counter()
    total = float(tensor.sum())
    return total, time.perf_counter() - begin


Step = collections.namedtuple("Step", "obs reward")


def steps(n: int):
    """``n`` transitions as an actor's worker returns them: (observation, 0-d reward)."""
    return [Step(torch.rand(8), torch.tensor(0.5)) for _ in range(n)]
