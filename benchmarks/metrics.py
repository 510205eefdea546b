"""What machinlike.metrics costs a training loop: learner steps/s with and without logging.

Run:  python benchmarks/metrics.py [--quick]

The loop is a learner's update (an MLP forward, backward and Adam step on a batch, one
torch thread as in the examples). "metrics" logs ``--tags`` scalars to TensorBoard and
CSV. Blocks of updates
alternate between the two loops (who goes first swaps), so machine noise hits both alike;
the figure is the median over neighbouring blocks of the with/without time ratio, once
logging every update (the worst case) and once every second (what the examples do). Also
printed: the caller's cost of one ``scalars()`` call, and the points the writer dropped.
Target (issue 23): the examples' throughput drops by at most 2 %.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from typing import Callable, List, Optional

import torch

from machinlike.metrics import Metrics, tensorboard_available


def _learner(width: int, batch: int) -> Callable[[], float]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
                                torch.nn.Tanh(), torch.nn.Linear(width, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(batch, 64), torch.randint(0, 2, (batch,))

    def update() -> float:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return loss.item()

    return update


def _block(update: Callable[[], float], metrics: Optional[Metrics], steps: int, start: int, tags: int,
           every: float) -> float:
    """Seconds for ``steps`` updates, logging ``tags`` scalars each ``every`` seconds (0: each update)."""
    names = [f"learner/figure_{i}" for i in range(tags)]
    begin = last = time.perf_counter()
    for step in range(start, start + steps):
        loss = update()
        if metrics is not None and (every == 0 or time.perf_counter() - last >= every):
            last = time.perf_counter()
            metrics.scalars({name: loss + i for i, name in enumerate(names)}, step)
    return time.perf_counter() - begin


def _compare(update: Callable[[], float], metrics: Metrics, blocks: int, steps: int, tags: int,
             every: float) -> List[List[float]]:
    """Per-block seconds without and with metrics, alternating (who goes first swaps)."""
    plain: List[float] = []
    logged: List[float] = []
    step = 0
    for i in range(blocks):
        order = [(None, plain), (metrics, logged)] if i % 2 == 0 else [(metrics, logged), (None, plain)]
        for writer, out in order:
            out.append(_block(update, writer, steps, step, tags, every))
            step += steps
    return [plain, logged]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer blocks (a smoke run)")
    parser.add_argument("--tags", type=int, default=20, help="scalars logged per update (default 20)")
    parser.add_argument("--width", type=int, default=256, help="hidden units of the MLP (default 256)")
    parser.add_argument("--batch", type=int, default=256, help="batch of an update (default 256)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    blocks, steps = (6, 100) if args.quick else (20, 200)
    update = _learner(args.width, args.batch)
    sinks = ["csv", "tensorboard"] if tensorboard_available() else ["csv"]
    with tempfile.TemporaryDirectory() as logdir:
        metrics = Metrics(logdir, sinks=sinks)
        _block(update, metrics, steps // 4, 0, args.tags, 0.0)  # warm both paths up
        _block(update, None, steps // 4, 0, args.tags, 0.0)
        results = {every: _compare(update, metrics, blocks, steps, args.tags, every) for every in (0.0, 1.0)}
        metrics.flush(timeout=60)
        # The caller's side alone: a tight loop of scalars() calls, no learner.
        calls = 2000
        values = {f"learner/figure_{i}": float(i) for i in range(args.tags)}
        begin = time.perf_counter()
        for n in range(calls):
            metrics.scalars(values, n)
        per_call = (time.perf_counter() - begin) / calls
        metrics.close(timeout=120)
        dropped = metrics.dropped
    print(f"sinks {'+'.join(sinks)}; {args.tags} scalars a point; {blocks} blocks of {steps} updates each way "
          f"(MLP 64-{args.width}-{args.width}-2, batch {args.batch}, 1 torch thread)")
    for every, (plain, logged) in results.items():
        ratio = statistics.median(w / p for w, p in zip(logged, plain))
        print(f"  logging {'every update' if every == 0 else f'every {every:g} s (as the examples)'}:")
        print(f"    updates/s without metrics    {steps / statistics.median(plain):10.1f}")
        print(f"    updates/s with metrics       {steps / statistics.median(logged):10.1f}")
        print(f"    slowdown (median block ratio) {100 * (ratio - 1):+8.2f} %" +
              ("   target <= +2 %" if every else ""))
    print(f"  scalars() of {args.tags} tags, caller  {per_call * 1e6:9.1f} us  "
          f"({per_call * 1e6 / args.tags:.2f} us a point)")
    print(f"  points dropped                 {dropped:10d}")


if __name__ == "__main__":
    main()
