"""One script for a laptop, torchrun and SLURM.

On one machine:        python docs/tutorials/code/multihost_train.py
Under torchrun:        torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
                           --rdzv-endpoint node0:29400 --rdzv-id job42 multihost_train.py
Under SLURM:          srun -N 2 --ntasks-per-node 4 python multihost_train.py
                       (launch() runs in place in an srun step; the World reads SLURM's variables)
"""

from __future__ import annotations

import os
import socket

import torch

import machinlike
from machinlike.distributed import World


# [train]
def train(world: machinlike.World) -> dict:
    everyone = world.create_collective_group(world.get_ranks())
    group = world.create_rpc_group("job", world.get_members())
    t = torch.ones(1)
    everyone.all_reduce(t)  # gloo, over the chosen interface
    host = group.rpc_sync("0", socket.gethostname)  # RPC, over TensorPipe
    group.barrier()
    group.destroy()
    everyone.destroy()
    return {"rank": world.rank, "size": t.item(), "rank0_host": host, "interface": world.interface}
# [/train]


# [main]
def main() -> None:
    if "RANK" in os.environ:
        # Started by a launcher (torchrun, srun, a job script): this process is one rank.
        # World() reads RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and picks the
        # network interface that reaches the master (or MACHINLIKE_SOCKET_IFNAME).
        with World(dist_timeout=120) as world:
            print(train(world), flush=True)
    else:
        # No RANK: start two ranks on this machine (loopback only); in an srun step of
        # more than one task, launch() runs train() in place as this task's rank instead.
        for result in machinlike.launch(train, 2, timeout=60):
            print(result)
# [/main]


if __name__ == "__main__":
    main()
