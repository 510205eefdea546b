"""Where shared memory starts to beat the socket: echo times of one message by size, with
the same-host segments taken from 16 KiB on, never, and at the World's default threshold.

Run:  python benchmarks/shm_threshold.py [--quick]

Two local members, one intra-op thread each; the caller echoes through
``registered_sync`` a float tensor, a uint8 numpy array and a dict (a uint8 observation
tensor beside a 1 KiB reward tensor) of each size. "never" (``shm_threshold`` 1 GiB) is
what the same-host lane or TensorPipe gives; the default's column shows where the
default puts each size. Each figure is the median echo over ``--reps`` calls, the median
again over ``--rounds`` launches of each setting (taken in turn, so that load hits all
alike). The ratio never / 16 KiB above 1 means the segment wins at that size.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Dict, List, Tuple

import numpy as np
import torch

from machinlike import launch
from machinlike.distributed import World

SIZES = [64 << 10, 128 << 10, 256 << 10, 384 << 10, 512 << 10, 768 << 10, 1 << 20, 2 << 20]
KINDS = ["tensor", "numpy", "dict"]
DEFAULT = World.__init__.__kwdefaults__["shm_threshold"]
SETTINGS = [("16 KiB", 16 << 10), ("never", 1 << 30), ("default", DEFAULT)]


def _echo(x: Any) -> Any:
    return x


def _payload(kind: str, n: int) -> Any:
    if kind == "tensor":
        return torch.ones(n // 4)
    if kind == "numpy":
        return np.ones(n, dtype=np.uint8)
    return {"obs": torch.ones(n - 1024, dtype=torch.uint8), "rew": torch.ones(256)}


def _body(world: Any, reps: int) -> Dict[Tuple[str, int], float]:
    torch.set_num_threads(1)
    group = world.create_rpc_group("echo", world.get_members())
    if world.rank == 1:
        group.register("echo", _echo)
    group.barrier()
    out: Dict[Tuple[str, int], float] = {}
    if world.rank == 0:
        for kind in KINDS:
            for n in SIZES:
                x = _payload(kind, n)
                for _ in range(3):  # (segments made, mappings cached)
                    group.registered_sync("echo", (x,))
                times: List[float] = []
                for _ in range(reps):
                    start = time.perf_counter()
                    group.registered_sync("echo", (x,))
                    times.append(time.perf_counter() - start)
                out[(kind, n)] = statistics.median(times)
    group.barrier()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 round of 10 calls (a smoke run)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args()
    rounds, reps = (1, 10) if args.quick else (args.rounds, args.reps)
    got: Dict[Tuple[str, str, int], List[float]] = {}
    for _ in range(rounds):
        for name, threshold in SETTINGS:
            for key, took in launch(_body, 2, args=(reps,), shm_threshold=threshold, timeout=600)[0].items():
                got.setdefault((name,) + key, []).append(took)
    print(f"echo through registered_sync, ms (median of {rounds} x {reps} calls); default threshold "
          f"{DEFAULT >> 10} KiB")
    print(f"{'kind':<7} {'size':>7}  " + " ".join(f"{name:>8}" for name, _ in SETTINGS) + "  never / 16 KiB")
    for kind in KINDS:
        for n in SIZES:
            row = [1000 * statistics.median(got[(name, kind, n)]) for name, _ in SETTINGS]
            print(f"{kind:<7} {n >> 10:>5} K  " + " ".join(f"{ms:8.3f}" for ms in row) + f"  {row[1] / row[0]:5.2f}x")


if __name__ == "__main__":
    main()
