"""Collective groups: collectives over the world and a sub-group, and DDP on the sub-group.

Run it:  python docs/tutorials/code/collective_ddp.py
"""

from __future__ import annotations

import torch

import machinlike


# [collectives]
def collectives(world: machinlike.World, everyone: machinlike.CollectiveGroup) -> dict:
    rank, size = world.rank, world.world_size
    out = {}

    t = torch.tensor([float(rank + 1)])
    everyone.all_reduce(t)  # in place, the sum over all ranks: 1 + 2 + 3
    out["all_reduce"] = t.item()

    t = torch.tensor([float(rank)])
    everyone.broadcast(t, src=2)  # every rank gets rank 2's tensor
    out["broadcast"] = t.item()

    gathered = [torch.zeros(1) for _ in range(size)]
    everyone.all_gather(gathered, torch.tensor([rank * 10.0]))
    out["all_gather"] = [g.item() for g in gathered]

    # Receive from any source: recv() returns the global rank of the sender.
    if rank == 0:
        senders = sorted(everyone.recv(torch.zeros(1)) for _ in range(size - 1))
        out["senders"] = senders
    else:
        everyone.send(torch.tensor([float(rank)]), dst=0)

    # Objects (anything picklable) instead of tensors.
    names = [None] * size
    everyone.all_gather_object(names, world.name)
    out["names"] = names
    return out
# [/collectives]


# [ddp]
def ddp(world: machinlike.World, learners: machinlike.CollectiveGroup, steps: int) -> list:
    torch.manual_seed(0)  # the same initial weights on both learners
    model = torch.nn.Linear(4, 1)
    wrapped = torch.nn.parallel.DistributedDataParallel(model, process_group=learners.group)
    optimizer = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    data = torch.Generator().manual_seed(world.rank)  # each learner sees other data
    for _ in range(steps):
        x = torch.randn(16, 4, generator=data)
        loss = torch.nn.functional.mse_loss(wrapped(x).squeeze(1), x.sum(1))
        optimizer.zero_grad()
        loss.backward()  # DDP averages the gradients over the learners here
        optimizer.step()
    return torch.cat([p.detach().flatten() for p in model.parameters()]).tolist()
# [/ddp]


# [worker]
def worker(world: machinlike.World) -> dict:
    # Every process of the world calls create_collective_group (torch's rule),
    # members and non-members alike.
    everyone = world.create_collective_group(world.get_ranks())
    learners = world.create_collective_group([0, 1])
    out = collectives(world, everyone)
    if learners.is_member():
        out["weights"] = ddp(world, learners, steps=20)
    everyone.barrier()
    learners.destroy()
    everyone.destroy()
    return out
# [/worker]


def main() -> None:
    # [run]
    results = machinlike.launch(worker, 3, timeout=60)
    for rank, result in enumerate(results):
        print(rank, {k: v for k, v in result.items() if k != "weights"})
    if len(results) < 3:  # under torchrun: this worker's value alone
        raise SystemExit(0)
    assert all(r["all_reduce"] == 6.0 and r["broadcast"] == 2.0 for r in results)
    assert results[0]["senders"] == [1, 2]
    # DDP kept the two learners' models identical; rank 2 did not train.
    assert results[0]["weights"] == results[1]["weights"] and "weights" not in results[2]
    # [/run]


if __name__ == "__main__":
    main()
