"""The placement objective, in the relaxed form gradient descent minimises and in the
exact form evaluated on discrete placements, plus the report of one placement.

Both forms compute the same four terms from the same normalised data (``_Problem``);
on a one-hot placement the relaxed cost equals the discrete one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

import numpy as np
import torch

__all__ = ["PlacementTerms", "PlacementReport"]


@dataclass(frozen=True)
class _Problem:
    """Normalised data of one problem with n models and m devices (float64 arrays)."""

    sizes: np.ndarray  # (n,) MB each model needs
    capacity: np.ndarray  # (m,) MB allowed on each device
    connection: np.ndarray  # (n, n) zero diagonal, sums to 1 (all 0: no connections)
    symmetric: np.ndarray  # (n, n) connection + its transpose
    distance: np.ndarray  # (m, m) largest entry 1 (all 0 when every distance is 0)
    complexity: np.ndarray  # (n,) share of the total complexity (all 0 when that is 0)
    target: np.ndarray  # (m,) compute share each device should carry (0s as above)
    size_unit: float  # MB counted as one unit of overflow: the mean model size
    weights: tuple[float, float, float, float]  # connection, size, complexity, entropy

    @property
    def tolerance(self) -> float:
        """MB of overflow still counted as fitting (float rounding only)."""
        return 1e-9 * max(1.0, float(self.sizes.sum()))


def _share(values: np.ndarray) -> np.ndarray:
    total = values.sum()
    return values / total if total > 0 else np.zeros_like(values)


def _make_problem(
    sizes: Sequence[float],
    capacity: Sequence[float],
    connection: np.ndarray,
    distance: np.ndarray,
    complexity: Sequence[float],
    compute: Sequence[float],
    weights: Sequence[float],
) -> _Problem:
    sizes_a = np.asarray(sizes, dtype=np.float64)
    conn = np.array(connection, dtype=np.float64)
    np.fill_diagonal(conn, 0.0)  # a model never waits on itself
    conn = _share(conn)
    dist = np.asarray(distance, dtype=np.float64)
    dist = dist / dist.max() if dist.size and dist.max() > 0 else np.zeros_like(dist)
    cmplx = _share(np.asarray(complexity, dtype=np.float64))
    power = np.asarray(compute, dtype=np.float64)
    # every device at compute 0 (e.g. only the CPU with cpu_weight=0): treat them alike
    target = _share(power) if power.sum() > 0 else np.full(len(power), 1.0 / len(power))
    if not cmplx.any():
        target = np.zeros_like(target)  # nothing to balance: the term is 0 everywhere
    mean_size = float(sizes_a.mean()) if sizes_a.size else 0.0
    return _Problem(
        sizes=sizes_a,
        capacity=np.asarray(capacity, dtype=np.float64),
        connection=conn,
        symmetric=conn + conn.T,
        distance=dist,
        complexity=cmplx,
        target=target,
        size_unit=mean_size if mean_size > 0 else 1.0,
        weights=tuple(float(w) for w in weights),  # type: ignore[arg-type]
    )


class _TorchProblem(NamedTuple):
    sizes: torch.Tensor  # [1, n]
    capacity: torch.Tensor  # [1, m]
    connection: torch.Tensor  # [n, n]
    distance: torch.Tensor  # [m, m]
    complexity: torch.Tensor  # [1, n]
    target: torch.Tensor  # [1, m]
    size_unit: float
    weights: tuple[float, float, float, float]


def _to_torch(pb: _Problem, dtype: torch.dtype, device: torch.device) -> _TorchProblem:
    def conv(a: np.ndarray, row: bool = False) -> torch.Tensor:
        t = torch.as_tensor(a, dtype=dtype, device=device)
        return t.view(1, -1) if row else t

    return _TorchProblem(
        conv(pb.sizes, True), conv(pb.capacity, True), conv(pb.connection),
        conv(pb.distance), conv(pb.complexity, True), conv(pb.target, True),
        pb.size_unit, pb.weights,
    )


def _relaxed_cost(logits: torch.Tensor, tp: _TorchProblem) -> torch.Tensor:
    """The objective of soft placements ``softmax(logits)`` of shape ``[..., n, m]``.

    Returns one cost per placement (shape ``[...]``); NaN-free for finite logits, as the
    entropy is taken from ``log_softmax`` and never evaluates ``0 * log(0)``.
    """
    log_p = torch.log_softmax(logits, dim=-1)
    p = log_p.exp()
    # sum_ik C_ik (P D P^T)_ik, written as sum(P * (C P) D) to stay O(n^2 m)
    connection = (p * ((tp.connection @ p) @ tp.distance)).sum((-2, -1))
    usage = tp.sizes @ p  # [..., 1, m] MB expected on each device
    memory = torch.relu(usage - tp.capacity).sum((-2, -1)) / tp.size_unit
    share = tp.complexity @ p
    compute = ((share - tp.target) ** 2).sum((-2, -1))
    entropy = -(p * log_p).sum(-1).mean(-1)
    wc, ws, wx, we = tp.weights
    return wc * connection + ws * memory + wx * compute + we * entropy


class PlacementTerms(NamedTuple):
    """The objective's terms for ``k`` discrete placements (float64 tensors ``[k]``).

    ``connection``, ``memory``, ``compute`` and ``entropy`` are unweighted; ``total`` is
    their weighted sum, the value the assigner minimises. ``overflow_mb`` is the MB put
    on devices beyond what they allow, summed over devices (0 for a feasible placement).
    """

    connection: torch.Tensor
    memory: torch.Tensor
    compute: torch.Tensor
    entropy: torch.Tensor
    total: torch.Tensor
    overflow_mb: torch.Tensor


def _discrete_terms(pb: _Problem, placements: np.ndarray) -> dict[str, np.ndarray]:
    """Evaluates integer placements ``[k, n]`` (device index per model) exactly."""
    k, m = placements.shape[0], len(pb.capacity)
    out: dict[str, list[np.ndarray]] = {name: [] for name in PlacementTerms._fields}
    chunk = max(1, 2_000_000 // max(1, pb.sizes.size ** 2))  # bounds the [c, n, n] gather
    for lo in range(0, k, chunk):
        a = placements[lo:lo + chunk]
        onehot = (a[:, :, None] == np.arange(m)).astype(np.float64)
        connection = (pb.connection * pb.distance[a[:, :, None], a[:, None, :]]).sum((1, 2))
        overflow = np.maximum(onehot.transpose(0, 2, 1) @ pb.sizes - pb.capacity, 0).sum(1)
        share = onehot.transpose(0, 2, 1) @ pb.complexity
        compute = ((share - pb.target) ** 2).sum(1)
        memory = overflow / pb.size_unit
        wc, ws, wx, _ = pb.weights
        for name, value in (
            ("connection", connection), ("memory", memory), ("compute", compute),
            ("entropy", np.zeros(len(a))), ("overflow_mb", overflow),
            ("total", wc * connection + ws * memory + wx * compute),
        ):
            out[name].append(value)
    return {name: np.concatenate(parts) for name, parts in out.items()}


@dataclass(frozen=True)
class PlacementReport:
    """How one discrete placement scores and loads the devices.

    Attributes:
        devices: The candidate devices, in the assigner's order.
        assignment: The device of each model.
        connection, memory, compute, entropy: Unweighted objective terms (entropy is 0
            for a discrete placement; memory is overflow in mean-model-size units).
        weights: ``(connection, size_match, complexity_match, entropy)`` weights.
        total: The weighted sum of the terms, the value the assigner minimises.
        model_sizes: MB each model needs (with ``model_size_multiplier``).
        memory_used: MB placed on each device.
        memory_allowed: MB allowed on each device (free memory * ``max_mem_ratio``).
        compute_load: Summed model complexity placed on each device.
        compute_power: Compute power of each device (relative to one GPU).
        feasible: Whether no device holds more than it allows.
    """

    devices: tuple[torch.device, ...]
    assignment: tuple[torch.device, ...]
    connection: float
    memory: float
    compute: float
    entropy: float
    weights: tuple[float, float, float, float]
    total: float
    model_sizes: tuple[float, ...]
    memory_used: tuple[float, ...]
    memory_allowed: tuple[float, ...]
    compute_load: tuple[float, ...]
    compute_power: tuple[float, ...]
    feasible: bool

    def __str__(self) -> str:
        wc, ws, wx, we = self.weights
        lines = [
            f"placement of {len(self.assignment)} models on {len(self.devices)} devices"
            f" ({'fits' if self.feasible else 'DOES NOT FIT'} in the allowed memory)",
            f"objective {self.total:.6g} = {wc:g} x connection {self.connection:.6g}"
            f" + {ws:g} x memory {self.memory:.6g} + {wx:g} x compute {self.compute:.6g}"
            f" + {we:g} x entropy {self.entropy:.6g}",
            f"{'device':<10}{'models':>7}{'memory MB':>13}{'allowed MB':>13}"
            f"{'use %':>7}{'complexity':>12}{'power':>7}",
        ]
        for j, dev in enumerate(self.devices):
            count = sum(1 for d in self.assignment if d == dev)
            allowed = self.memory_allowed[j]
            use = 100 * self.memory_used[j] / allowed if allowed > 0 else float("nan")
            lines.append(
                f"{str(dev):<10}{count:>7}{self.memory_used[j]:>13.2f}{allowed:>13.2f}"
                f"{use:>7.1f}{self.compute_load[j]:>12.4g}{self.compute_power[j]:>7.3g}"
            )
        return "\n".join(lines)
