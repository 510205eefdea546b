"""The placement search: gradient descent, then discrete refinement by local search with
single moves and pairwise swaps, iterated with random kicks, and an exact feasibility
search for when memory is tight.

Placements are compared lexicographically: first the MB over the allowed memory
(summed over devices), then the objective. So a search that starts infeasible first
heads for any fitting placement, and once it fits it never accepts a step that overflows.
"""

from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from ._descent import _descend
from ._objective import _Problem

__all__: list[str] = []

_IMPROVEMENT = 1e-12  # objective decrease below this is rounding, not progress

# Logit matrices optimised side by side from different seeded starts: 32 on small
# problems, fewer on large ones (down to 8) to bound the cost of the descent.
_RESTART_ELEMENTS, _MIN_RESTARTS, _MAX_RESTARTS = 2048, 8, 32
_INIT_SCALE = 2.0  # spread of the initial logits: wide, so restarts reach distinct basins


def _kick_rounds(n: int) -> int:
    # large problems have many more local optima; 6 per model keeps 32 x 8 under 1 s
    return min(256, max(32, 6 * n))


def _score(pb: _Problem, a: np.ndarray) -> tuple[float, float]:
    """(overflow MB, objective) of one placement: ``_discrete_terms`` without batching."""
    m = len(pb.capacity)
    wc, ws, wx, _ = pb.weights
    overflow = float(np.maximum(np.bincount(a, pb.sizes, m) - pb.capacity, 0).sum())
    connection = float((pb.connection * pb.distance[a][:, a]).sum())
    compute = float(((np.bincount(a, pb.complexity, m) - pb.target) ** 2).sum())
    return overflow, wc * connection + ws * overflow / pb.size_unit + wx * compute


def _better(pb: _Problem, x: tuple[float, float], y: tuple[float, float]) -> bool:
    """Whether score ``x`` (overflow, objective) beats ``y``."""
    tol = pb.tolerance
    if x[0] < y[0] - tol:
        return True
    return abs(x[0] - y[0]) <= tol and x[1] < y[1] - _IMPROVEMENT


def _neighbour_deltas(pb: _Problem, a: np.ndarray):
    """Change of (overflow MB, objective) for every single move and pairwise swap.

    Returns ``(move_over, move_cost, swap_over, swap_cost)`` of shapes ``[n, m]``
    (model i to device b) and ``[n, n]`` (models i and k exchange devices); entries that
    are no change at all (b == a[i], a[i] == a[k], i >= k) are ``inf``.
    """
    n, m = len(a), len(pb.capacity)
    rows = np.arange(n)
    wc, ws, wx, _ = pb.weights
    q, s, cap = pb.complexity, pb.sizes, pb.capacity
    usage = np.bincount(a, weights=s, minlength=m)
    over = np.maximum(usage - cap, 0)
    err = np.bincount(a, weights=q, minlength=m) - pb.target  # compute share - target

    # connection: G[i, b] = sum_k S_ik D[a_k, b]; moving i from a_i to b changes the
    # objective by G[i, b] - G[i, a_i] (S symmetric, zero diagonal)
    g = pb.symmetric @ pb.distance[a]
    conn_move = g - g[rows, a][:, None]
    ea, ua, ca, oa = err[a], usage[a], cap[a], over[a]
    comp_move = ((ea - q) ** 2 - ea**2)[:, None] + (err + q[:, None]) ** 2 - err**2
    move_over = (np.maximum(ua - s - ca, 0) - oa)[:, None] + (
        np.maximum(usage + s[:, None] - cap, 0) - over
    )
    move_cost = wc * conn_move + wx * comp_move + ws * move_over / pb.size_unit
    move_over[rows, a] = np.inf
    move_cost[rows, a] = np.inf

    # a swap is both moves, except that the pair's own distance does not change
    x = conn_move[:, a]  # x[i, k]: move i onto a_k
    conn_swap = x + x.T + 2 * pb.symmetric * pb.distance[a][:, a]
    dq = q[None, :] - q[:, None]  # device a_i gains q_k - q_i, a_k loses it
    comp_swap = (
        (ea[:, None] + dq) ** 2 - ea[:, None] ** 2 + (ea[None, :] - dq) ** 2 - ea[None, :] ** 2
    )
    ds = s[None, :] - s[:, None]
    swap_over = (
        np.maximum(ua[:, None] + ds - ca[:, None], 0) - oa[:, None]
        + np.maximum(ua[None, :] - ds - ca[None, :], 0) - oa[None, :]
    )
    swap_cost = wc * conn_swap + wx * comp_swap + ws * swap_over / pb.size_unit
    useless = (a[:, None] == a[None, :]) | (rows[:, None] >= rows[None, :])
    swap_over[useless] = np.inf
    swap_cost[useless] = np.inf
    return move_over, move_cost, swap_over, swap_cost


