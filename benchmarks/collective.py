"""CollectiveGroup against the raw torch.distributed calls it wraps, side by side in one run.

Run:  python benchmarks/collective.py [--quick]

Three local ranks over gloo. Each figure is the median time per operation over blocks
that alternate ours and raw on the same process group, so noise hits both alike. The
group adds argument checks and the global-rank mapping of any-source receives; the ratio
shows what that costs (ours / raw, lower is better). On gloo our all_to_all is the
pairwise exchange of sends and receives, not gloo's own alltoall (slower); the
"substitute" row runs what a backend without reduce_scatter gets (one all_reduce) against
the backend's own op, which this torch's gloo has.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist

from machinlike import launch


def _time(op: Callable[[], Any], reps: int) -> float:
    start = time.perf_counter()
    for _ in range(reps):
        op()
    return (time.perf_counter() - start) / reps


def _body(world: Any, quick: bool) -> Dict[str, Dict[str, float]]:
    torch.set_num_threads(1)
    group = world.create_collective_group([0, 1, 2])
    pg = group.group
    blocks, reps = (3, 20) if quick else (9, 50)
    small, big = torch.ones(256), torch.ones(1 << 20)  # 1 KB and 4 MB of float32
    out = [torch.zeros(256) for _ in range(3)]
    piece, pieces = torch.zeros(1 << 18), [torch.ones(1 << 18) for _ in range(3)]  # 1 MB each
    swapped, sent = [torch.zeros(1 << 18) for _ in range(3)], [torch.ones(1 << 18) for _ in range(3)]

    def substitute(op: Callable[[], Any], name: str) -> Callable[[], Any]:
        # What a backend without the op gets (gloo before torch 2.8 for reduce_scatter): the
        # group's substitute, as after the backend's refusal.
        def run() -> Any:
            group._substituted = {name}
            try:
                return op()
            finally:
                group._substituted = None  # (known again at the next call)
        return run

    cases: Dict[str, tuple] = {
        "all_reduce 1 KB": (lambda: group.all_reduce(small), lambda: dist.all_reduce(small, group=pg)),
        "all_reduce 4 MB": (lambda: group.all_reduce(big), lambda: dist.all_reduce(big, group=pg)),
        "broadcast 4 MB": (lambda: group.broadcast(big, src=0), lambda: dist.broadcast(big, 0, group=pg)),
        "all_gather 1 KB": (lambda: group.all_gather(out, small), lambda: dist.all_gather(out, small, group=pg)),
        "barrier": (group.barrier, lambda: dist.barrier(group=pg)),
        "reduce_scatter 3 x 1 MB": (lambda: group.reduce_scatter(piece, pieces),
                                    lambda: dist.reduce_scatter(piece, pieces, group=pg)),
        "reduce_scatter 3 x 1 MB, substitute": (substitute(lambda: group.reduce_scatter(piece, pieces),
                                                           "reducescatter"),
                                                lambda: dist.reduce_scatter(piece, pieces, group=pg)),
        "all_to_all 3 x 1 MB (ours: the exchange)": (lambda: group.all_to_all(swapped, sent),
                                                     lambda: dist.all_to_all(swapped, sent, group=pg)),
    }
    results: Dict[str, Dict[str, float]] = {}
    for name, (ours, raw) in cases.items():
        ours_t: List[float] = []
        raw_t: List[float] = []
        for _ in range(blocks):
            ours_t.append(_time(ours, reps))
            raw_t.append(_time(raw, reps))
        results[name] = {"ours": statistics.median(ours_t), "raw": statistics.median(raw_t)}
    # Point to point: rank 0 receives from any source; the others send.
    msg = torch.ones(256)
    ours_t, raw_t = [], []
    for _ in range(blocks):
        for mine, bucket in ((True, ours_t), (False, raw_t)):
            group.barrier()
            start = time.perf_counter()
            for _ in range(reps):
                if world.rank == 0:
                    for _ in range(2):
                        if mine:
                            group.recv(msg)
                        else:
                            dist.recv(msg, group=pg)
                elif mine:
                    group.send(msg, dst=0)
                else:
                    dist.send(msg, 0, group=pg)
            bucket.append((time.perf_counter() - start) / reps)
    results["any-source recv x2 (rank 0)"] = {"ours": statistics.median(ours_t), "raw": statistics.median(raw_t)}
    group.barrier()
    group.destroy()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    args = parser.parse_args()
    results = launch(_body, 3, args=(args.quick,), timeout=600)[0]
    width = max(len(k) for k in results)
    print(f"{'operation (3 ranks, gloo)':<{width}}  {'raw (us)':>10}  {'ours (us)':>10}  {'ours/raw':>8}")
    for name, r in results.items():
        print(f"{name:<{width}}  {r['raw'] * 1e6:>10.1f}  {r['ours'] * 1e6:>10.1f}  {r['ours'] / r['raw']:>8.2f}")


if __name__ == "__main__":
    main()
