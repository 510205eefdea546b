"""A tour of CollectiveGroup: collectives, any-source receives and DistributedDataParallel.

Collectives over the world and over a sub-group, receives from any source, and
DistributedDataParallel on a sub-group.

Run it locally:      python examples/collective.py --num-workers 3
or under torchrun:   torchrun --standalone --nproc-per-node 3 examples/collective.py
"""

from __future__ import annotations

import argparse
import time

import torch

import _util  # the examples' shared plumbing, beside this script
import machinlike


def worker(world: machinlike.World, ddp_steps: int) -> dict:
    rank, size = world.rank, world.world_size
    everyone = world.create_collective_group(list(range(size)))
    learners = world.create_collective_group([0, 1])  # every process enters; only 0 and 1 are in it

    t = torch.tensor([float(rank + 1)])
    everyone.all_reduce(t)
    print(f"[rank {rank}] all_reduce of 1..{size} = {t.item():.0f}", flush=True)

    pieces = [torch.zeros(1) for _ in range(size)]
    everyone.all_to_all(pieces, [torch.tensor([float(10 * rank + i)]) for i in range(size)])
    print(f"[rank {rank}] all_to_all received {[int(p.item()) for p in pieces]}", flush=True)

    # Any-source receive: rank 0 takes messages in whatever order the others send them.
    if rank == 0:
        senders = []
        for _ in range(size - 1):
            buf = torch.zeros(1)
            senders.append(everyone.recv(buf))
        print(f"[rank 0] received from ranks in arrival order: {senders}", flush=True)
    else:
        everyone.send(torch.tensor([float(rank)]), dst=0)

    loss = None
    if learners.is_member():
        torch.manual_seed(0)  # same initial weights on both learners
        model = torch.nn.Linear(8, 1)
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=learners.group)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=0.05)
        generator = torch.Generator().manual_seed(rank)
        target_w = torch.arange(8.0)
        for step in range(ddp_steps):
            x = torch.randn(32, 8, generator=generator)
            loss = torch.nn.functional.mse_loss(ddp(x).squeeze(1), x @ target_w)
            optimizer.zero_grad()
            loss.backward()  # gradients are averaged over the two learners
            optimizer.step()
            if step % max(1, ddp_steps // 4) == 0:
                print(f"[rank {rank}] DDP step {step}: loss {loss.item():.3f}", flush=True)
        loss = loss.item()
    everyone.barrier()
    learners.destroy()
    everyone.destroy()
    return {"rank": rank, "final_loss": loss}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=_util.positive_int, default=3, help="processes (at least 2; default 3)")
    parser.add_argument("--steps", type=_util.positive_int, default=200, help="DDP training steps (default 200)")
    args = parser.parse_args()
    if args.num_workers < 2:
        parser.error("--num-workers must be at least 2 (the DDP sub-group has ranks 0 and 1)")
    start = time.monotonic()
    with _util.interruptible():  # Ctrl-C: one line, as the training examples end
        results = machinlike.launch(worker, args.num_workers, args=(args.steps,), timeout=300)
    for result in results:
        print(result)
    print(f"done in {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
