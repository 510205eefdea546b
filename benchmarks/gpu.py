"""CUDA paths of machinlike against raw torch, side by side in one run (one command on a GPU).

Run:  python benchmarks/gpu.py [--quick]

On a machine without CUDA it prints "no GPU" and exits 0. With one GPU (two or more
processes on cuda:0) it measures:

1. A 64 MB CUDA tensor echoed (there and back) to another process:
   - raw torch RPC with a device map written by hand ({cuda:0: cuda:0}), the baseline;
   - raw torch RPC staging through the CPU (``.cpu()`` before sending, ``.cuda()`` after);
   - machinlike's ``registered_sync`` with the CUDA tensor as argument: staged through
     pinned CPU memory both ways (``distributed._calls.cuda_stage``), so expect about the CPU
     staging rate (pinned) until device maps or CUDA IPC carry it; an error is shown.
   Targets: ``registered_sync`` >= 0.6x the hand-mapped rate and >= 50x CPU staging.
2. The model server: push and pull of a 512 MB model on cuda:0 (the client) through a
   host process (target: >= 10x the 0.6 GB/s measured when it staged through the CPU).
3. The pool: a 512 MB CUDA tensor to a worker and back, ``share_method="cuda"`` (CUDA
   IPC; the worker returns the tensor it received) against copy mode.

Figures are medians over repetitions; every CUDA timing synchronises the device first.
"""

from __future__ import annotations

import argparse
import multiprocessing
import socket
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed import rpc

ECHO_MB = 64
MODEL_MB = 512


# ---------------------------------------------------------------- shared helpers
def echo(x: Any) -> Any:
    return x


def echo_via_gpu(x: torch.Tensor) -> torch.Tensor:
    """The staged callee: takes a CPU copy to its GPU and sends a CPU copy back."""
    return x.cuda().cpu()


def touch(x: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    return x


def _median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


# ---------------------------------------------------------------- 1a. raw torch RPC
def _raw_worker(rank: int, port: int, repeats: int, out: Any) -> None:
    torch.cuda.set_device(0)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=16,
                                              rpc_timeout=120)
    if rank == 0:
        options.set_device_map("1", {0: 0})  # the hand-written map a user of raw torch writes
    rpc.init_rpc(str(rank), rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        tensor = torch.ones(ECHO_MB * 1024 * 1024 // 4, device="cuda")
        mapped = _median_seconds(lambda: rpc.rpc_sync("1", echo, args=(tensor,)), repeats)
        staged = _median_seconds(lambda: rpc.rpc_sync("1", echo_via_gpu, args=(tensor.cpu(),)).cuda(), repeats)
        out.put({"mapped": mapped, "staged": staged})
    rpc.shutdown()


def raw_echo(repeats: int) -> Dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_raw_worker, args=(rank, port, repeats, out)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(600)
        if proc.is_alive():
            proc.kill()
            raise TimeoutError("the raw torch RPC echo did not finish in 600 s")
        if proc.exitcode != 0:
            raise RuntimeError(f"a raw torch RPC process exited with {proc.exitcode}")
    return out.get()


# ---------------------------------------------------------------- 1b, 2. machinlike
class _Big(nn.Module):
    def __init__(self, megabytes: int, device: str) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(megabytes * 1024 * 1024 // 4, device=device))


def _machinlike_body(world: Any, repeats: int) -> Dict[str, Any]:
    from machinlike.server import PushPullModelServerImpl

    torch.cuda.set_device(0)
    group = world.create_rpc_group("gpu_bench", world.get_members())
    impl = None
    if world.rank == 1:
        group.register("echo", echo)
        group.register("echo_via_gpu", echo_via_gpu)
        impl = PushPullModelServerImpl("model", group)
    group.barrier()
    results: Dict[str, Any] = {}
    if world.rank == 0:
        tensor = torch.ones(ECHO_MB * 1024 * 1024 // 4, device="cuda")
        try:
            results["echo"] = _median_seconds(lambda: group.registered_sync("echo", (tensor,)), repeats)
        except Exception as err:  # a CUDA path that fails: the row says why
            results["echo_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:110]}"
        results["echo_staged"] = _median_seconds(
            lambda: group.registered_sync("echo_via_gpu", (tensor.cpu(),)).cuda(), repeats)

        server = group.get_paired("model").to_here()
        pusher, behind = _Big(MODEL_MB, "cuda"), _Big(MODEL_MB, "cuda")

        def push() -> None:
            assert server.push(pusher)

        def pull() -> None:
            object.__setattr__(behind, "pp_version", -1)  # always behind: the pull must transfer
            assert server.pull(behind)

        results["push"] = _median_seconds(push, repeats, warmup=1)
        results["pull"] = _median_seconds(pull, repeats, warmup=1)
    group.barrier()
    if impl is not None:
        impl.close()
    group.barrier()
    group.destroy()
    return results


# ---------------------------------------------------------------- 3. the pool
def pool_round_trips(repeats: int) -> Dict[str, float]:
    from machinlike.pool import Pool

    tensor = torch.zeros(MODEL_MB * 1024 * 1024 // 4, device="cuda")
    out: Dict[str, float] = {}
    for label, kwargs in (("share", {"is_copy_tensor": False, "share_method": "cuda"}), ("copy", {})):
        with Pool(1, **kwargs) as pool:
            out[label] = _median_seconds(lambda: pool.apply(touch, (tensor,)), repeats)
    return out


# ---------------------------------------------------------------- driver
def _rate(megabytes: float, seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{megabytes / 1024 / seconds:8.2f} GB/s"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: benchmarks/gpu.py measures CUDA paths and has nothing to measure here")
        return 0
    from machinlike import launch

    repeats = 3 if args.quick else 10
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    raw = raw_echo(repeats)
    ours = launch(_machinlike_body, 2, args=(repeats,), timeout=600, rpc_timeout=120)[0]
    pool = pool_round_trips(repeats)

    moved = 2 * ECHO_MB  # there and back
    rows: List[Tuple[str, str, str, str, str]] = []
    if "echo" in ours:
        ratio = raw["mapped"] / ours["echo"]
        echo_ours = _rate(moved, ours["echo"])
        check = f"{ratio:.2f}x raw (>= 0.6), {ours['echo_staged'] / ours['echo']:.0f}x staged (>= 50)"
    else:
        echo_ours, check = "fails", ours["echo_error"]
    rows.append((f"{ECHO_MB} MB CUDA echo", echo_ours, _rate(moved, raw["mapped"]), _rate(moved, raw["staged"]),
                 check))
    rows.append((f"{ECHO_MB} MB echo, staged by hand through RpcGroup", _rate(moved, ours["echo_staged"]), "-",
                 _rate(moved, raw["staged"]), ""))
    for kind in ("push", "pull"):
        gbps = MODEL_MB / 1024 / ours[kind]
        rows.append((f"model server {kind}, {MODEL_MB} MB CUDA model", _rate(MODEL_MB, ours[kind]), "-", "-",
                     f"{gbps / 0.6:.1f}x the 0.6 GB/s of CPU staging (>= 10)"))
    rows.append((f"pool apply, {MODEL_MB} MB CUDA tensor there and back", _rate(2 * MODEL_MB, pool["share"]),
                 "-", _rate(2 * MODEL_MB, pool["copy"]), "share_method='cuda' vs copy mode (right)"))

    head = ("what", "machinlike", "raw torch, hand map", "CPU staging", "against the target")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(5)]
    for row in [head] + rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
