"""The restart race, N times in a row: a rank restarted in place by ``launch(...,
max_restarts=1)`` comes back, and every rank creates an RpcGroup over all three at once.

The survivors learn that the rank is back from the store (the restarted rank writes a
key), not from their view of the world, which may still hold the old incarnation as lost
or as live: group creation must consult the store, wait for its view to catch up and
agree, not fail a healthy rank. Prints one line per run and ``restart race: K/N ok``.

    python benchmarks/restart_race.py            # 50 runs
    python benchmarks/restart_race.py --runs 5
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from machinlike.distributed import World, launch  # noqa: E402


def race_body(world: World) -> int:
    """Rank 2's first incarnation dies at once; every rank then groups with all three."""
    keys, registry = world.membership.keys, world.membership.registry
    if world.rank == 2 and world.incarnation == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if world.rank == 2:
        registry.set(keys.scratch("race/up"), "1")
    else:  # told by the store, maybe before this view has seen the new incarnation
        registry.wait_all(keys.scratch("race/"), ["up"], 60, "the restarted rank")
    group = world.create_rpc_group("after", ["0", "1", "2"])
    group.barrier(timeout=30)
    return world.incarnation


def one_run() -> str:
    """'ok', or what went wrong."""
    try:
        results = launch(race_body, 3, max_restarts=1, timeout=90)
    except Exception as err:  # reported, the loop goes on
        return f"FAILED: {type(err).__name__}: {err}"
    restarted = [r.rank for r in results.restarts]
    if list(results) != [1, 1, 2] or restarted != [2]:
        return f"WRONG: results {list(results)}, restarts {results.restarts}"
    return "ok"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=50)
    args = parser.parse_args()
    ok = 0
    for i in range(args.runs):
        start = time.monotonic()
        outcome = one_run()
        ok += outcome == "ok"
        print(f"run {i + 1:3d}: {outcome}  ({time.monotonic() - start:.1f} s)", flush=True)
    print(f"restart race: {ok}/{args.runs} ok")
    sys.exit(0 if ok == args.runs else 1)


if __name__ == "__main__":
    main()
