"""Batched central inference: one member runs the policy for every actor's observations.

Run it:  python docs/tutorials/code/inference.py
"""

from __future__ import annotations

import threading

import torch

import machinlike
from machinlike.server import InferenceServerImpl

ENVS = 8  # environments per actor: one request carries a row for each


def make_policy(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 32), torch.nn.Tanh(), torch.nn.Linear(32, 3))


# [host]
def learner(world: machinlike.World, group: machinlike.RpcGroup) -> dict:
    policy = make_policy()
    server = InferenceServerImpl("policy", group, policy, max_batch=64, max_wait=0.002)
    group.barrier()  # the actors call from here on
    group.barrier()  # ... until they have acted with version 0
    server.update(make_policy(seed=1), version=1)  # swapped in between two batches
    group.barrier()
    group.barrier()  # the actors are done
    stats = server.stats()
    server.close()
    return stats
# [/host]


# [actor]
def actor(world: machinlike.World, group: machinlike.RpcGroup) -> dict:
    group.barrier()
    policy = group.get_paired("policy").to_here()  # the accessor: picklable, usable anywhere
    obs = torch.randn(ENVS, 6)
    logits, version = policy.infer(obs, with_version=True)  # one row of logits per env
    actions = torch.distributions.Categorical(logits=logits).sample()
    assert actions.shape == (ENVS,) and version == 0
    group.barrier()
    group.barrier()
    # Concurrent calls of one process are batched too (say, one thread per env group).
    versions = []
    threads = [threading.Thread(target=lambda: versions.append(policy.infer(obs, with_version=True)[1]))
               for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    # A request fn cannot run fails for its caller only, with fn's own exception.
    try:
        policy.infer(torch.zeros(2, 5))  # 5 features where the policy takes 6
    except RuntimeError as err:
        refused = "mat1 and mat2" in str(err)
    group.barrier()
    return {"versions": versions, "refused": refused}
# [/actor]


# [run]
def worker(world: machinlike.World) -> dict:
    group = world.create_rpc_group("actors", world.get_members())
    result = learner(world, group) if world.name == "0" else actor(world, group)
    group.destroy()
    return result


def main() -> None:
    stats, *actors = machinlike.launch(worker, 3, timeout=120)
    assert all(a["versions"] == [1, 1, 1, 1] and a["refused"] for a in actors)
    print(f"{stats['requests']} requests in {stats['batches']} calls of the policy, "
          f"{stats['mean_batch']:.1f} rows each; {stats['errors']} refused")
# [/run]


if __name__ == "__main__":
    main()
