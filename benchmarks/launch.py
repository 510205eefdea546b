"""Start-up of a 4-rank job: the local launcher vs Ray actors vs torchrun, side by side in one run.

Run:  python benchmarks/launch.py [--quick] [--ranks 4]

Measured: the wall-clock time from the launch call until every rank has made its first
successful RPC to every other rank (the job is usable), and until the call returned (the
job is over: worlds stopped, processes reaped). Each contender runs the same rank function:

- local:    ``machinlike.launch(fn, N)``: warm-forkserver children, the parent hosts the store;
- ray:      ``machinlike.launch_ray(fn, N)`` on a Ray instance started once beforehand (its
            own start-up, ``ray.init``, is printed apart: a cluster is usually running already);
- torchrun: ``torchrun --standalone --nproc-per-node N`` of a script whose ``launch`` runs in
            place (from the ``torchrun`` command, as a user starts it, interpreter start included).

Rounds alternate the contenders so that machine noise hits all alike; figures are
medians. Ratios are contender / local (> 1: slower than the local launcher).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Dict, List

import torch.distributed.rpc as rpc

import machinlike


def first_rpc(world: Any) -> float:
    """Every rank calls every other once (a builtin, importable anywhere); when it was done."""
    for peer in world.get_members():
        if peer != world.name:
            rpc.rpc_sync(peer, os.getpid)
    return time.time()


def _local(ranks: int) -> Dict[str, float]:
    start = time.time()
    stamps = machinlike.launch(first_rpc, ranks, timeout=120)
    return {"usable": max(stamps) - start, "total": time.time() - start}


def _ray(ranks: int) -> Dict[str, float]:
    start = time.time()
    stamps = machinlike.launch_ray(first_rpc, ranks, timeout=120, resources={"num_cpus": 0.5})
    return {"usable": max(stamps) - start, "total": time.time() - start}


def _torchrun(ranks: int) -> Dict[str, float]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC_", "MASTER_", "SLURM_"))}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                      env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    start = time.time()
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
                           str(ranks), os.path.abspath(__file__), "--as-torchrun-worker"],
                          capture_output=True, text=True, timeout=180, env=env)
    total = time.time() - start
    stamps = [float(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("STAMP ")]
    if done.returncode != 0 or len(stamps) != ranks:
        raise RuntimeError(f"torchrun run failed ({done.returncode}):\n{done.stdout}\n{done.stderr[-3000:]}")
    return {"usable": max(stamps) - start, "total": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one round (a smoke run)")
    parser.add_argument("--ranks", type=int, default=4, help="ranks per job (default 4)")
    parser.add_argument("--as-torchrun-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.as_torchrun_worker:  # one of torchrun's workers: launch() runs in place
        (stamp,) = machinlike.launch(first_rpc, args.ranks)
        os.write(1, f"STAMP {stamp!r}\n".encode())
        return

    import ray

    start = time.time()
    # Four ranks at half a CPU each fit this 2-core machine; the store stays on loopback.
    ray.init(num_cpus=max(2, args.ranks), include_dashboard=False, log_to_driver=False)
    ray_start = time.time() - start
    rounds = 1 if args.quick else 3
    runs: Dict[str, List[Dict[str, float]]] = {"local": [], "ray": [], "torchrun": []}
    contenders = {"local": _local, "ray": _ray, "torchrun": _torchrun}
    try:
        for _ in range(rounds):
            for name, run in contenders.items():
                runs[name].append(run(args.ranks))
    finally:
        ray.shutdown()

    med = {name: {k: statistics.median(r[k] for r in rs) for k in ("usable", "total")} for name, rs in runs.items()}
    base = med["local"]
    print(f"{args.ranks} ranks, {rounds} round(s), medians; ratio = contender / local")
    print(f"{'contender':<10}  {'usable (s)':>10}  {'ratio':>6}  {'total (s)':>9}  {'ratio':>6}")
    for name, m in med.items():
        print(f"{name:<10}  {m['usable']:>10.2f}  {m['usable'] / base['usable']:>6.2f}  "
              f"{m['total']:>9.2f}  {m['total'] / base['total']:>6.2f}")
    print(f"ray.init (a new local Ray, once, not in the figures above): {ray_start:.2f} s")


if __name__ == "__main__":
    main()
