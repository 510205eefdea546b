"""Servers: the ordered key-value server, the model server and the gradient server.

Run it:  python docs/tutorials/code/param_servers.py
"""

from __future__ import annotations

import torch

import machinlike
from machinlike.server import OrderedServerSimpleImpl, grad_server_helper, model_server_helper


# [ordered]
def ordered(world: machinlike.World, group: machinlike.RpcGroup) -> dict:
    host = None
    if world.name == "0":
        host = OrderedServerSimpleImpl("kv", group, version_depth=1)
    group.barrier()
    kv = group.get_paired("kv").to_here()  # the accessor: picklable, usable anywhere

    if world.name == "0":
        assert kv.push("lr", 0.1, version=0, prev_version=None)  # a new key: any version
    group.barrier()
    # Everyone tries to make version 1 on top of version 0: exactly one succeeds.
    won = kv.push("lr", 0.01 * (world.rank + 1), version=1, prev_version=0)
    group.barrier()
    value, version = kv.pull("lr")  # the newest (value, version)
    old = kv.pull("lr", version=0)  # retained: version_depth=1 keeps one older version
    group.barrier()
    if host is not None:
        host.close()
    return {"won": won, "newest": (value, version), "old": old}
# [/ordered]


def make_model() -> torch.nn.Module:
    model = torch.nn.Linear(3, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    return model


# [model]
def model_server(world: machinlike.World, group: machinlike.RpcGroup) -> int:
    servers = model_server_helper(1, group)  # hosted by the group's first member
    (server,) = servers
    model = make_model()
    if world.name == "1":
        with torch.no_grad():
            model.weight.fill_(1.0)
        assert server.push(model)  # version 1, on top of the model's version 0
    group.barrier()
    server.pull(model)  # loads version 1 unless the model already has it
    assert model.weight.sum().item() == 3.0
    servers.close()  # every member
    return model.pp_version  # the version lives on the model (machin's name)
# [/model]


# [grad]
PUSHES = 4


def grad_server(world: machinlike.World, group: machinlike.RpcGroup) -> list:
    # SGD(lr=1) and integer gradients: the result is exact, so the maths can be checked.
    servers = grad_server_helper([make_model], group, optimizer=torch.optim.SGD, learning_rate=1.0,
                                 reduce_method="sum", reduce_batch_size=2)
    (server,) = servers
    model = make_model()
    server.pull(model)  # start from the managed model's parameters (version 0)
    for _ in range(PUSHES):
        model.weight.grad = torch.full_like(model.weight, float(world.rank + 1))
        # pull=False: return once queued (not yet applied); the default also pulls
        assert server.push(model, pull=False)
    group.barrier()  # every push is queued somewhere
    if world.name == "0":
        server.flush()  # apply everything queued, partial batches included
    group.barrier()
    server.pull(model)
    servers.close()
    return model.weight.flatten().tolist()
# [/grad]


def worker(world: machinlike.World) -> dict:
    group = world.create_rpc_group("servers", world.get_members())
    out = {"ordered": ordered(world, group), "model_version": model_server(world, group),
           "weights": grad_server(world, group)}
    group.destroy()
    return out


def main() -> None:
    # [run]
    results = machinlike.launch(worker, 3, timeout=90)
    for rank, result in enumerate(results):
        print(rank, result)
    assert sum(r["ordered"]["won"] for r in results) == 1  # exactly one winner
    assert all(r["model_version"] == 1 for r in results)
    # "sum": every pushed gradient is applied once: -(1 + 2 + 3) * PUSHES per weight.
    assert all(r["weights"] == [-24.0, -24.0, -24.0] for r in results)
    # [/run]


if __name__ == "__main__":
    main()
