"""A tour of the ordered key-value server: versions, compare-and-set races, history, pulls by version.

Run it locally (spawns the members itself):  python examples/ordered_server.py --num-workers 3
or under torchrun, unchanged:                torchrun --standalone --nproc-per-node 3 examples/ordered_server.py

Member "0" hosts an ``OrderedServerSimpleImpl``; every member uses the accessor. A push
names the version it stores and the version it expects to replace: the server accepts it
only if that is still the newest, so concurrent writers cannot lose each other's updates.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Dict

import torch

import _util  # the examples' shared plumbing, beside this script
import machinlike
from machinlike.server import OrderedServerSimpleImpl


def say(world: machinlike.World, text: str) -> None:
    print(f"[{world.name}] {text}", flush=True)


def increment(kv: Any, key: str, times: int, me: str) -> Dict[str, int]:
    """Add one to the counter ``key`` ``times`` times with compare-and-set; count the conflicts."""
    conflicts = 0
    for _ in range(times):
        while True:
            value, version = kv.pull(key)
            # Store version + 1 on top of version: refused if someone got there first.
            if kv.push(key, {"count": value["count"] + 1, "by": me}, version + 1, version):
                break
            conflicts += 1
    return {"increments": times, "conflicts": conflicts}


def worker(world: machinlike.World, args: argparse.Namespace) -> Dict[str, Any]:
    me = world.name
    group = world.create_rpc_group("tour", world.get_members())
    host = group.get_group_members()[0]
    impl = OrderedServerSimpleImpl("kv", group, version_depth=args.depth) if me == host else None
    group.barrier()  # the server and its paired accessor exist from here on
    kv = group.get_paired("kv").to_here()

    # 1. Versions and compare-and-set, by the host alone.
    if me == host:
        say(world, f"1. versions: a new key takes any version: push(weights, v=1, prev=None) -> "
                   f"{kv.push('weights', torch.zeros(3), 1, None)}")
        say(world, f"   push(v=2, prev=5), 5 is not the newest -> {kv.push('weights', torch.ones(3), 2, 5)} (refused)")
        say(world, f"   push(v=2, prev=1) -> {kv.push('weights', torch.ones(3), 2, 1)}")
        value, version = kv.pull("weights")
        say(world, f"   pull('weights') -> ({value.tolist()}, version {version})")
        value.add_(100)  # a pulled value is a copy: the server's stays as it was
        say(world, f"   after changing the pulled copy, pull again -> {kv.pull('weights')[0].tolist()}")
        say(world, f"   pull_if_changed(have_version=2) -> {kv.pull_if_changed('weights', 2)} (nothing sent)")
        say(world, f"   pull('missing') -> {kv.pull('missing')}")
        kv.push("counter", {"count": 0, "by": me}, 0, None)
    group.barrier()

    # 2. A race: every member increments the same counter; compare-and-set loses nothing.
    start = time.monotonic()
    mine = increment(kv, "counter", args.increments, me)
    group.barrier()
    value, version = kv.pull("counter")
    members = group.size()
    say(world, f"2. race: {mine['increments']} increments, {mine['conflicts']} refused pushes retried "
               f"({time.monotonic() - start:.2f} s); counter {value['count']} at version {version}, "
               f"expected {members * args.increments}")
    if value["count"] != members * args.increments or version != value["count"]:
        raise RuntimeError(f"lost updates: counter {value} at version {version}")
    group.barrier()

    # 3. History: the newest version plus ``depth`` older ones can be pulled by version.
    if me == host:
        newest = version
        say(world, f"3. history (version_depth={args.depth}): the newest is version {newest}")
        for v in range(newest, max(-1, newest - args.depth - 3), -1):
            got = kv.pull("counter", version=v)
            shown = f"count {got[0]['count']} by member {got[0]['by']!r}" if got else "None (no longer retained)"
            say(world, f"   pull('counter', version={v}) -> {shown}")
        stats = impl.stats()
        say(world, f"4. host statistics: {stats}")
    group.barrier()
    if impl is not None:
        impl.close()  # withdraws the services and the paired accessor
    group.destroy()
    return {"member": me, **mine}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=_util.positive_int, default=3, help="member processes (default 3)")
    parser.add_argument("--increments", type=_util.positive_int, default=50,
                        help="counter increments per member in the race (default 50)")
    parser.add_argument("--depth", type=_util.non_negative_int, default=2,
                        help="older versions the server keeps (default 2)")
    parser.add_argument("--time-budget", type=_util.positive_float, default=120.0,
                        help="give up (and stop every process) after this many seconds (default 120)")
    args = parser.parse_args()
    start = time.monotonic()
    results = _util.run(worker, args.num_workers, args, timeout_margin=0.0)
    for result in results:
        print(f"member {result['member']}: {result['increments']} increments, {result['conflicts']} conflicts")
    print(f"done in {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