def _local_search(pb: _Problem, a: np.ndarray) -> tuple[np.ndarray, tuple[float, float]]:
    """Best-improvement descent over single moves and pairwise swaps.

    While the placement overflows, each step takes the largest overflow reduction (the
    cheapest among equals); once it fits, the step that lowers the objective most among
    those that keep it fitting. Stops at a local optimum.
    """
    a = a.copy()
    n, m = len(a), len(pb.capacity)
    tol = pb.tolerance
    score = _score(pb, a)
    # each step strictly improves (overflow, objective); the cap only bounds pathologies
    for _ in range(20 * n * m):
        move_over, move_cost, swap_over, swap_cost = _neighbour_deltas(pb, a)
        d_over = np.concatenate([move_over.ravel(), swap_over.ravel()])
        d_cost = np.concatenate([move_cost.ravel(), swap_cost.ravel()])
        if not np.isfinite(d_over).any():
            break  # one device: nothing to move
        if score[0] > tol and d_over.min() < -tol:
            near_best = d_over <= d_over.min() + tol
            pick = int(np.flatnonzero(near_best)[np.argmin(d_cost[near_best])])
        else:
            keeps_fit = d_over <= tol
            if not keeps_fit.any():
                break
            pick = int(np.flatnonzero(keeps_fit)[np.argmin(d_cost[keeps_fit])])
            if d_cost[pick] >= -_IMPROVEMENT:
                break
        if pick < n * m:
            a[pick // m] = pick % m
        else:
            i, k = divmod(pick - n * m, n)
            a[i], a[k] = a[k], a[i]
        score = (max(0.0, score[0] + d_over[pick]), score[1] + d_cost[pick])
    return a, _score(pb, a)  # exact, so the summed deltas' rounding does not persist


def _refine(
    pb: _Problem, starts: list[np.ndarray], rng: np.random.Generator, kicks: int
) -> tuple[np.ndarray, tuple[float, float]]:
    """Local search from every distinct start, then ``kicks`` rounds of iterated local
    search (perturb the best placement, descend, keep the result if it is better)."""
    best, best_score = starts[0], (np.inf, np.inf)
    seen = set()
    for start in starts:
        key = start.tobytes()
        if key in seen:
            continue
        seen.add(key)
        a, score = _local_search(pb, start)
        if _better(pb, score, best_score):
            best, best_score = a, score
    if len(pb.capacity) > 1:
        for round_ in range(kicks):
            a, score = _local_search(pb, _kick(best, len(pb.capacity), rng, round_))
            if _better(pb, score, best_score):
                best, best_score = a, score
    return best, best_score


def _kick(a: np.ndarray, m: int, rng: np.random.Generator, round_: int) -> np.ndarray:
    """A perturbed copy of ``a``: every third round two devices exchange all their
    models (a step no single move or swap can take when memory is tight), otherwise 2
    or 3 models move to random other devices."""
    a = a.copy()
    n = len(a)
    if round_ % 3 == 2:
        x, y = rng.choice(m, size=2, replace=False)
        on_x, on_y = a == x, a == y
        a[on_x], a[on_y] = y, x
        return a
    moved = rng.choice(n, size=min(n, int(rng.integers(2, 4))), replace=False)
    a[moved] = (a[moved] + rng.integers(1, m, size=len(moved))) % m
    return a


def _find_fitting(pb: _Problem, budget: int = 200_000) -> tuple[Optional[np.ndarray], bool]:
    """Depth-first search for any placement within the allowed memory (bin packing).

    Models go largest first; devices whose remaining room is equal are interchangeable,
    so only the first of them is tried. Returns ``(placement or None, exhausted)``;
    ``exhausted`` tells that ``budget`` nodes were spent before a proof either way.
    """
    n, m = len(pb.sizes), len(pb.capacity)
    tol = pb.tolerance
    order = np.argsort(-pb.sizes, kind="stable")
    sizes = pb.sizes[order]
    rest = np.concatenate([np.cumsum(sizes[::-1])[::-1], [0.0]])  # MB still to place
    room = pb.capacity.astype(np.float64).copy()
    choice = np.full(n, -1)
    tried: list[list[float]] = [[] for _ in range(n)]
    depth, nodes = 0, 0
    while depth >= 0:
        if depth == n:
            placement = np.empty(n, dtype=np.int64)
            placement[order] = choice
            return placement, False
        if choice[depth] >= 0:  # undo the previous choice at this depth
            room[choice[depth]] += sizes[depth]
        j = choice[depth] + 1
        while j < m and (room[j] < sizes[depth] - tol or room[j] in tried[depth]):
            j += 1
        nodes += 1
        if j >= m or nodes > budget or room.sum() < rest[depth] - tol:
            if nodes > budget:
                return None, True
            choice[depth], tried[depth] = -1, []
            depth -= 1
            continue
        tried[depth].append(room[j])
        room[j] -= sizes[depth]
        choice[depth] = j
        depth += 1
    return None, False


class _NoFit(Exception):
    """No fitting placement was found; carries the best overflowing one."""

    def __init__(self, best: np.ndarray, exhausted: bool) -> None:
        super().__init__(best, exhausted)
        self.best, self.exhausted = best, exhausted


def _solve(pb: _Problem, iterations: int, lr: float, seed: int) -> np.ndarray:
    """The assigner's whole search; returns the device index of each model.

    Raises:
        _NoFit: No placement within the allowed memory was found.
    """
    n, m = len(pb.sizes), len(pb.capacity)
    gen = torch.Generator().manual_seed(seed)  # private: the global RNG stays untouched
    restarts = min(_MAX_RESTARTS, max(_MIN_RESTARTS, _RESTART_ELEMENTS // (n * m)))
    logits = torch.randn((restarts, n, m), generator=gen, dtype=torch.float64).numpy()
    logits = _descend(pb, logits * _INIT_SCALE, iterations, lr)
    rng = np.random.default_rng(seed)
    best, (over, _) = _refine(pb, list(logits.argmax(-1)), rng, _kick_rounds(n))
    if over > pb.tolerance:
        fitting, exhausted = _find_fitting(pb)
        if fitting is None:
            raise _NoFit(best, exhausted)
        best, _ = _refine(pb, [fitting], rng, _kick_rounds(n))
    return best
