"""Elastic worlds: detection, join and rejoin times, the cost of liveness, and a long
fault-injection loop, side by side with a static world in one run.

Run:  python benchmarks/elastic.py [--quick] [--kills 50] [--chaos-iterations 1000]

1. Cost of liveness: a no-op ``registered_sync`` between two local members of a static
   World with liveness off (the peer: what the static path cost before round 2), a
   static World with liveness on, and an elastic World; alternating blocks, medians.
2. Detection, join and rejoin (elastic, launcher restarts): the driver SIGKILLs a member
   through its own service and measures kill -> "lost" event (detection), kill -> first
   successful call to the restarted incarnation (rejoin); a process started by hand is
   timed from ``Process.start()`` to the driver's first successful call to it (join).
   torch RPC alone has no detection: a dead peer's registrations stay and a remote
   peer is noticed at the RPC timeout (60 s by default).
3. Listener renewal: a member opens and closes its own RPC port without a message (what
   a peer dying mid-connect or a port probe does), which makes TensorPipe stop listening
   for good; timed until the member answers under its renewed agent.
4. The fault-injection loop of ``tests/chaos_targets.py`` (random SIGKILLs of a 4-member
   world during group creation, services, pair/get_paired and barriers), long.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import sys
import threading
import time
from typing import Any, Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))  # the chaos loop is shared with the test

from _pin import pin_to_core  # noqa: E402
from machinlike import launch  # noqa: E402
from machinlike.distributed import MemberEvent, World  # noqa: E402
from machinlike.process import Process  # noqa: E402


def noop() -> None:
    return None


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


# ----------------------------------------------------------------- cost of liveness
def _cost_body(world, calls: int, blocks: int) -> Any:
    pin_to_core(int(world.name))  # see _pin: comparable runs on a small machine
    group = world.create_rpc_group("g", ["0", "1"])
    if world.name == "1":
        group.register("noop", noop)
    group.barrier(timeout=30)
    out = None
    if world.name == "0":
        for _ in range(200):
            group.registered_sync("noop")
        times = []
        for _ in range(blocks):
            start = time.perf_counter()
            for _ in range(calls):
                group.registered_sync("noop")
            times.append((time.perf_counter() - start) / calls)
        out = statistics.median(times)
    group.barrier(timeout=60)
    return out


def cost_of_liveness(calls: int, blocks: int) -> Dict[str, float]:
    figures = {}
    for label, kwargs in (("static, liveness off", dict(liveness=None)),
                          ("static, liveness 2 s", dict()),
                          ("elastic, liveness 2 s", dict(max_restarts=1))):
        runs = []
        for _ in range(3):  # the worlds alternate so that machine noise hits each alike
            runs.append(launch(_cost_body, 2, args=(calls, blocks), timeout=120, **kwargs)[0])
        figures[label] = statistics.median(runs)
    return figures


# ------------------------------------------------------- detection, join and rejoin
def _late(address: str) -> None:
    with World("late", elastic=True, init_method=address) as world:
        group = world.create_rpc_group("open")
        group.register("ping-late", noop)
        world.wait_for_members(["driver"], timeout=60, gone=True)


def _until_answers(group, key: str) -> None:
    """Call ``key`` until it answers (its owner is joining or re-registering)."""
    while True:
        try:
            group.registered_sync(key, timeout=10)
            return
        except (KeyError, ConnectionError):
            time.sleep(0.001)  # polling is the measurement's resolution


def _times_body(world, kills: int) -> Any:
    group = world.create_rpc_group("open")
    if world.name != "driver":
        group.register("die", _die)
        group.register("ping", noop)
        world.wait_for_members(["driver"], timeout=60)  # see it first: not yet there is not gone
        world.wait_for_members(["driver"], timeout=600, gone=True)
        return None
    lost_at: Dict[int, float] = {}
    changed = threading.Condition()

    def on_change(event: MemberEvent) -> None:
        with changed:
            if event.kind == "lost":
                lost_at[event.incarnation] = time.monotonic()
            changed.notify_all()

    world.on_member_change(on_change)
    detection, rejoin = [], []
    for k in range(1, kills + 1):
        world.membership.wait_until(lambda live: world.get_incarnation("victim") == k, 60)
        while not group.is_registered("die"):  # registered right after joining
            time.sleep(0.001)  # polling is the measurement's resolution
        killed = time.monotonic()
        try:
            group.registered_sync("die", timeout=10)
        except Exception:  # PeerLostError: the call's own process is gone
            pass
        with changed:
            changed.wait_for(lambda: k in lost_at, timeout=10)
        detection.append(lost_at[k] - killed)
        _until_answers(group, "ping")  # the restarted incarnation
        rejoin.append(time.monotonic() - killed)
    joins = []
    for _ in range(3):
        child = Process(target=_late, args=(world.store_address,))
        start = time.monotonic()
        child.start()
        _until_answers(group, "ping-late")
        joins.append(time.monotonic() - start)
        child.terminate()
        child.join(10)
        world.wait_for_members(["late"], timeout=10, gone=True)
    return {"detection": detection, "rejoin": rejoin, "join": joins}


# ------------------------------------------------------------- listener renewal
def _renewal_body(world, rounds: int) -> List[float]:
    """Close this member's RPC listener (open its port, close it) and time the renewal."""
    group = world.create_rpc_group("open")
    group.register("ping", noop)
    times = []
    for _ in range(rounds):
        old = world.membership.worker
        host, _, port = world.membership.rpc_address()[len("uv://"):].rpartition(":")
        start = time.monotonic()
        socket.create_connection((host, int(port)), timeout=5).close()
        world.membership.wait_until(lambda live: world.membership.worker_of(world.name) != old, 30)
        times.append(time.monotonic() - start)
    return times


