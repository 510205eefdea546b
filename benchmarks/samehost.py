"""Same-host tensors through shared memory against TensorPipe and the machine's limits, in one run.

Run:  python benchmarks/samehost.py [--quick]

Every rank runs torch with one intra-op thread (the processes share the machine's
cores; both contenders get the same setting). Prints, side by side (issue 14's targets in the last column):

* the machine: a warm 64 MB memcpy and a fresh 64 MB allocation plus copy (GB/s), the
  physical bounds everything below is read against;
* RPC, two local processes over the same agent, blocks alternated so that noise hits
  both: a 64 MB echo through ``registered_sync`` against raw ``rpc_sync``; the same with
  a tensor shared explicitly (``share()``); lists of many tensors (200 frames of 64 KB,
  1,000 transitions) echoed and returned by a service (a replay sample); lists of plain
  Python data (a million floats, 200k tuples) echoed; one frame expanded 256 times (64 MB
  to look at, 256 KB distinct: both sides should send the 256 KB); a dataclass batch
  (16 MB of observations, small actions and rewards); a module with its Adam optimizer
  (48 MB: weights and moments); a no-op ``registered_sync``
  against raw (the size check must not tax small calls); and the same world with
  ``same_host_shm=False`` for the 64 MB echo (what TensorPipe alone gives);
* the model server: two actors pull a 64 MB model at once through
  ``PushPullModelServer.pull`` against raw ``rpc_sync`` calls returning the state dict
  (load into the model included in both);
* pools: a fresh 256 MB tensor through a copy-mode ``Pool`` whose worker returns its sum
  (GB/s, and against a warm memcpy measured just before), and an already-shared 256 MB
  tensor through a share-mode pool (ms beyond the worker's compute, median and max of 20);
* numpy arrays (observations, replay batches): a 64 MB array echoed through
  ``registered_sync`` against raw ``rpc_sync``, and sent to a ``Pool`` worker that sums
  it against the standard library's ``multiprocessing`` pool (both spawn their workers);
  the same two pools for a list of 200 x 64 KB tensors to a worker, and for 1,000
  (observation, reward) namedtuples a worker returns.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import numpy as np
import torch
from torch import nn
from torch.distributed import rpc

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [BENCH_DIR, os.path.dirname(BENCH_DIR)]

from _pool_tasks import steps, timed_sum  # noqa: E402

from machinlike import launch  # noqa: E402
from machinlike.distributed import share  # noqa: E402
from machinlike.pool import Pool  # noqa: E402

MB = 1 << 20


def echo(x: Any) -> Any:
    return x


_batches: Dict[str, Any] = {}


def batch(kind: str) -> Any:
    """A replay sample as a list: 200 frames of 64 KB, or 1,000 small transitions."""
    if kind not in _batches:
        _batches[kind] = many(kind)
    return _batches[kind]


def many(kind: str) -> Any:
    if kind == "frames":
        return [torch.rand(16384) for _ in range(200)]
    if kind == "rewards":  # plain Python data: nothing to put through shared memory
        return [float(i) for i in range(1_000_000)]
    if kind == "steps":
        return [(i, 0.5, False) for i in range(200_000)]
    if kind == "dataclass":  # a learner's batch as RL code writes it: 16 MB of observations
        return Sample(torch.rand(4096, 1024), torch.randint(0, 6, (4096,)), torch.rand(4096))
    if kind == "model":  # a module and its optimizer, a step taken: 16 MB of weights, 32 MB of moments
        model = torch.nn.Linear(2048, 2048)
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.rand(2, 2048)).sum().backward()
        optimizer.step()
        return model, optimizer
    return [{"obs": torch.rand(8), "action": 1, "reward": 0.5, "next_obs": torch.rand(8)} for _ in range(1000)]


@dataclasses.dataclass
class Sample:
    obs: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor


def noop() -> None:
    return None


def machine(nbytes: int, reps: int) -> Dict[str, float]:
    """Warm memcpy and fresh allocation + copy, GB/s (medians)."""
    src = torch.rand(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)
    warm, fresh = [], []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        warm.append(time.perf_counter() - start)
        start = time.perf_counter()
        new = torch.empty_like(src)
        new.copy_(src)
        fresh.append(time.perf_counter() - start)
        del new
    return {"warm": nbytes / 1e9 / statistics.median(warm), "fresh": nbytes / 1e9 / statistics.median(fresh)}


# Rank 0 times everything while the others serve; its full run takes minutes on two cores,
# past the world's 60 s dist_timeout that a barrier uses by default.
WAIT_FOR_RANK0 = 900.0


def _collected() -> None:
    """Collect garbage here and in the callee (rank 1)."""
    gc.collect()
    rpc.rpc_sync("1", gc.collect)


def _alternate(raw: Callable[[], Any], ours: Callable[[], Any], calls: int, blocks: int) -> Dict[str, float]:
    times: Dict[str, List[float]] = {"raw": [], "ours": []}
    for _ in range(blocks):
        for name, fn in (("raw", raw), ("ours", ours)):
            # Each block starts from a collected heap on both sides: a full collection
            # (130-190 ms in a process that imported torch) otherwise falls in whichever
            # block crosses the collector's threshold, often set off by the other
            # contender's garbage (troubleshooting: "A call takes a hundred milliseconds").
            _collected()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[name].append((time.perf_counter() - start) / calls)
    return {k: statistics.median(v) for k, v in times.items()}


def make_model() -> nn.Module:
    """16 linear layers of 1024 x 1024 float32: 64 MB of weights (plus small biases)."""
    return nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(16)])


_model: Dict[str, nn.Module] = {}


def state_dict() -> Dict[str, torch.Tensor]:
    return _model["m"].state_dict()


def _rpc_body(world: Any, quick: bool) -> Dict[str, Any]:
    from machinlike.server import PushPullModelServerImpl

    torch.set_num_threads(1)  # processes share the cores; both contenders alike
    group = world.create_rpc_group("bench", world.get_members())
    if world.rank == 1:
        group.register("echo", echo)
        group.register("noop", noop)
        group.register("batch", batch)
    if world.rank == 0:
        _model["m"] = make_model()
        PushPullModelServerImpl("server", group)
    group.barrier()
    results: Dict[str, Any] = {}
    blocks = 3 if quick else 7
    if world.rank == 0 and world.world_size == 2:
        tensor = torch.rand(16 * MB)  # 64 MB
        for _ in range(3):
            group.registered_sync("echo", (tensor,))
            rpc.rpc_sync("1", echo, args=(tensor,))
        results["echo"] = _alternate(lambda: rpc.rpc_sync("1", echo, args=(tensor,)),
                                     lambda: group.registered_sync("echo", (tensor,)), 2, blocks)
        shared = share(tensor.clone())
        group.registered_sync("echo", (shared,))
        results["shared"] = _alternate(lambda: rpc.rpc_sync("1", echo, args=(tensor,)),
                                       lambda: group.registered_sync("echo", (shared,)), 2, blocks)
        array = tensor.numpy().copy()
        for _ in range(2):
            group.registered_sync("echo", (array,))
            rpc.rpc_sync("1", echo, args=(array,))
        results["numpy"] = _alternate(lambda: rpc.rpc_sync("1", echo, args=(array,)),
                                      lambda: group.registered_sync("echo", (array,)), 2, blocks)
        # One frame expanded 256 times (an initial frame stack): 64 MB to look at, 256 KB distinct.
        stack = torch.rand(1, 64 * 1024).expand(256, -1)
        for _ in range(3):
            group.registered_sync("echo", (stack,))
            rpc.rpc_sync("1", echo, args=(stack,))
        results["expanded"] = _alternate(lambda: rpc.rpc_sync("1", echo, args=(stack,)),
                                         lambda: group.registered_sync("echo", (stack,)), 5, blocks)
        for kind in ("frames", "transitions", "rewards", "steps", "dataclass", "model"):  # both ways, and as a reply
            items = many(kind)
            for _ in range(3):
                group.registered_sync("echo", (items,))
                rpc.rpc_sync("1", echo, args=(items,))
                group.registered_sync("batch", (kind,))
                rpc.rpc_sync("1", batch, args=(kind,))
            results[f"echo_{kind}"] = _alternate(lambda: rpc.rpc_sync("1", echo, args=(items,)),
                                                 lambda: group.registered_sync("echo", (items,)), 5, blocks)
            results[f"batch_{kind}"] = _alternate(lambda: rpc.rpc_sync("1", batch, args=(kind,)),
                                                  lambda: group.registered_sync("batch", (kind,)), 5, blocks)
        for _ in range(50):
            rpc.rpc_sync("1", noop)
            group.registered_sync("noop")
        results["small"] = _alternate(lambda: rpc.rpc_sync("1", noop), lambda: group.registered_sync("noop"),
                                      100 if quick else 300, blocks * 2)
    if world.world_size == 3:
        group.barrier()
        if world.rank != 0:
            server = group.get_paired("server").to_here()
            if world.rank == 1:
                server.push(make_model())
            group.barrier()
            model = make_model()
            pulls: Dict[str, List[float]] = {"raw": [], "ours": []}
            for _ in range(blocks * 2):
                for name in ("raw", "ours"):
                    group.barrier()  # both actors pull at once
                    start = time.perf_counter()
                    if name == "raw":
                        model.load_state_dict(rpc.rpc_sync("0", state_dict))
                    else:
                        model.pp_version = None
                        server.pull(model)
                    pulls[name].append(time.perf_counter() - start)
            results["pull"] = {k: statistics.median(v) for k, v in pulls.items()}
        else:
            group.barrier()
            for _ in range(blocks * 4):
                group.barrier()
    group.barrier(timeout=WAIT_FOR_RANK0)  # the other ranks wait out rank 0's whole run
    return results


def _off_body(world: Any, quick: bool) -> Dict[str, Any]:
    torch.set_num_threads(1)
    group = world.create_rpc_group("bench", world.get_members())
    if world.rank == 1:
        group.register("echo", echo)
    group.barrier()
    results: Dict[str, Any] = {}
    if world.rank == 0:
        tensor = torch.rand(16 * MB)
        for _ in range(3):
            group.registered_sync("echo", (tensor,))
        results["echo"] = _alternate(lambda: rpc.rpc_sync("1", echo, args=(tensor,)),
                                     lambda: group.registered_sync("echo", (tensor,)), 2, 3 if quick else 7)
    group.barrier(timeout=WAIT_FOR_RANK0)
    return results


def pools(reps: int) -> Dict[str, float]:
    numel = 64 * MB  # 256 MB of float32
    out: Dict[str, float] = {}
    with Pool(2) as pool:
        pool.apply(timed_sum, (torch.rand(numel),))
        times = []
        for _ in range(reps):
            tensor = torch.rand(numel)
            start = time.perf_counter()
            pool.apply(timed_sum, (tensor,))
            times.append(time.perf_counter() - start)
            del tensor
        out["copy"] = numel * 4 / 1e9 / statistics.median(times)
    out["memcpy"] = machine(numel * 4, 3)["warm"]
    with Pool(2, is_copy_tensor=False, share_method="cpu") as pool:
        tensor = torch.rand(numel)
        pool.apply(timed_sum, (tensor,))  # the first trip moves it into shared memory
        extra = []
        for _ in range(20):
            start = time.perf_counter()
            _, compute = pool.apply(timed_sum, (tensor,))
            extra.append(time.perf_counter() - start - compute)
        out["shared_median"] = statistics.median(extra) * 1e3
        out["shared_max"] = max(extra) * 1e3
    array = np.random.default_rng(0).random(8 * MB)  # 64 MB of float64
    import multiprocessing

    for name, make in (("numpy_stdlib", lambda: multiprocessing.get_context("spawn").Pool(2)),
                       ("numpy_ours", lambda: Pool(2))):
        with make() as pool:
            pool.apply(np.sum, (array,))
            start = time.perf_counter()
            for _ in range(reps):
                pool.apply(np.sum, (array,))
            out[name] = array.nbytes / 1e9 / ((time.perf_counter() - start) / reps)
    frames = many("frames")  # a list of 200 x 64 KB tensors to a worker (ms)
    for name, make in (("frames_stdlib", lambda: multiprocessing.get_context("spawn").Pool(1)),
                       ("frames_ours", lambda: Pool(1))):
        with make() as pool:
            pool.apply(len, (frames,))
            times = []
            for _ in range(reps * 3):
                start = time.perf_counter()
                pool.apply(len, (frames,))
                times.append(time.perf_counter() - start)
            out[name] = statistics.median(times) * 1e3
    for name, make in (("steps_stdlib", lambda: multiprocessing.get_context("spawn").Pool(1)),
                       ("steps_ours", lambda: Pool(1))):  # 1,000 namedtuples of small tensors back
        with make() as pool:
            pool.apply(steps, (1000,))
            times = []
            for _ in range(reps * 3):
                start = time.perf_counter()
                pool.apply(steps, (1000,))
                times.append(time.perf_counter() - start)
            out[name] = statistics.median(times) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    args = parser.parse_args()
    mach = machine(64 * MB, 5)
    two = launch(_rpc_body, 2, args=(args.quick,), timeout=600)[0]
    off = launch(_off_body, 2, args=(args.quick,), timeout=600, same_host_shm=False)[0]
    three = launch(_rpc_body, 3, args=(args.quick,), timeout=600)
    pull = {k: max(r["pull"][k] for r in three[1:]) for k in ("raw", "ours")}  # the slower actor
    pool = pools(3 if args.quick else 5)

    gb = 128 / 1024  # 64 MB there and back, in GB (2^30)
    rows = [
        ("machine: warm memcpy 64 MB (GB/s)", "-", f"{mach['warm']:.2f}", "-", ""),
        ("machine: fresh allocation + copy 64 MB (GB/s)", "-", f"{mach['fresh']:.2f}", "-", ""),
        ("64 MB echo, registered_sync (GB/s)", f"{gb / two['echo']['raw']:.2f}", f"{gb / two['echo']['ours']:.2f}",
         f"{two['echo']['raw'] / two['echo']['ours']:.2f}x", ">= 3x"),
        ("64 MB echo, explicitly shared (GB/s)", f"{gb / two['shared']['raw']:.2f}",
         f"{gb / two['shared']['ours']:.2f}", f"{two['shared']['raw'] / two['shared']['ours']:.2f}x", ">= 10x"),
        ("64 MB echo, same_host_shm=False (GB/s)", f"{gb / off['echo']['raw']:.2f}", f"{gb / off['echo']['ours']:.2f}",
         f"{off['echo']['raw'] / off['echo']['ours']:.2f}x", "(TensorPipe)"),
        ("no-op registered_sync (us)", f"{two['small']['raw'] * 1e6:.0f}", f"{two['small']['ours'] * 1e6:.0f}",
         f"{two['small']['ours'] / two['small']['raw']:.2f}", "<= 1.05"),
        ("model server pull of 64 MB, 2 actors at once (ms)", f"{pull['raw'] * 1e3:.1f}", f"{pull['ours'] * 1e3:.1f}",
         f"{pull['raw'] / pull['ours']:.2f}x", ">= 2.5x"),
        ("pool copy mode, fresh 256 MB round trip (GB/s)", f"{pool['memcpy']:.2f} (memcpy)", f"{pool['copy']:.2f}",
         f"{pool['copy'] / pool['memcpy']:.2f}", ">= 3 GB/s, >= 0.4"),
        ("pool share mode, shared 256 MB, ms beyond compute", "-",
         f"{pool['shared_median']:.2f} / {pool['shared_max']:.2f}", "-", "<= 2 / <= 3 (median / max)"),
        ("64 MB numpy echo, registered_sync (GB/s)", f"{gb / two['numpy']['raw']:.2f}",
         f"{gb / two['numpy']['ours']:.2f}", f"{two['numpy']['raw'] / two['numpy']['ours']:.2f}x", ""),
        *[(f"{what} (ms)", f"{two[key]['raw'] * 1e3:.1f}", f"{two[key]['ours'] * 1e3:.1f}",
           f"{two[key]['raw'] / two[key]['ours']:.2f}x", "")
          for key, what in (("echo_frames", "echo of a list of 200 x 64 KB tensors"),
                            ("batch_frames", "reply of a list of 200 x 64 KB tensors"),
                            ("echo_transitions", "echo of 1,000 transitions (dicts of 2 small tensors)"),
                            ("batch_transitions", "reply of 1,000 transitions"),
                            ("echo_rewards", "echo of a list of 1,000,000 floats"),
                            ("echo_steps", "echo of a list of 200,000 (int, float, bool) tuples"),
                            ("echo_dataclass", "echo of a dataclass batch (16 MB of observations)"),
                            ("echo_model", "echo of a module and its Adam optimizer (48 MB)"),
                            ("expanded", "echo of one 256 KB frame expanded 256 times"))],
        ("pool, 64 MB numpy array to a worker (GB/s)", f"{pool['numpy_stdlib']:.2f} (stdlib)",
         f"{pool['numpy_ours']:.2f}", f"{pool['numpy_ours'] / pool['numpy_stdlib']:.2f}x", ""),
        ("pool, list of 200 x 64 KB tensors to a worker (ms)", f"{pool['frames_stdlib']:.1f} (stdlib)",
         f"{pool['frames_ours']:.1f}", f"{pool['frames_stdlib'] / pool['frames_ours']:.2f}x", ""),
        ("pool, 1,000 (obs, reward) namedtuples from a worker (ms)", f"{pool['steps_stdlib']:.1f} (stdlib)",
         f"{pool['steps_ours']:.1f}", f"{pool['steps_stdlib'] / pool['steps_ours']:.2f}x", ""),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'peer':>16}  {'machinlike':>14}  {'ratio':>7}  target")
    for name, peer, ours, ratio, target in rows:
        print(f"{name:<{width}}  {peer:>16}  {ours:>14}  {ratio:>7}  {target}")
    print("peer: raw torch rpc_sync (TensorPipe) on the same agent; for the pool, a warm memcpy of 256 MB, "
          "for numpy arrays in a pool, multiprocessing.Pool")
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
