"""Sparse embedding gradients through PushPullGradServer, beside the same model's dense ones.

Run:  python benchmarks/sparse_grad.py [--quick] [--rows N]

The model is what parameter-server training of a recommender looks like: a large
embedding table (``--rows`` x 64 float32; 200,000 rows are 51 MB) and a small MLP on the
looked-up rows. Three local processes: rank 0 hosts the primary reducer, ranks 1 and 2
are trainers, each with a secondary reducer on its own process (pushes reach it without
RPC) that sums 2 pushes and forwards the sum to the primary, which sums 2 of those and
steps SGD (it steps on a sparse gradient as it is).

Each trainer pushes with ``pull=False`` for ``--iterations`` steps, then flushes. The peer
is the same server, the same trainers and the same batches with the table's gradients
dense (``nn.Embedding(sparse=False)``): what a user had before the server took sparse
gradients. Rounds of the two alternate so machine noise hits both; figures are medians.
Printed: pushes per second per trainer, the bytes one push carries, and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List

import torch
from torch import nn

from machinlike import launch
from machinlike.server import PushPullGradServerImpl

TRAINERS = ("1", "2")
BATCH = 256  # lookups per step
DIM = 64


class Recommender(nn.Module):
    """An embedding table and a small MLP on the sum of a sample's looked-up rows."""

    def __init__(self, rows: int, sparse: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.table = nn.EmbeddingBag(rows, DIM, mode="sum", sparse=sparse)
        self.head = nn.Sequential(nn.Linear(DIM, 64), nn.ReLU(), nn.Linear(64, 1))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.table(ids)).squeeze(1)


def _push_bytes(model: nn.Module) -> int:
    total = 0
    for p in model.parameters():
        g = p.grad
        if g.layout == torch.sparse_coo:
            g = g.coalesce()
            total += g.indices().nbytes + g.values().nbytes
        else:
            total += g.nbytes
    return total


def _round(world: Any, group: Any, sparse: bool, index: int, rows: int, iterations: int) -> Dict[str, float]:
    name = f"{'sparse' if sparse else 'dense'}{index}"
    impl = PushPullGradServerImpl(name, group, primary_reducer="0", secondary_reducers=list(TRAINERS),
                                  reduce_batch_size=2, max_queue_size=8)
    if world.name == "0":
        model = Recommender(rows, sparse)
        impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=0.01))
    impl.start()
    group.barrier(timeout=120)
    out: Dict[str, float] = {}
    if world.name in TRAINERS:
        server = group.get_paired(name).to_here()
        model = Recommender(rows, sparse)
        gen = torch.Generator().manual_seed(int(world.name))
        batches = [(torch.randint(0, rows, (BATCH, 4), generator=gen), torch.randn(BATCH, generator=gen))
                   for _ in range(8)]
        server.pull(model)
        refused = 0
        start = time.perf_counter()
        for step in range(iterations):
            ids, target = batches[step % len(batches)]
            model.zero_grad(set_to_none=True)
            nn.functional.mse_loss(model(ids), target).backward()
            if step == 0:
                out["bytes"] = float(_push_bytes(model))
            while not server.push(model, pull=False):  # refused (queue full): the server is behind
                refused += 1
                time.sleep(0.001)
            if step % 8 == 7:
                server.pull(model)
        server.flush(timeout=300)
        out["pushes/s"] = iterations / (time.perf_counter() - start)
        out["refused"] = float(refused)
    group.barrier(timeout=300)
    impl.close()
    group.barrier(timeout=120)
    return out


def _body(world: Any, quick: bool, rows: int, iterations: int) -> Dict[str, List[Dict[str, float]]]:
    torch.set_num_threads(1)
    group = world.create_rpc_group("bench", world.get_members())
    results: Dict[str, List[Dict[str, float]]] = {"sparse": [], "dense": []}
    for index in range(2 if quick else 3):
        for sparse in ((True, False) if index % 2 == 0 else (False, True)):
            results["sparse" if sparse else "dense"].append(_round(world, group, sparse, index, rows, iterations))
    group.destroy()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps and rounds (a smoke run)")
    parser.add_argument("--rows", type=int, default=200_000, help="embedding rows (x 64 float32)")
    args = parser.parse_args()
    iterations = 40 if args.quick else 150
    per_rank = launch(_body, 3, args=(args.quick, args.rows, iterations), timeout=1800, rpc_timeout=300)
    figures = {}
    for kind in ("sparse", "dense"):
        rates = [r["pushes/s"] for rank in TRAINERS for r in per_rank[int(rank)][kind]]
        figures[kind] = (statistics.median(rates), per_rank[1][kind][0]["bytes"],
                         sum(r["refused"] for rank in TRAINERS for r in per_rank[int(rank)][kind]))
    table_mb = args.rows * DIM * 4 / 2 ** 20
    print(f"embedding table {args.rows} x {DIM} float32 ({table_mb:.0f} MB), {BATCH} x 4 lookups per step, "
          f"{iterations} pushes per trainer and round, 2 trainers")
    print(f"{'':34}{'dense (peer)':>14}{'sparse':>14}{'ratio':>8}")
    (sparse_rate, sparse_bytes, sparse_refused), (dense_rate, dense_bytes, dense_refused) = \
        figures["sparse"], figures["dense"]
    print(f"{'pushes/s per trainer (median)':34}{dense_rate:14.1f}{sparse_rate:14.1f}{sparse_rate / dense_rate:7.2f}x")
    print(f"{'bytes per push (MB)':34}{dense_bytes / 2 ** 20:14.2f}{sparse_bytes / 2 ** 20:14.2f}"
          f"{dense_bytes / sparse_bytes:7.1f}x less")
    print(f"{'pushes refused (queue full)':34}{dense_refused:14.0f}{sparse_refused:14.0f}")


if __name__ == "__main__":
    main()