# -------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer calls, kills and iterations")
    parser.add_argument("--kills", type=int, default=None, help="default 50 (10 with --quick)")
    parser.add_argument("--chaos-iterations", type=int, default=None, help="default 1000 (30 with --quick)")
    args = parser.parse_args()
    kills = args.kills or (10 if args.quick else 50)
    iterations = args.chaos_iterations or (30 if args.quick else 1000)
    calls, blocks = (300, 5) if args.quick else (1000, 9)

    print("== cost of liveness on registered_sync (no-op, 2 local members) ==")
    cost = cost_of_liveness(calls, blocks)
    base = cost["static, liveness off"]
    for label, seconds in cost.items():
        print(f"  {label:24s} {seconds * 1e6:8.1f} us/call   {seconds / base:5.3f}x static without liveness")

    print(f"\n== detection, rejoin and join ({kills} kills, elastic world, launcher restarts) ==")
    result = launch(_times_body, 2, args=(kills,), names=["driver", "victim"], max_restarts=kills,
                    essential=["driver"], timeout=60 + 10 * kills)[0]
    for label in ("detection", "rejoin", "join"):
        values = result[label]
        print(f"  {label:10s} median {statistics.median(values) * 1e3:7.1f} ms   max {max(values) * 1e3:7.1f} ms"
              f"   (n={len(values)})")
    print("  peer: torch RPC alone never declares a member dead; a remote peer's call fails at "
          "its rpc_timeout (60 s default)")

    rounds = 5 if args.quick else 20
    print(f"\n== RPC listener renewal ({rounds} probes: the port opened and closed, no message) ==")
    times = launch(_renewal_body, 1, args=(rounds,), names=["host"], max_restarts=1, timeout=120)[0]
    print(f"  renewed within median {statistics.median(times) * 1e3:7.1f} ms   max {max(times) * 1e3:7.1f} ms"
          f"   (n={len(times)}; services and values kept)")
    print("  peer: torch RPC alone never listens again: every process that had not called it yet "
          "gets ECONNREFUSED for good")

    from chaos_targets import MEMBERS, chaos_body, schedule

    print(f"\n== fault injection: {iterations} iterations, 4 members, seed 7 ==")
    deaths = sum(1 for i in range(iterations) if schedule(i, 7)[0])
    start = time.monotonic()
    out = launch(chaos_body, len(MEMBERS), args=(iterations, 7), names=MEMBERS, max_restarts=iterations,
                 essential=["d"], timeout=60 + 5 * iterations)
    driver = out[0]
    print(f"  {deaths} SIGKILLs, {len(out.restarts)} restarts, 0 hangs; driver: {driver['completed']} "
          f"iterations completed, {driver['failed_fast']} failed fast (slowest "
          f"{driver['slowest_failure'] * 1e3:.0f} ms), {driver['skipped']} skipped, "
          f"{sum(len(r['unexpected']) for r in out)} unexpected failures (iterations nobody died in); "
          f"{sum(r['renewals'] for r in out)} RPC agents renewed by the final incarnations (listener closed "
          f"by a peer dying mid-connect); stop {max(r['stop'] for r in out):.2f} s max; "
          f"{time.monotonic() - start:.0f} s in all")
    for result in out:
        for line in result["unexpected"]:
            print(f"  unexpected: {line}")


if __name__ == "__main__":
    main()
