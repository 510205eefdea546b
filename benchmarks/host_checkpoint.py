"""What the ordered and model servers' checkpoint option costs, beside the same servers
without it, in one run; and how long a host takes to resume and be named when it dies.

Run:  python benchmarks/host_checkpoint.py [--quick]

A world of two processes: rank 0 hosts the servers, rank 1 times them (alternating
blocks, medians, as ``benchmarks/param_server.py`` does).

1. Ordered server, push+pull of a small value: no checkpoint vs ``checkpoint_every=100``
   (a version lease write every 1024 versions, a snapshot every 100).
2. Model server, push+pull of ``param_server.py``'s ~4 MB MLP: no checkpoint vs
   ``checkpoint_every=100`` and ``checkpoint_every=10`` (a snapshot is written by the
   pushing call, so every 10th push pays a ~4 MB fsync'd write).
3. Resume: rank 0 closes the checkpointed model server (writing a checkpoint) and
   constructs it again from the directory; the construction time is reported.
4. The host's death: an elastic world (``launch(max_restarts=1)``); the client SIGKILLs
   the host and times its next call until it raises ``PeerLostError`` naming the host,
   and from the kill to the restarted host's first answer.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
import tempfile
import time
from typing import Any, Dict, List

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)  # param_server.py's model and paired-block timing are reused

import param_server as ps  # noqa: E402

from machinlike import launch  # noqa: E402
from machinlike.exception import PeerLostError  # noqa: E402
from machinlike.server import OrderedServerSimpleImpl, PushPullModelServerImpl  # noqa: E402

TIMEOUT = 60.0


def _ordered(group: Any, quick: bool) -> Dict[str, float]:
    plain, ckpt = group.get_paired("kv").to_here(), group.get_paired("kv_ckpt").to_here()
    value = {"step": 1, "reward": 0.5, "epsilon": 0.1}
    state = {"kv": 0, "kv_ckpt": 0}

    def cycle(server: Any, name: str) -> None:
        v = state[name]
        assert server.push("k", value, v + 1, v)
        server.pull("k")
        state[name] = v + 1

    return ps._paired_blocks(lambda: cycle(plain, "kv"), lambda: cycle(ckpt, "kv_ckpt"),
                             100 if quick else 300, 5 if quick else 11)


def _model(group: Any, quick: bool, name: str) -> Dict[str, float]:
    plain, ckpt = group.get_paired("ms").to_here(), group.get_paired(name).to_here()
    models = {"raw": (ps.make_model(), ps.make_model()), "ours": (ps.make_model(), ps.make_model())}

    def cycle(server: Any, label: str) -> None:
        pusher, behind = models[label]
        assert server.push(pusher)
        object.__setattr__(behind, "pp_version", -1)  # always behind: the pull must transfer
        assert server.pull(behind)

    plain.pull(models["raw"][0])  # the plain server was pushed to before: start from its newest
    ckpt.pull(models["ours"][0])
    return ps._paired_blocks(lambda: cycle(plain, "raw"), lambda: cycle(ckpt, "ours"),
                             10 if quick else 20, 5 if quick else 9)


def _static_body(world: Any, quick: bool, directory: str) -> Dict[str, Any]:
    torch.set_num_threads(1)
    group = world.create_rpc_group("bench", world.get_members())
    out: Dict[str, Any] = {}
    impls: List[Any] = []
    if world.name == "0":
        impls = [OrderedServerSimpleImpl("kv", group), PushPullModelServerImpl("ms", group),
                 OrderedServerSimpleImpl("kv_ckpt", group, checkpoint_dir=directory, checkpoint_every=100),
                 PushPullModelServerImpl("ms_100", group, checkpoint_dir=directory, checkpoint_every=100),
                 PushPullModelServerImpl("ms_10", group, checkpoint_dir=directory, checkpoint_every=10)]
    group.barrier()
    if world.name == "1":
        out["ordered"] = _ordered(group, quick)
        out["model_100"] = _model(group, quick, "ms_100")
        out["model_10"] = _model(group, quick, "ms_10")
    group.barrier()
    if world.name == "0":
        out["checkpoints"] = impls[3].stats()["ordered"]["checkpoints"]
        impls[3].close()
        start = time.perf_counter()
        again = PushPullModelServerImpl("ms_100", group, checkpoint_dir=directory, checkpoint_every=100)
        out["resume"] = time.perf_counter() - start
        out["resumed_version"] = again.stats()["version"]
        for impl in impls[:3] + impls[4:] + [again]:
            impl.close()
    group.barrier()
    group.destroy()
    return out


def _key(world: Any, name: str) -> str:
    return world.membership.keys.scratch(f"bench-host/{name}")


def _kill_body(world: Any, directory: str) -> Dict[str, float]:
    registry = world.membership.registry
    group = world.create_rpc_group("g")
    if world.name == "h":
        impl = PushPullModelServerImpl("ms", group, checkpoint_dir=directory, checkpoint_every=1)
        registry.set(_key(world, "pid"), str(os.getpid()))
        registry.set(_key(world, f"ready{world.incarnation}"), "1")
        registry.wait_all(_key(world, ""), ["end"], TIMEOUT, "the client")
        impl.close()
        return {}
    registry.wait_all(_key(world, ""), ["ready1"], TIMEOUT, "the host")
    world.wait_for_members(["h"], timeout=TIMEOUT)
    server = group.get_paired("ms", timeout=TIMEOUT).to_here()
    model = ps.make_model()
    for _ in range(3):
        assert server.push(model)
    fd = os.pidfd_open(int(registry.get_or_empty(_key(world, "pid"))))
    os.kill(int(registry.get_or_empty(_key(world, "pid"))), signal.SIGKILL)
    killed = time.monotonic()
    try:
        server.pull(model)
        raise AssertionError("a pull from a killed host succeeded")
    except PeerLostError as err:
        assert err.member == "h"
    named = time.monotonic() - killed
    assert select.select([fd], [], [], TIMEOUT)[0]
    os.close(fd)
    registry.wait_all(_key(world, ""), ["ready2"], TIMEOUT, "the restarted host")
    world.membership.wait_until(lambda live: world.get_incarnation("h") == 2, TIMEOUT)
    assert server.pull(model)  # the same accessor: the resumed state under a fresh version
    back = time.monotonic() - killed
    registry.set(_key(world, "end"), "1")
    return {"named": named, "back": back}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as directory:
        per_rank = launch(_static_body, 2, args=(args.quick, directory), timeout=600, rpc_timeout=120)
    with tempfile.TemporaryDirectory() as directory:
        kill = launch(_kill_body, 2, args=(directory,), names=["c", "h"], max_restarts=1, essential=["c"],
                      timeout=120)[0]
    client, host = per_rank[1], per_rank[0]
    ordered, m100, m10 = client["ordered"], client["model_100"], client["model_10"]
    mb = sum(p.numel() * p.element_size() for p in ps.make_model().state_dict().values()) / 2 ** 20
    rows = [
        ("ordered push+pull, small value (ops/s)", 2 / ordered["raw"], 2 / ordered["ours"],
         ordered["raw"] / ordered["ours"], ">= 0.90"),
        (f"model push+pull, {mb:.1f} MB, checkpoint_every=100 (pairs/s)", 1 / m100["raw"], 1 / m100["ours"],
         m100["raw"] / m100["ours"], ">= 0.85"),
        (f"model push+pull, {mb:.1f} MB, checkpoint_every=10 (pairs/s)", 1 / m10["raw"], 1 / m10["ours"],
         m10["raw"] / m10["ours"], "report"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'no ckpt':>10}  {'ckpt':>10}  {'ratio':>6}  target")
    for name, raw, mine, ratio, target in rows:
        print(f"{name:<{width}}  {raw:>10.1f}  {mine:>10.1f}  {ratio:>6.2f}  {target}")
    print(f"resume of the {mb:.1f} MB model server from its checkpoint: {host['resume'] * 1e3:.1f} ms "
          f"(resumed as version {host['resumed_version']}; {host['checkpoints']} checkpoints written)")
    print(f"host SIGKILLed: the client's next call named it in {kill['named'] * 1e3:.1f} ms; the restarted host "
          f"answered the same accessor {kill['back']:.2f} s after the kill (process start included)")
    print(f"Ratios are checkpointed / plain rates; medians of alternating blocks. One torch thread per process. "
          f"Load average (1 min) before the run: {load_before:.1f} on {os.cpu_count()} cores.")


if __name__ == "__main__":
    main()
