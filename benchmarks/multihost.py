"""machinlike across two hosts against raw torch.distributed, side by side in one run.

Run (Linux, as root):  python benchmarks/multihost.py [--quick]

The two hosts are network namespaces joined by a veth pair (198.18.0.1 and 198.18.0.2, a
link that exists only inside them, removed at the end). One process runs on each, started
as a cluster job script would start it (``ip netns exec`` with RANK, WORLD_SIZE,
MASTER_ADDR and MASTER_PORT set), and builds its World from that environment. Rank 0
measures both contenders over the *same* World — the same TensorPipe agent and gloo
group, so the comparison is of machinlike's layer, not of two set-ups — alternating
blocks so that machine noise hits both alike; figures are medians over blocks. Ratios are
ours / raw for times, so > 1 means slower than raw torch.

Raw torch with its defaults does not get this far here: both hosts' names resolve to
127.0.0.1, which TensorPipe and gloo would advertise to the peer (the World picks the
interface that reaches the master instead; by hand: TP_SOCKET_IFNAME/GLOO_SOCKET_IFNAME).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Dict, List

from _netns import ADDRESSES, two_hosts

ROOT = Path(__file__).resolve().parent.parent


# ------------------------------------------------------------------------ one rank
def noop() -> None:
    return None


def echo(x: Any) -> Any:
    return x


def _per_call(fn: Callable[[], Any], calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def _paired(raw: Callable[[], Any], ours: Callable[[], Any], calls: int, blocks: int) -> Dict[str, float]:
    raw_t, ours_t = [], []
    for _ in range(blocks):  # alternate so that noise hits both
        raw_t.append(_per_call(raw, calls))
        ours_t.append(_per_call(ours, calls))
    return {"raw": statistics.median(raw_t), "ours": statistics.median(ours_t)}


def rank_job(quick: bool) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed import rpc

    from machinlike.distributed import World

    start = time.perf_counter()
    world = World(dist_timeout=120, rpc_timeout=120)
    results: Dict[str, Any] = {"startup": time.perf_counter() - start, "interface": world.interface}
    group = world.create_rpc_group("bench", world.get_members())
    everyone = world.create_collective_group(world.get_ranks())
    if world.rank == 1:
        group.register("noop", noop)
        group.register("echo", echo)
    group.barrier()
    blocks = 5 if quick else 15
    if world.rank == 0:
        calls = 50 if quick else 200
        for _ in range(50):  # warm connections and caches
            rpc.rpc_sync("1", noop)
            group.registered_sync("noop")
        results["latency"] = _paired(lambda: rpc.rpc_sync("1", noop), lambda: group.registered_sync("noop"),
                                     calls, blocks)
        tensor = torch.ones(4 * 1024 * 1024)  # 16 MiB of float32
        for _ in range(2):
            rpc.rpc_sync("1", echo, args=(tensor,))
            group.registered_sync("echo", (tensor,))
        results["echo16"] = _paired(lambda: rpc.rpc_sync("1", echo, args=(tensor,)),
                                    lambda: group.registered_sync("echo", (tensor,)), 1, 3 if quick else 9)
    group.barrier()
    # Both ranks run the same schedule: collectives need every member.
    rounds = 50 if quick else 200
    results["barrier"] = _paired(lambda: dist.barrier(), lambda: group.barrier(), rounds // 10, blocks)
    data = torch.ones(1024 * 1024)  # 4 MiB of float32
    results["all_reduce"] = _paired(lambda: dist.all_reduce(data), lambda: everyone.all_reduce(data),
                                    2, 3 if quick else 9)
    # (ours on gloo: the pairwise exchange; raw: gloo's own alltoall, where the torch has it)
    sent, received = [torch.ones(1024 * 1024) for _ in range(2)], [torch.zeros(1024 * 1024) for _ in range(2)]
    try:
        dist.all_to_all(received, sent)
    except RuntimeError:  # (gloo before torch 2.12 has none: no row)
        pass
    else:
        results["all_to_all"] = _paired(lambda: dist.all_to_all(received, sent),
                                        lambda: everyone.all_to_all(received, sent), 2, 3 if quick else 9)
    group.barrier()
    everyone.destroy()
    group.destroy()
    world.stop()
    if world.rank == 0:
        print("RESULT " + json.dumps(results), flush=True)


# ------------------------------------------------------------------------ the hosts
def _free_port(ns: str, address: str) -> int:
    # Nothing else runs in this fresh namespace, so the port stays free until rank 0 binds it.
    probe = "import socket,sys; s=socket.socket(); s.bind((sys.argv[1],0)); print(s.getsockname()[1])"
    out = subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", probe, address],
                         capture_output=True, text=True, timeout=30, check=True).stdout
    return int(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        rank_job(args.quick)
        return
    if sys.platform != "linux" or os.geteuid() != 0:
        sys.exit("this benchmark creates network namespaces: run it as root on Linux")
    procs: List[subprocess.Popen] = []
    with two_hosts("mlkbench") as hosts:
        port = _free_port(hosts[0], ADDRESSES[0])
        env = {k: v for k, v in os.environ.items() if not k.endswith("SOCKET_IFNAME")}
        env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                   WORLD_SIZE="2", MASTER_ADDR=ADDRESSES[0], MASTER_PORT=str(port), OMP_NUM_THREADS="1")
        argv = [sys.executable, str(Path(__file__).resolve()), "--rank-job"] + (["--quick"] if args.quick else [])
        for rank, ns in enumerate(hosts):
            procs.append(subprocess.Popen(["ip", "netns", "exec", ns, *argv], env=dict(env, RANK=str(rank)),
                                          stdout=subprocess.PIPE, text=True, start_new_session=True))
        # (A rank still running when this block ends goes with its namespace: two_hosts.)
        out, _ = procs[0].communicate(timeout=600)
        procs[1].wait(60)
        if procs[0].returncode or procs[1].returncode:
            sys.exit(f"a rank failed: exit codes {[p.returncode for p in procs]}")
    res = json.loads([line for line in out.splitlines() if line.startswith("RESULT ")][-1][len("RESULT "):])
    rows = []
    lat = res["latency"]
    rows.append(("registered_sync vs rpc_sync, no-op (us)", lat["raw"] * 1e6, lat["ours"] * 1e6))
    echo16 = res["echo16"]
    rows.append(("16 MiB tensor round trip (ms)", echo16["raw"] * 1e3, echo16["ours"] * 1e3))
    bar = res["barrier"]
    rows.append(("barrier: RpcGroup vs gloo (us)", bar["raw"] * 1e6, bar["ours"] * 1e6))
    red = res["all_reduce"]
    rows.append(("all_reduce 4 MiB: CollectiveGroup vs dist (ms)", red["raw"] * 1e3, red["ours"] * 1e3))
    if "all_to_all" in res:
        a2a = res["all_to_all"]
        rows.append(("all_to_all 2 x 4 MiB: CollectiveGroup vs dist (ms)", a2a["raw"] * 1e3, a2a["ours"] * 1e3))
    width = max(len(r[0]) for r in rows)
    print(f"two hosts (network namespaces, veth), interface {res['interface']}; "
          f"World() start-up on rank 0: {res['startup']:.2f} s")
    print(f"{'measure':<{width}}  {'raw torch':>10}  {'machinlike':>10}  {'ours/raw':>8}")
    for name, raw, ours in rows:
        print(f"{name:<{width}}  {raw:>10.1f}  {ours:>10.1f}  {ours / raw:>8.2f}")


if __name__ == "__main__":
    main()
