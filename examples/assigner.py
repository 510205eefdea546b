"""A tour of ModelAssigner: plan device placement for a set of models, then place them.

Run:  python examples/assigner.py

1. Size estimates of a few models (ModelSizeEstimator, exact for every dtype).
2. A plan for hardware this machine may not have (two GPUs of different power and a
   CPU, given as DeviceSpec): nothing is moved, the plan and its report are printed.
3. A plan that cannot fit, and the clear error it raises.
4. The real thing on this machine's own devices, with move_models=True.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn

import _util  # the examples' shared plumbing, beside this script
from machinlike.assigner import DeviceSpec, InfeasiblePlacementError, ModelAssigner, ModelSizeEstimator


def mlp(width: int, depth: int, dtype: torch.dtype = torch.float32) -> nn.Module:
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers).to(dtype)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=_util.non_negative_int, default=0,
                        help="seed of the placement search (default 0)")
    args = parser.parse_args()

    names = ["encoder", "actor", "critic", "world_model", "target_critic"]
    models = [mlp(1024, 4), mlp(256, 2), mlp(256, 2), mlp(2048, 3, torch.bfloat16), mlp(256, 2)]
    print("== 1. sizes (parameters + buffers, times size_multiplier=2)")
    for name, model in zip(names, models):
        print(f"   {name:<14} {ModelSizeEstimator(model).estimate_size():8.1f} MB")

    # Data sent between models per step (MB): the encoder feeds actor, critic and the world
    # model; the critic and its target exchange weights now and then.
    connection = {(0, 1): 8.0, (0, 2): 8.0, (0, 3): 32.0, (2, 4): 1.0}
    hardware = [DeviceSpec("cuda:0", memory=400, compute=1.0),
                DeviceSpec("cuda:1", memory=400, compute=0.5),
                DeviceSpec("cpu", memory=8000, compute=0.1)]
    print("\n== 2. a plan for two GPUs (400 MB free each, the second half as fast) and a CPU")
    start = time.perf_counter()
    plan = ModelAssigner(models, connection, devices=hardware, cpu_weight=0.1, move_models=False,
                         seed=args.seed)
    print(f"   found in {time.perf_counter() - start:.2f} s")
    for name, device in zip(names, plan.assignment):
        print(f"   {name:<14} -> {device}")
    print(plan.report())

    print("\n== 3. the same models on two small GPUs (60 MB free each)")
    try:
        ModelAssigner(models, connection, devices=[DeviceSpec("cuda:0", memory=60),
                                                   DeviceSpec("cuda:1", memory=60)], move_models=False)
    except InfeasiblePlacementError as err:
        print(f"   InfeasiblePlacementError: {err}")

    print("\n== 4. this machine's devices, models moved")
    real = ModelAssigner(models, connection, seed=args.seed)
    for name, model, device in zip(names, models, real.assignment):
        assert next(model.parameters()).device == device
        print(f"   {name:<14} is on {device}")


if __name__ == "__main__":
    main()
