"""The batched inference server: its round trip against a raw service call, and batching
under concurrent callers against each caller running the policy itself.

Run:  python benchmarks/inference.py [--quick] [--callers N]

Part 1 (two ranks pinned to a core each, as benchmarks/rpc.py): a no-op ``infer`` of one
row against ``registered_sync`` of a service returning its argument, in alternating
blocks over the same RPC agent; the ratio is the median of neighbouring blocks' ratios
(target <= 1.1). Then 16 Atari frames (16x4x84x84 bytes) both ways, ``infer`` with
the shared-memory path off (``shm_threshold=None``: TensorPipe carries them), and a lone
caller at the default ``max_wait`` against ``max_wait=0`` (target about 1: it need not
wait for company it never has).

Part 2 (a host and ``--callers`` caller processes on this machine's cores): each caller
calls a Nature-CNN policy on R rows (R = 1, then 16) in a loop for a few seconds; the
figure is observations per second over all callers, with the server's mean batch and
p95 queue wait. The same callers then run the CNN themselves (local inference, one
thread each), for the comparison central inference must win to be worth it.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List

import torch
from torch import nn

from _pin import pin_to_core
from machinlike import launch
from machinlike.server import InferenceServerImpl


def ident(x: Any) -> Any:
    return x


def nature_cnn() -> nn.Module:
    """The DQN Nature network over 4 stacked 84x84 frames (uint8), 6 actions."""
    torch.manual_seed(0)
    return nn.Sequential(
        _Scale(),
        nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
        nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512), nn.ReLU(),
        nn.Linear(512, 6))


class _Scale(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.float() / 255.0


def _block(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _paired(raw: Callable[[], Any], ours: Callable[[], Any], calls: int, blocks: int) -> Dict[str, float]:
    raw_t, ours_t = [], []
    for i in range(blocks):  # alternate who goes first, so that noise hits both alike
        if i % 2 == 0:
            raw_t.append(_block(raw, calls))
            ours_t.append(_block(ours, calls))
        else:
            ours_t.append(_block(ours, calls))
            raw_t.append(_block(raw, calls))
    ratio = statistics.median(o / r for o, r in zip(ours_t, raw_t))
    return {"raw": statistics.median(raw_t), "ours": statistics.median(ours_t), "ratio": ratio}


def _round_trips(world: Any, quick: bool) -> Dict[str, Any]:
    torch.set_num_threads(1)  # a copy split over two threads spins on a busy machine
    if world.rank < 2:
        pin_to_core(world.rank)
    group = world.create_rpc_group("rt", world.get_members())
    if world.rank == 1:
        group.register("echo", ident)
        servers = [InferenceServerImpl("noop", group, ident, max_wait=0.0),
                   InferenceServerImpl("noshm", group, ident, max_wait=0.0, shm_threshold=None),
                   InferenceServerImpl("waits", group, ident)]  # the default max_wait (2 ms)
    group.barrier()
    out: Dict[str, Any] = {}
    if world.rank == 0:
        noop, noshm = group.get_paired("noop").to_here(), group.get_paired("noshm").to_here()
        row = torch.zeros(1, 4)
        for _ in range(100):  # warm connections, caches and segments
            group.registered_sync("echo", (row,))
            noop.infer(row)
        calls, blocks = (100, 9) if quick else (300, 21)
        out["noop"] = _paired(lambda: group.registered_sync("echo", (row,)), lambda: noop.infer(row), calls, blocks)
        # A lone caller at the default max_wait: its batches need not wait for company it
        # never has (the first call waits, then the host knows who comes; _inference.company).
        waits = group.get_paired("waits").to_here()
        waits.infer(row)
        out["lone"] = _paired(lambda: noop.infer(row), lambda: waits.infer(row), calls, blocks)
        frames = torch.randint(0, 255, (16, 4, 84, 84), dtype=torch.uint8)
        for _ in range(20):
            noop.infer(frames)
            noshm.infer(frames)
        calls, blocks = (20, 7) if quick else (50, 15)
        out["frames"] = _paired(lambda: group.registered_sync("echo", (frames,)), lambda: noop.infer(frames),
                                calls, blocks)
        out["frames_noshm"] = _paired(lambda: noshm.infer(frames), lambda: noop.infer(frames), calls, blocks)
    group.barrier(timeout=1200)  # the measurements take minutes on a busy machine
    if world.rank == 1:
        for server in servers:
            server.close()
    return out


def _throughput(world: Any, seconds: float, rows_list: List[int]) -> Dict[str, Any]:
    torch.set_num_threads(1)
    group = world.create_rpc_group("tp", world.get_members())
    if world.rank == 0:
        impl = InferenceServerImpl("cnn", group, nature_cnn(), max_batch=64, max_wait=0.002)
    group.barrier()
    out: Dict[str, Any] = {}
    server = group.get_paired("cnn").to_here()
    local = nature_cnn()
    for rows in rows_list:
        frames = torch.randint(0, 255, (rows, 4, 84, 84), dtype=torch.uint8)
        for mode in ("central", "local"):
            if world.rank != 0:
                call = (lambda: server.infer(frames)) if mode == "central" else (lambda: local(frames))
                with torch.no_grad():
                    call()
            group.barrier()
            before = impl.stats() if world.rank == 0 else None
            done = 0
            start = time.perf_counter()
            if world.rank != 0:
                with torch.no_grad():
                    while time.perf_counter() - start < seconds:
                        call()
                        done += rows
            group.barrier(timeout=600)
            took = time.perf_counter() - start
            if world.rank == 0:
                stats = impl.stats()
                batches = stats["batches"] - before["batches"]
                out[(rows, mode)] = {"batch": (stats["rows"] - before["rows"]) / batches if batches else 0.0,
                                     "wait_p95": stats["queue_wait_p95"], "fn_p95": stats["fn_time_p95"],
                                     "took": took}
            else:
                out[(rows, mode)] = {"rows": done, "took": took}
    group.barrier()
    if world.rank == 0:
        impl.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer, shorter blocks")
    parser.add_argument("--callers", type=int, default=4, help="caller processes in part 2")
    args = parser.parse_args()
    rt = launch(_round_trips, 2, args=(args.quick,), timeout=600)[0]
    print("part 1: round trips, caller and host pinned to a core each")
    for name, what in (("noop", "no-op infer (1x4 floats) vs registered_sync echo"),
                       ("frames", "16 frames (16x4x84x84 uint8) infer vs registered_sync echo"),
                       ("frames_noshm", "16 frames infer, shared memory vs TensorPipe"),
                       ("lone", "lone caller, default max_wait (2 ms) vs max_wait=0")):
        r = rt[name]
        print(f"  {what:60s} raw {r['raw'] * 1e6:8.1f} us  ours {r['ours'] * 1e6:8.1f} us  ratio {r['ratio']:.2f}")
    seconds = 2.0 if args.quick else 5.0
    results = launch(_throughput, args.callers + 1, args=(seconds, [1, 16]), timeout=900)
    host, callers = results[0], results[1:]
    print(f"part 2: {args.callers} callers and a host on {torch.get_num_threads()}-thread torch, "
          f"Nature CNN, {seconds:g} s each")
    for key in sorted(host):
        rows, mode = key
        total = sum(c[key]["rows"] for c in callers)
        took = max(c[key]["took"] for c in callers)
        line = f"  {rows:2d} rows per call  {mode:7s} {total / took:8.0f} obs/s"
        if mode == "central":
            h = host[key]
            line += f"  mean batch {h['batch']:5.1f}  queue wait p95 {1e3 * (h['wait_p95'] or 0):.2f} ms"
        print(line)
    ratio = rt["noop"]["ratio"]
    print(f"inference: no-op infer / registered_sync {ratio:.2f} (target <= 1.1)")


if __name__ == "__main__":
    main()
