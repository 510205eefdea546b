"""A tour of RpcGroup: services, paired values, async calls, barriers and a shared stop flag.

Run it locally (spawns the workers itself):   python examples/rpc_group.py --num-workers 3
or under torchrun, unchanged:                 torchrun --standalone --nproc-per-node 3 examples/rpc_group.py

Every member registers a service, member "0" pairs a stop flag into the group, the others
work (calling each other's services) until member 0 raises the flag.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

import _util  # the examples' shared plumbing, beside this script
import machinlike


class StopFlag:
    """Lives on its owner; the others reach it through a handle (get_paired)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def is_set(self) -> bool:
        return self._event.is_set()


def scale(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    return tensor * factor


def worker(world: machinlike.World, steps: int) -> dict:
    me = world.name
    group = world.create_rpc_group("tour", world.get_members())
    group.register(f"scale/{me}", scale)
    flag = StopFlag()
    if me == "0":
        group.pair("stop", flag)
    group.barrier()  # everything above is visible to every member from here on
    print(f"[{me}] members {group.get_group_members()}, services registered", flush=True)

    peers = [m for m in group.get_group_members() if m != me]
    calls = 0
    if me == "0":
        for step in range(steps):
            for peer in peers:
                out = group.registered_sync(f"scale/{peer}", args=(torch.ones(3), step))
                assert out.tolist() == [float(step)] * 3
                calls += 1
        flag.set()
        print(f"[0] {calls} calls done; stop flag raised", flush=True)
    else:
        stop = group.get_paired("stop")  # a handle to member 0's flag
        while not stop.rpc_sync().is_set():
            futures = [group.registered_async(f"scale/{peer}", args=(torch.ones(2), 2.0)) for peer in peers]
            assert all(f.wait().tolist() == [2.0, 2.0] for f in futures)
            calls += len(futures)
        remote = group.registered_remote("scale/0", args=(torch.arange(3.0), 10.0))
        print(f"[{me}] saw the stop flag after {calls} calls; remote result {remote.to_here().tolist()}",
              flush=True)
        calls += 1
    group.barrier()
    group.destroy()
    return {"member": me, "calls": calls}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=_util.positive_int, default=3, help="processes to start (default 3)")
    parser.add_argument("--steps", type=_util.positive_int, default=50,
                        help="rounds of calls member 0 makes (default 50)")
    args = parser.parse_args()
    start = time.monotonic()
    with _util.interruptible():  # Ctrl-C: one line, as the training examples end
        results = machinlike.launch(worker, args.num_workers, args=(args.steps,), timeout=300)
    for result in results:
        print(f"member {result['member']}: {result['calls']} calls")
    print(f"done in {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
