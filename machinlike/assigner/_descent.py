"""Adam on placement logits with the objective's gradient written out in NumPy.

This is the loop :class:`ModelAssigner` runs: the cost of ``_relaxed_cost`` and the
update of ``torch.optim.Adam`` with its defaults (tests check both against torch), but
without autograd and optimiser overhead, which dominate at these sizes (about 1 ms per
torch step against tens of microseconds here).
"""

from __future__ import annotations

import numpy as np

from ._objective import _Problem

__all__: list[str] = []

_BETA1, _BETA2, _EPS = 0.9, 0.999, 1e-8  # torch.optim.Adam's defaults


class _Gradient:
    """d(cost summed over the batch) / d logits ``[k, n, m]`` for one problem."""

    def __init__(self, pb: _Problem) -> None:
        wc, ws, wx, we = pb.weights
        self.connection = wc * pb.symmetric  # the connection term's gradient is wc S P D
        self.distance = pb.distance
        # memory and compute terms both have gradients of the form outer(per model,
        # per device): one [2, n] @ P gives the device loads, one [n, 2] @ [2, m] the sum
        self.loads = np.stack([pb.sizes, pb.complexity])
        self.scales = np.stack([pb.sizes * (ws / pb.size_unit), pb.complexity * (2 * wx)], 1)
        self.capacity, self.target = pb.capacity, pb.target
        self.entropy = we / max(1, len(pb.sizes))
        # sums over a short last axis run faster as a matrix product than as a reduction
        self.ones = np.ones((len(pb.capacity), 1))

    def __call__(self, z: np.ndarray) -> np.ndarray:
        top = z[..., 0:1].copy()
        for j in range(1, z.shape[-1]):
            np.maximum(top, z[..., j:j + 1], out=top)
        shifted = z - top
        e = np.exp(shifted)
        total = e @ self.ones
        p = e / total
        g = self.connection @ p @ self.distance
        loads = self.loads @ p  # [k, 2, m]: MB and complexity share on each device
        loads[:, 0] = loads[:, 0] > self.capacity  # relu's gradient, 0 at the kink
        loads[:, 1] -= self.target
        g += self.scales @ loads
        # The mean row entropy H = -(1/n) sum p log p has dH/dz = -(1/n) p (log p + H_row);
        # folded in as -(we/n) log p, the whole gradient is the softmax backward
        # p * (g - <p, g>) of it.
        g -= self.entropy * (shifted - np.log(total))
        g -= (p * g) @ self.ones
        g *= p
        return g


def _gradient(pb: _Problem, z: np.ndarray) -> np.ndarray:
    """d(cost summed over the batch) / d logits, for logits ``[k, n, m]``."""
    return _Gradient(pb)(z)


def _descend(pb: _Problem, logits: np.ndarray, iterations: int, lr: float) -> np.ndarray:
    """Runs ``iterations`` Adam steps from ``logits`` ``[k, n, m]``; returns new logits."""
    gradient = _Gradient(pb)
    z = logits.astype(np.float64, copy=True)
    m1 = np.zeros_like(z)
    m2 = np.zeros_like(z)
    for step in range(1, iterations + 1):
        g = gradient(z)
        m1 *= _BETA1
        m1 += (1 - _BETA1) * g
        m2 *= _BETA2
        g *= g
        m2 += (1 - _BETA2) * g
        denom = np.sqrt(m2)
        denom *= 1 / np.sqrt(1 - _BETA2**step)
        denom += _EPS
        z -= (lr / (1 - _BETA1**step)) * m1 / denom
    return z
