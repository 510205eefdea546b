"""How soon a waiting member learns that a value was paired or a service registered:
``RpcGroup.wait_paired`` / ``wait_registered`` beside what a user writes without them.

Run:  python benchmarks/arrival.py [--quick]

Two local members. For each round the host sleeps a random 5-25 ms, then pairs (or
registers) a new key; the waiter is already waiting for it, one way or another:

* ``wait_paired`` / ``wait_registered``: the store wakes the waiter (no polling);
* a sleep loop over ``is_paired`` / ``is_registered``, 10 ms and 100 ms a turn (what
  cold trial 11 wrote);
* raw: torch's ``TCPStore.wait`` on a key the host sets with ``TCPStore.set`` (the floor:
  one store round trip, no pairing behind it).

Each figure is the time from the host's call to the waiter holding the value (a
``PairedRef`` whose ``to_here()`` it has read, or a registered service it may call), median
and p95 over the rounds; both clocks are this host's ``time.monotonic``. The waiter's CPU
is its process's CPU time per round, over the whole wait (a sleep loop burns some).
"""

from __future__ import annotations

import argparse
import datetime
import random
import statistics
import time
from typing import Any, Callable, Dict, List, Tuple

import torch.distributed as dist

from machinlike import launch

WAYS = ["wait", "poll 10 ms", "poll 100 ms", "raw store"]
KINDS = ["pair", "register"]


def _raw_store(world: Any) -> dist.TCPStore:
    host, port = world.store_address[len("tcp://"):].rsplit(":", 1)
    return dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=30))


def _service() -> int:
    return 1


def _host(world: Any, group: Any, rounds: int, seed: int) -> Dict[Tuple[str, str], List[float]]:
    store = _raw_store(world)
    rng = random.Random(seed)
    said: Dict[Tuple[str, str], List[float]] = {}
    for kind in KINDS:
        for way in WAYS:
            times = said.setdefault((kind, way), [])
            for i in range(rounds):
                key = f"{kind}-{WAYS.index(way)}-{i}"
                group.barrier(timeout=30)
                time.sleep(rng.uniform(0.005, 0.025))
                times.append(time.monotonic())
                if way == "raw store":
                    store.set(f"arrival/{key}", "1")
                elif kind == "pair":
                    group.pair(key, i)
                else:
                    group.register(key, _service)
                group.barrier(timeout=30)  # the waiter has it
                if way != "raw store":
                    (group.unpair if kind == "pair" else group.deregister)(key)  # (nothing grows)
    return said


def _waiter(world: Any, group: Any, rounds: int) -> Dict[Tuple[str, str], List[Tuple[float, float]]]:
    store = _raw_store(world)
    got: Dict[Tuple[str, str], List[Tuple[float, float]]] = {}
    for kind in KINDS:
        for way in WAYS:
            times = got.setdefault((kind, way), [])
            for i in range(rounds):
                key = f"{kind}-{WAYS.index(way)}-{i}"
                group.barrier(timeout=30)
                cpu = time.process_time()
                _wait(group, store, kind, way, key)
                times.append((time.monotonic(), time.process_time() - cpu))
                group.barrier(timeout=30)
    return got


def _wait(group: Any, store: dist.TCPStore, kind: str, way: str, key: str) -> None:
    if way == "raw store":
        store.wait([f"arrival/{key}"])
        return
    if way == "wait":
        if kind == "pair":
            group.wait_paired(key, timeout=30).to_here()
        else:
            group.wait_registered(key, timeout=30)
        return
    pause = 0.01 if way == "poll 10 ms" else 0.1
    there: Callable[[str], bool] = group.is_paired if kind == "pair" else group.is_registered
    while not there(key):
        time.sleep(pause)
    if kind == "pair":
        group.get_paired(key).to_here()


def _body(world: Any, rounds: int, seed: int) -> Any:
    group = world.create_rpc_group("arrival", ["host", "waiter"])
    out = _host(world, group, rounds, seed) if world.name == "host" else _waiter(world, group, rounds)
    group.barrier(timeout=30)
    return out


def _ms(xs: List[float]) -> str:
    xs = sorted(xs)
    p95 = xs[min(len(xs) - 1, int(0.95 * len(xs)))]
    return f"{1000 * statistics.median(xs):7.2f} {1000 * p95:7.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="20 rounds a way instead of 60")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()
    rounds = 20 if args.quick else 60
    said, got = launch(_body, 2, args=(rounds, args.seed), names=["host", "waiter"], timeout=600)
    print(f"{rounds} rounds a way; ms from the host's call to the waiter holding it (median, p95); "
          "waiter CPU ms a round (median)")
    print(f"{'what':<10} {'how':<12} {'median':>7} {'p95':>7} {'cpu':>6}  ratio (median / wait's)")
    for kind in KINDS:
        base = None
        for way in WAYS:
            lags = [t - s for (t, _), s in zip(got[(kind, way)], said[(kind, way)])]
            cpu = statistics.median(c for _, c in got[(kind, way)])
            mid = statistics.median(lags)
            base = mid if way == "wait" else base
            ratio = "" if base is None or way == "wait" else f"{mid / base:5.2f}x"
            print(f"{kind:<10} {way:<12} {_ms(lags)} {1000 * cpu:6.2f}  {ratio}")


if __name__ == "__main__":
    main()
