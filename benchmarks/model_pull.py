"""A model server's pull with nothing new, on one host: the version word against a call.

Run:  python benchmarks/model_pull.py [--rounds N] [--quick]

Two local processes. Rank 0 hosts a ``PushPullModelServerImpl`` (and, for the peer, a
plain module function that returns the newest version); rank 1 is an actor holding the
newest version of an MLP 40-256-256-8 (75k parameters, 0.3 MB, cold trial 8's). It times,
alternating, ``rounds`` rounds of ``CALLS`` pulls each:

* ``pull(model)``: ours, answered by the host's version word in shared memory;
* the call it made before (``o_server.pull_if_changed``: one RpcGroup call to the host,
  which finds nothing new and sends nothing back);
* raw ``torch.distributed.rpc.rpc_sync`` of a module function that returns the version,
  what a user would write by hand to ask the learner for it.

Then a pull after each new version (pushed by rank 0 between pulls; not timed), for
scale. Prints medians in microseconds and the ratios to ours.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any, Callable, Dict, List

import torch

from machinlike import launch

CALLS = 200
_newest: Dict[str, int] = {"version": 0}


def newest_version() -> int:
    """The peer's service: the learner's version, asked by raw torch RPC."""
    return _newest["version"]


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(40, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(),
                               torch.nn.Linear(256, 8))


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _body(world: Any, rounds: int) -> Dict[str, List[float]]:
    from torch.distributed import rpc

    from machinlike.server import PushPullModelServerImpl

    group = world.create_rpc_group("bench", world.get_members())
    learner = _mlp()
    impl = PushPullModelServerImpl("server", group) if world.rank == 0 else None
    group.barrier()
    times: Dict[str, List[float]] = {"word": [], "call": [], "raw": [], "newer": []}
    if world.rank == 0:
        server = group.get_paired("server").to_here()
        assert server.push(learner)
        _newest["version"] = learner.pp_version
        group.barrier()  # (1) version 1 made
        group.barrier()  # (2) the actor timed "nothing new"
        for _ in range(rounds * CALLS // 10):
            group.barrier()  # (3) the actor holds the newest
            with torch.no_grad():
                learner[0].bias.add_(1.0)
            assert server.push(learner)
            group.barrier()  # (4) a newer version to pull
    else:
        server = group.get_paired("server").to_here()
        actor = _mlp()
        group.barrier()  # (1)
        assert server.pull(actor) and not server.pull(actor)
        plain, key, version = server.o_server, server.model_name, actor.pp_version
        ways = {"word": lambda: server.pull(actor),
                "call": lambda: plain.pull_if_changed(key, version),
                "raw": lambda: rpc.rpc_sync(world.get_members()[0], newest_version)}
        for way in ways.values():  # warm-up
            _per_call(way, CALLS // 4)
        for _ in range(rounds):
            for name, way in ways.items():
                times[name].append(_per_call(way, CALLS))
        group.barrier()  # (2)
        for _ in range(rounds * CALLS // 10):
            group.barrier()  # (3)
            group.barrier()  # (4)
            start = time.perf_counter()
            assert server.pull(actor)
            times["newer"].append(time.perf_counter() - start)
    group.barrier()
    if impl is not None:
        impl.close()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15, help="rounds of %d pulls each way" % CALLS)
    parser.add_argument("--quick", action="store_true", help="3 rounds")
    args = parser.parse_args()
    rounds = 3 if args.quick else args.rounds
    _, times = launch(_body, 2, (rounds,), timeout=600)
    us = {name: statistics.median(values) * 1e6 for name, values in times.items()}
    print(f"pull with nothing new, {rounds} rounds of {CALLS}, median us per pull (ratio: theirs / ours)")
    print(f"  machinlike pull(model), version word      {us['word']:9.1f}")
    print(f"  the call it made before (pull_if_changed)  {us['call']:9.1f}   {us['call'] / us['word']:7.1f}x")
    print(f"  raw torch rpc_sync of the version          {us['raw']:9.1f}   {us['raw'] / us['word']:7.1f}x")
    print(f"pull of a newer version (0.3 MB), median of {len(times['newer'])}: {us['newer']:.1f} us")


if __name__ == "__main__":
    main()
