"""Device placement: size models, plan a placement for given devices, place them here.

Run it:  python docs/tutorials/code/placement.py
"""

from __future__ import annotations

from torch import nn

from machinlike.assigner import DeviceSpec, InfeasiblePlacementError, ModelAssigner, ModelSizeEstimator


def mlp(width: int, depth: int) -> nn.Module:
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)])


def main() -> None:
    # [sizes]
    models = [mlp(512, 4), mlp(128, 2), mlp(128, 2), mlp(1024, 2)]  # encoder, actor, critic, dynamics
    sizes = [ModelSizeEstimator(m, size_multiplier=2).estimate_size() for m in models]
    print("MB:", [round(s, 2) for s in sizes])  # (parameters + buffers) * 2, in 2**20 bytes
    # [/sizes]

    # [plan]
    # Data the models exchange per step (any unit): the encoder feeds the three others.
    connection = {(0, 1): 4.0, (0, 2): 4.0, (0, 3): 16.0}
    devices = [
        DeviceSpec("cuda:0", memory=40),               # 40 MB free, compute 1.0 (one GPU)
        DeviceSpec("cuda:1", memory=40, compute=0.5),  # half as fast
        DeviceSpec("cpu", memory=4000, compute=0.0),   # should compute nothing
    ]
    plan = ModelAssigner(models, connection, devices=devices, move_models=False, seed=0)
    print(plan.assignment)  # one torch.device per model
    print(plan.report())  # the objective's terms and each device's load
    assert plan.report().feasible
    # [/plan]

    # [infeasible]
    try:
        ModelAssigner(models, connection, devices=[DeviceSpec("cuda:0", memory=10)], move_models=False)
    except InfeasiblePlacementError as err:
        print(err)  # how many MB are missing, and what to change
    # [/infeasible]

    # [move]
    # On this machine: its own devices (every GPU, or the CPU without one); the models move.
    here = ModelAssigner(models, connection, seed=0)
    for model, device in zip(models, here.assignment):
        assert next(model.parameters()).device == device
    print("placed on", here.assignment)
    # [/move]


if __name__ == "__main__":
    main()
