"""The gradient server through churn: throughput before, during and after a member's
SIGKILL, beside the static server's figure, in one run.

Run:  python benchmarks/churn.py [--quick]

Both halves use the workload of ``benchmarks/param_server.py`` (its ~1M-parameter MLP,
batch, SGD and its ``reduce_batch_size=2`` tree: rank 0 is the primary reducer, ranks 1
and 2 are trainers that each host a secondary reducer and push to it).

1. Static: rounds of ``param_server.py``'s machinlike gradient round in a static world
   (its code, imported); pushes/s is the trainers' accepted pushes over the slowest
   trainer's time, median over rounds.
2. Elastic (``launch(max_restarts=1)``): the same server in an elastic world. Rank 0
   samples its primary's ``applied`` counter every 50 ms. After a steady phase it SIGKILLs
   trainer 2 (its secondary reducer and its client die together); the launcher restarts
   it and the new incarnation rejoins the running server. Pushes/s is reported for the
   steady phase, for kill -> the restarted trainer's first accepted push ("during"), and
   from then to the end ("after"). Recovery time: kill -> the end of the first 0.5 s
   window, wholly after the kill, whose rate is >= 90% of the steady rate.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # param_server.py's workload and static round are reused as they are

import param_server as ps  # noqa: E402

from machinlike import launch  # noqa: E402
from machinlike.server import PushPullGradServerImpl  # noqa: E402

SERVER = "churn"
PHASES = {False: (8.0, 8.0), True: (4.0, 4.0)}  # (steady, after the rejoin) seconds; key: --quick
STATIC_ROUNDS = {False: 3, True: 2}
WINDOW = 0.5  # seconds of the sliding window the recovery time is judged on
SAMPLE = 0.05  # seconds between samples of the primary's counter
TIMEOUT = 60.0


def _static_body(world: Any, quick: bool) -> List[Dict[str, Any]]:
    torch.set_num_threads(1)
    group = world.create_rpc_group("bench", world.get_members())
    rounds = [ps._grad_round(world, group, "ours", index, ps.ITERATIONS[quick]) for index in range(STATIC_ROUNDS[quick])]
    group.barrier()
    group.destroy()
    return rounds


def _static_rate(per_rank: List[List[Dict[str, Any]]]) -> float:
    rates = []
    for index in range(len(per_rank[0])):
        trainers = [per_rank[int(t)][index] for t in ps.TRAINERS]
        rates.append(sum(t["pushes"] for t in trainers) / max(t["elapsed"] for t in trainers))
    return statistics.median(rates)


def _key(world: Any, name: str) -> str:
    return world.membership.keys.scratch(f"churn-bench/{name}")


def _impl(group: Any) -> PushPullGradServerImpl:
    return PushPullGradServerImpl(SERVER, group, primary_reducer="0", reduce_method="mean", reduce_batch_size=2,
                                  max_queue_size=64)


def _primary(world: Any, group: Any, quick: bool) -> Dict[str, Any]:
    registry = world.membership.registry
    impl = _impl(group)
    model = ps.make_model()
    impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=ps.LR, momentum=0.9))
    impl.start()
    registry.set(_key(world, "ready"), "1")
    registry.wait_all(_key(world, "pushing/"), list(ps.TRAINERS), TIMEOUT, "trainers pushing")
    steady, after = PHASES[quick]
    samples: List[Tuple[float, int]] = []
    start = time.time()
    killed_at: Optional[float] = None
    rejoined_at: Optional[float] = None
    deadline = start + steady + after + TIMEOUT  # the kill, the restart and the rejoin fit well within it
    while True:
        now = time.time()
        samples.append((now, impl.stats()["primary"]["applied"]))
        if killed_at is None and now - start >= steady:
            os.kill(int(registry.get_or_empty(_key(world, "pid/2"))), signal.SIGKILL)
            killed_at = time.time()
        if killed_at is not None and rejoined_at is None:
            mark = registry.get_or_empty(_key(world, "rejoined"))
            rejoined_at = float(mark) if mark else None
        if rejoined_at is not None and now - rejoined_at >= after:
            break
        if now > deadline:
            raise TimeoutError(f"trainer 2 did not rejoin within {deadline - killed_at:.0f} s of its kill")
        time.sleep(SAMPLE)  # sampling period, not synchronisation
    registry.set(_key(world, "end"), "1")
    registry.wait_all(_key(world, "done/"), list(ps.TRAINERS), TIMEOUT, "trainers done")
    stats = impl.stats()
    impl.close()
    return {"samples": samples, "start": start, "killed_at": killed_at, "rejoined_at": rejoined_at,
            "members": stats["members"], "dropped": stats["primary"]["dropped_dead_reducer"],
            "applied": stats["primary"]["applied"]}


def _trainer(world: Any, group: Any) -> int:
    registry = world.membership.registry
    me = world.name
    registry.wait_all(_key(world, ""), ["ready"], TIMEOUT, "the primary")
    if registry.get_or_empty(_key(world, "end")):
        return 0  # restarted after the run ended
    world.wait_for_members(["0"], TIMEOUT)
    impl = _impl(group)
    impl.start()
    server = group.get_paired(SERVER, timeout=TIMEOUT).to_here()
    registry.set(_key(world, f"pid/{me}"), str(os.getpid()))
    model, data = ps.make_model(), ps._data(1)
    pushes = 0
    while not registry.get_or_empty(_key(world, "end")):
        server.pull(model)
        ps._train_step(model, data)
        if server.push(model, pull=False):
            pushes += 1
            if pushes == 1:
                registry.set(_key(world, f"pushing/{me}"), "1")
                if world.incarnation > 1:
                    registry.set(_key(world, "rejoined"), str(time.time()))
    registry.set(_key(world, f"done/{me}"), "1")
    # Stay (hosting the secondary) until the primary has closed the server.
    world.wait_for_members(["0"], TIMEOUT, gone=True)
    impl.close()
    return pushes


def _elastic_body(world: Any, quick: bool) -> Any:
    torch.set_num_threads(1)
    group = world.create_rpc_group("bench")  # open: the restarted trainer rejoins at once
    if world.name == "0":
        return _primary(world, group, quick)
    return _trainer(world, group)


def _rate(samples: List[Tuple[float, int]], t0: float, t1: float) -> float:
    inside = [(t, n) for t, n in samples if t0 <= t <= t1]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return float("nan")
    return (inside[-1][1] - inside[0][1]) / (inside[-1][0] - inside[0][0])


def _recovery(samples: List[Tuple[float, int]], killed: float, target: float) -> Optional[float]:
    for i, (t, n) in enumerate(samples):
        if t < killed:
            continue
        for t2, n2 in samples[i + 1:]:
            if t2 - t >= WINDOW:
                if (n2 - n) / (t2 - t) >= target:
                    return t2 - killed
                break
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases, fewer rounds (< 60 s)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    began = time.monotonic()
    static = _static_rate(launch(_static_body, 3, args=(args.quick,), timeout=600, rpc_timeout=120))
    results = launch(_elastic_body, 3, args=(args.quick,), timeout=600, rpc_timeout=120, max_restarts=1,
                     essential=[0])
    run = results[0]
    samples, killed, rejoined = run["samples"], run["killed_at"], run["rejoined_at"]
    steady = _rate(samples, run["start"], killed)
    during = _rate(samples, killed, rejoined)
    after = _rate(samples, rejoined, samples[-1][0])
    recovery = _recovery(samples, killed, 0.9 * steady)
    rows = [
        ("pushes/s, steady (2 trainers)", steady),
        ("pushes/s, kill -> restarted trainer's first push", during),
        ("pushes/s, after the rejoin", after),
    ]
    width = max(len(r[0]) for r in rows + [("recovery time (kill -> 90% of steady), s", 0)])
    print(f"{'measure':<{width}}  {'static':>10}  {'elastic':>10}  {'ratio':>7}")
    for name, value in rows:
        print(f"{name:<{width}}  {static:>10.1f}  {value:>10.1f}  {value / static:>7.2f}")
    shown = f"{recovery:.2f}" if recovery is not None else "not within the run"
    print(f"{'recovery time (kill -> 90% of steady), s':<{width}}  {'-':>10}  {shown:>10}")
    print(f"{'kill -> rejoin (first accepted push), s':<{width}}  {'-':>10}  {rejoined - killed:>10.2f}")
    accepted = sum(r for r in results[1:] if isinstance(r, int))  # the survivors' and last incarnations' counts
    print(f"members seen by the server: {run['members']}; pushes dropped with the dead reducer: {run['dropped']}; "
          f"applied {run['applied']} (trainers' final incarnations accepted {accepted}; the killed one's are not "
          f"counted there)")
    print(f"static: param_server.py's machinlike gradient round ({ps.ITERATIONS[args.quick]} iterations per trainer, "
          f"median of {STATIC_ROUNDS[args.quick]} rounds); elastic: primary's applied pushes sampled every "
          f"{SAMPLE * 1000:.0f} ms, steady {PHASES[args.quick][0]:g} s, after {PHASES[args.quick][1]:g} s; recovery "
          f"judged on {WINDOW:g} s windows. Ratios are elastic / static. Load average (1 min) before the run: "
          f"{load_before:.1f} on {os.cpu_count()} cores; total {time.monotonic() - began:.1f} s.")


if __name__ == "__main__":
    main()
