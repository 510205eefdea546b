"""Ranks as Ray actors: a learner on the node that has the "learner" resource, two actors.

Run:  python docs/tutorials/code/clusters.py
It starts a small local Ray (3 CPUs, one "learner" resource); on a cluster, drop the
``ray.init`` call and pass ``address="auto"`` (or the head's ``host:port``) to launch_ray.
"""

from __future__ import annotations

import os

import ray
import torch

import machinlike


# [job]
def job(world: machinlike.World, scale: float) -> dict:
    group = world.create_rpc_group("job", world.get_members())
    if world.name == "learner":
        group.register("scale", lambda t: t * scale)
    group.barrier()
    out = group.registered_sync("scale", (torch.full((2,), float(world.rank)),))
    resources = ray.get_runtime_context().get_assigned_resources()
    group.barrier()
    group.destroy()
    return {"member": world.name, "pid": os.getpid(), "result": out.tolist(), "resources": resources}
# [/job]


# [main]
def main() -> None:
    ray.init(num_cpus=3, resources={"learner": 1}, include_dashboard=False, log_to_driver=False)
    try:
        results = machinlike.launch_ray(
            job, 3, args=(10.0,), names=["learner", "actor-1", "actor-2"], timeout=120,
            resources=[{"num_cpus": 1, "learner": 1}, {"num_cpus": 1}, {"num_cpus": 1}])
    finally:
        ray.shutdown()
    for r in results:
        print(r)
    assert results[0]["resources"]["learner"] == 1.0 and results[2]["result"] == [20.0, 20.0]
# [/main]


if __name__ == "__main__":
    main()
