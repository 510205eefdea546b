"""Benchmark: ModelAssigner against a greedy placement and the brute-force optimum.

Random instances (6 models x 3 devices and 8 x 4: 8 instances x 3 seeds each) are small
enough to enumerate every placement, so the exact optimum of the assigner's own
objective (among placements that fit in memory) is the lower bound. 32 x 8 instances
are timed and compared with the greedy placement only.

Instances: models are meta-device modules (sized, never allocated); device 0 is the CPU
(compute power 0, distance 10 to the GPUs), the others GPUs with compute power in
[0.5, 1]; connections join about a third of the model pairs; memory is tight: each
device allows 1.0-1.3x what a hidden random placement puts on it, so a fitting
placement always exists but many do not fit.

Columns: optimal / within 2% = runs whose cost equals / is within 2% of the optimum;
c/opt = cost divided by the optimum (over fitting results); infeasible = runs whose
placement overflows a device; wall/cpu ms = time per assignment (the CPU time of this
process is the steadier figure on a shared machine); t/ours = wall time relative to
ours. "ours, iterations=0"
skips the gradient descent (refinement from random starts only), to show what the
descent contributes.

Run: ``python benchmarks/assigner.py`` (with machinlike importable, e.g. installed with
``pip install -e .`` or ``PYTHONPATH=.`` from the repository root).
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time

import numpy as np
import torch
from torch import nn

from machinlike.assigner import DeviceSpec, ModelAssigner

MACHIN_REFERENCE = (
    "machin 0.4.2 ModelAssigner (not installable here; figures from issue 5, default "
    "weights, 8 instances x 3 seeds):\n  optimal in 0 of 24 runs, cost often no better "
    "than the average random placement, memory-infeasible in most runs where a fitting "
    "placement existed, 0.37 s per assignment"
)


class _Blob(nn.Module):
    """A model of a given size whose parameter lives on the meta device."""

    def __init__(self, mb: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(max(1, int(mb * 2**20 / 4)), device="meta"))


def make_instance(n: int, m: int, index: int):
    """Returns (models, connection dict, device specs) of instance ``index``."""
    rng = np.random.default_rng(1000 * n + index)
    raw_mb = rng.lognormal(np.log(200), 0.8, n)
    need = 2 * raw_mb  # the default model_size_multiplier
    hidden = rng.integers(0, m, n)
    used = np.bincount(hidden, weights=need, minlength=m)
    allowed = used * rng.uniform(1.0, 1.3, m) + need.min() * rng.uniform(0, 0.5, m)
    specs = [DeviceSpec("cpu", 2 * allowed[0], compute=0.0)] + [
        DeviceSpec(f"cuda:{j - 1}", 2 * allowed[j], compute=float(rng.uniform(0.5, 1.0)))
        for j in range(1, m)
    ]
    conn = {
        (i, k): float(rng.uniform(0.5, 2.0))
        for i, k in itertools.combinations(range(n), 2)
        if rng.uniform() < 0.35
    }
    return [_Blob(mb) for mb in raw_mb], conn, specs


def greedy(assigner: ModelAssigner, conn: dict, specs) -> np.ndarray:
    """Largest model first onto the device where it adds the least connection cost to
    the models already placed, ties broken by the most free memory; a model that fits
    nowhere goes to the device with the most free memory."""
    sizes, room = np.array(assigner.model_sizes), np.array(assigner.memory_capacity)
    m = len(room)
    dist = np.array(
        [[0 if a == b else (1 if specs[a].device.type == specs[b].device.type == "cuda" else 10)
          for b in range(m)] for a in range(m)], dtype=float)
    placed = -np.ones(len(sizes), dtype=np.int64)
    for i in np.argsort(-sizes, kind="stable"):
        partners = [(b if a == i else a, w) for (a, b), w in conn.items() if i in (a, b)]
        added = [sum(w * dist[j, placed[k]] for k, w in partners if placed[k] >= 0)
                 for j in range(m)]
        fits = [j for j in range(m) if room[j] >= sizes[i]]
        j = min(fits, key=lambda j: (added[j], -room[j])) if fits else int(np.argmax(room))
        placed[i] = j
        room[j] -= sizes[i]
    return placed


def brute_force(assigner: ModelAssigner, n: int, m: int):
    """(optimal cost among fitting placements, mean cost over all placements)."""
    everything = np.array(list(itertools.product(range(m), repeat=n)), dtype=np.int64)
    terms = assigner.evaluate(everything)
    fits = terms.overflow_mb <= 1e-9 * max(1.0, sum(assigner.model_sizes))
    return float(terms.total[fits].min()), float(terms.total.mean())


METHODS = ("ours", "ours, iterations=0", "greedy")


def _timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.perf_counter() - wall, time.process_time() - cpu


def run_small(n: int, m: int, instances: int = 8, seeds: int = 3):
    """Per method: list of (cost, fits, optimum, wall s, cpu s); plus mean random/opt."""
    rows: dict[str, list] = {name: [] for name in METHODS}
    random_ratio = []
    for index in range(instances):
        models, conn, specs = make_instance(n, m, index)
        for seed in range(seeds):
            ours, wall, cpu = _timed(lambda: ModelAssigner(
                models, conn, specs, move_models=False, seed=seed))
            no_gd, no_gd_wall, no_gd_cpu = _timed(lambda: ModelAssigner(
                models, conn, specs, move_models=False, seed=seed, iterations=0))
            g, g_wall, g_cpu = _timed(lambda: greedy(ours, conn, specs))
            opt, mean_random = brute_force(ours, n, m)
            for name, rep, t, c in (
                ("ours", ours.report(), wall, cpu),
                ("ours, iterations=0", ours.report(no_gd.assignment), no_gd_wall, no_gd_cpu),
                ("greedy", ours.report(g.tolist()), g_wall, g_cpu),
            ):
                rows[name].append((rep.total, rep.feasible, opt, t, c))
            random_ratio.append(mean_random / opt)
    return rows, random_ratio


def summarise(label: str, rows, random_ratio) -> list[str]:
    lines = []
    ours_time = statistics.mean(r[3] for r in rows["ours"])
    for name, runs in rows.items():
        ratios = [r[0] / r[2] for r in runs if r[1]]
        optimal = sum(1 for x in ratios if x <= 1 + 1e-9)
        within = sum(1 for x in ratios if x <= 1.02)
        t = statistics.mean(r[3] for r in runs)
        c = statistics.mean(r[4] for r in runs)
        lines.append(
            f"{label:<6}{name:<20}{optimal:>4}/{len(runs):<3}{within:>6}/{len(runs):<3}"
            f"{statistics.mean(ratios or [float('nan')]):>10.4f}"
            f"{max(ratios or [float('nan')]):>10.4f}{len(runs) - len(ratios):>7}/{len(runs):<3}"
            f"{1000 * t:>10.2f}{1000 * c:>9.2f}{t / ours_time:>9.3f}"
        )
    lines.append(
        f"{label:<6}{'machin (issue 5)':<20}{0:>4}/{24:<3}{'':>10}{'':>10}{'':>10}"
        f"{'most':>11}{370.0:>10.2f}{'':>9}{0.37 / ours_time:>9.3f}"
    )
    lines.append(
        f"{label:<6}{'random placement':<20}{'':>8}{'':>10}"
        f"{statistics.mean(random_ratio):>10.4f}   (mean cost of all placements / optimum)"
    )
    return lines


def run_large(n: int = 32, m: int = 8, instances: int = 4) -> list[str]:
    lines = [
        f"{'size':<6}{'inst':>5}{'ours s':>9}{'cpu s':>8}{'ours cost':>11}{'greedy cost':>13}"
        f"{'greedy/ours':>13}{'ours fits':>11}{'greedy fits':>13}"
    ]
    for index in range(instances):
        models, conn, specs = make_instance(n, m, index)
        ours, elapsed, cpu = _timed(lambda: ModelAssigner(
            models, conn, specs, move_models=False, seed=0))
        mine = ours.report()
        theirs = ours.report(greedy(ours, conn, specs).tolist())
        lines.append(
            f"{n}x{m:<3}{index:>5}{elapsed:>9.3f}{cpu:>8.3f}{mine.total:>11.4f}{theirs.total:>13.4f}"
            f"{theirs.total / mine.total:>13.3f}{str(mine.feasible):>11}"
            f"{str(theirs.feasible):>13}"
        )
    return lines


def main() -> None:
    print(MACHIN_REFERENCE)
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, numpy {np.__version__}")
    # warm-up: first-call costs (imports, allocator) are not per-assignment costs
    ModelAssigner([nn.Linear(2, 2)], {}, [DeviceSpec("cpu", 10)], move_models=False)
    header = (
        f"{'size':<6}{'method':<20}{'optimal':>8}{'<=2% gap':>10}{'mean c/opt':>10}"
        f"{'max c/opt':>10}{'infeasible':>11}{'wall ms':>10}{'cpu ms':>9}{'t/ours':>9}"
    )
    print(header)
    print("-" * len(header))
    for n, m in ((6, 3), (8, 4)):
        rows, random_ratio = run_small(n, m)
        for line in summarise(f"{n}x{m}", rows, random_ratio):
            print(line)
    print()
    for line in run_large():
        print(line)


if __name__ == "__main__":
    main()
