"""Quickstart: start a local world of three processes, register a service, call it.

Run it:  python docs/tutorials/code/quickstart.py
(or, unchanged, under torchrun: torchrun --standalone --nproc-per-node 3 docs/tutorials/code/quickstart.py)
"""

from __future__ import annotations

import torch

import machinlike


# [service]
def scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    """The service: runs on the member that registered it."""
    return tensor * factor
# [/service]


# [worker]
def worker(world: machinlike.World) -> list:
    # Every member enters; the call returns once all of them have.
    group = world.create_rpc_group("quickstart", world.get_members())
    if world.name == "0":
        group.register("scale", scale)
    group.barrier()  # from here on every member sees the service

    # Any member (the owner too) calls it by name; tensors travel as tensors.
    result = group.registered_sync("scale", args=(torch.ones(2), world.rank + 1))

    group.barrier()  # nobody withdraws the service while others may still call it
    group.destroy()
    return result.tolist()
# [/worker]


# [main]
def main() -> None:
    # Three processes on this machine, a World in each, worker(world) in each.
    results = machinlike.launch(worker, 3, timeout=60)
    print(results)  # one entry per rank, in rank order
    assert results == [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]], results
# [/main]


if __name__ == "__main__":
    main()
