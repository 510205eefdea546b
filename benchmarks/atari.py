"""Atari IMPALA on this machine: its measured ceiling, the example's training throughput
with local and central inference, Sample Factory 2.1.1 on the same task, and collection
alone, in one run.

Run:  python benchmarks/atari.py [--quick]      (--quick: the same comparison in < 10 min)

    (a) ceiling     env stepping alone on every core (one process per core, 16 games
                    each, random actions); Nature-CNN forward per observation at the
                    example's actor batch (16) and forward+backward+step per sample at
                    its learner's optimizer step (16 games x 32 steps: --minibatches 1),
                    one torch thread each, with the example's allocator setting
                    (_util.reuse_large_buffers). Training on every
                    agent step costs env + forward + learn core-seconds per step, so
                    ceiling = cores / (1/env_rate_per_core + forward + learn).
    (b) ours        examples/impala_atari.py --algo impala, --inference local, then central; the
                    steady agent steps/s it prints (after its warm-up).
    (c) SF 2.1.1    APPO on PongNoFrameskip-v4 with its own Atari preprocessing (84x84
                    grey, frameskip 4 max-pooled, 4-frame stack), its "convnet_atari"
                    (the Nature-CNN), 2 rollout workers, CPU; in a virtualenv this script
                    makes under ~/.cache/machinlike-bench (reused when present): its pins
                    (numpy<2, gymnasium 0.29) cannot share ours. Its 10-s "Fps" after
                    warm-up, / 4 for agent steps.
    (d) collection  no learner: 2 actors x 16 games with local inference against the same
                    actors calling one InferenceServer (on a third process), with
                    max_wait 0 (take what waits) and 2 ms (the default); the server's
                    queue-wait p95; a no-op infer round trip against a raw registered_sync.

The last line: ``atari: ours/ceiling R1, ours/sample-factory R2`` (ours: the faster of
local and central). Single runs on a shared machine: read the ratios, not the absolutes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Tuple

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
EXAMPLES = os.path.join(ROOT, "examples")
sys.path[:0] = [EXAMPLES, ROOT]

import _util  # noqa: E402
from _atari_learner import vtrace_loss  # noqa: E402
from impala_atari import NatureCNN, Sampler, make_envs  # noqa: E402

from machinlike import launch  # noqa: E402
from machinlike.server import InferenceServerImpl  # noqa: E402

CACHE = os.path.join(os.path.expanduser("~"), ".cache", "machinlike-bench")
SF_VENV = os.path.join(CACHE, "sf-2.1.1")
SF_PINS = ["torch==2.13.0", "sample-factory==2.1.1", "ale-py==0.9.1", "opencv-python-headless", "numpy<2"]
# ale-py 0.9.1 with gymnasium 0.29 registers no ALE ids by itself: without this, Sample
# Factory fails with "Environment `PongNoFrameskip` doesn't exist". Registered at import so
# that its spawned workers (which import this file as __mp_main__) have them too.
SF_LAUNCHER = '''import sys
from ale_py import registration
import gymnasium
if "PongNoFrameskip-v4" not in gymnasium.registry:
    registration.register_v0_v4_envs()
    registration.register_v5_envs()
if __name__ == "__main__":
    from sf_examples.atari.train_atari import main
    sys.exit(main())
'''
GAME, ENVS, UNROLL, ACTIONS = "pong", 16, 32, 6
MINIBATCHES = 1  # the example's --minibatches (default)
WAITS = (0.0, 0.002)  # the collection's servers' max_wait: take what waits, and the default


# ----------------------------------------------------------------------- (a) ceiling
def _env_steps(seconds: float) -> int:
    import numpy as np

    env = make_envs(GAME, ENVS)
    env.reset(seed=os.getpid())
    rng = np.random.default_rng(0)
    steps, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
        env.step(rng.integers(0, ACTIONS, ENVS))
        steps += ENVS
    env.close()
    return steps


def ceiling(quick: bool) -> Dict[str, float]:
    cores = os.cpu_count() or 1
    seconds = 8.0 if quick else 20.0
    with multiprocessing.get_context("spawn").Pool(cores) as pool:
        env_rate = sum(pool.map(_env_steps, [seconds] * cores)) / seconds
    torch.set_num_threads(1)
    _util.reuse_large_buffers()  # as the example's processes do
    model = NatureCNN(ACTIONS)
    obs = torch.randint(0, 256, (ENVS, 4, 84, 84), dtype=torch.uint8)
    with torch.no_grad():
        for _ in range(20):
            model(obs)
        times = []
        for _ in range(60 if quick else 200):
            began = time.perf_counter()
            model(obs)
            times.append(time.perf_counter() - began)
    forward = statistics.median(times) / ENVS
    games = ENVS // MINIBATCHES  # per optimizer step, as the example's learner
    batch = [{"obs": torch.randint(0, 256, (UNROLL + 1, games, 4, 84, 84), dtype=torch.uint8),
              "actions": torch.randint(0, ACTIONS, (UNROLL, games)), "rewards": torch.zeros(UNROLL, games),
              "done": torch.zeros(UNROLL, games), "logp": torch.full((UNROLL, games), -1.8)}]
    args = argparse.Namespace(gamma=0.99, baseline_cost=0.5, entropy_cost=0.01)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=6e-4, alpha=0.99, eps=0.01)
    times = []
    for i in range(9 if quick else 24):
        began = time.perf_counter()
        loss, _ = vtrace_loss(model, batch, args)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if i:  # the first builds the kernels' caches
            times.append(time.perf_counter() - began)
    learn = statistics.median(times) / (UNROLL * games)
    per_core = env_rate / cores
    return {"cores": cores, "env": env_rate, "forward_ms": forward * 1e3, "learn_ms": learn * 1e3,
            "train": cores / (1 / per_core + forward + learn), "collect": cores / (1 / per_core + forward)}


# -------------------------------------------------------------------- (b) the example
def ours(inference: str, seconds: float, out_dir: str) -> Tuple[Optional[float], str]:
    """Steady agent steps/s of impala_atari.py (None, with its output's tail, if none)."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    # --algo impala: the ceiling in (a) is that of V-trace's one pass per sample (APPO's
    # default, two epochs, is benchmarks/pong_race.py's).
    proc = subprocess.run([sys.executable, os.path.join(EXAMPLES, "impala_atari.py"), "--algo", "impala",
                           "--inference", inference,
                           "--time-budget", str(seconds), "--target", "0", "--print-every", "15",
                           "--out", os.path.join(out_dir, f"{inference}.csv")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=seconds + 300, check=False)
    found = re.search(r"training throughput\s+([\d,]+) agent steps/s", proc.stdout)
    detail = next((" ".join(line.split()) for line in proc.stdout.splitlines()
                   if line.strip().startswith("inference ")), "")
    if proc.returncode != 0 or not found:
        return None, (proc.stdout + proc.stderr)[-1500:]
    return float(found.group(1).replace(",", "")), detail


# ----------------------------------------------------------------- (c) Sample Factory
def sf_python() -> str:
    """The Sample Factory virtualenv's python, made on first use (pip, a few minutes)."""
    python = os.path.join(SF_VENV, "bin", "python")
    if os.path.exists(os.path.join(SF_VENV, ".ready")):
        return python
    os.makedirs(CACHE, exist_ok=True)
    print(f"making Sample Factory's virtualenv in {SF_VENV} (once; a few minutes)", flush=True)
    shutil.rmtree(SF_VENV, ignore_errors=True)
    base = shutil.which("python3") or sys.executable  # not our venv's python: a clean interpreter
    subprocess.run([base, "-m", "venv", SF_VENV], check=True, timeout=300)
    pins = os.path.join(CACHE, "constraints.txt")
    with open(pins, "w") as stream:
        stream.write("torch==2.13.0\n")  # this machine's CPU wheel; never a CUDA download
    subprocess.run([python, "-m", "pip", "install", "-q", "-c", pins, *SF_PINS], check=True, timeout=1800)
    open(os.path.join(SF_VENV, ".ready"), "w").close()
    return python


def sample_factory(wall: float, wanted: int, out_dir: str) -> Tuple[Optional[float], str]:
    """Steady agent steps/s of SF's APPO on Pong (None and why, if it did not run).

    It runs until it printed ``wanted`` 10-s throughput reports after its first two
    (start-up), or for ``wall`` seconds in all; then its process group is stopped.
    """
    try:
        python = sf_python()
    except (subprocess.SubprocessError, OSError) as err:
        return None, f"its virtualenv could not be made: {err}"
    launcher = os.path.join(CACHE, "sf_train_atari.py")
    with open(launcher, "w") as stream:
        stream.write(SF_LAUNCHER)
    # The anchor's runnable configuration: synchronous mode refuses 2 x 8 envs with batch 256.
    cmd = [python, launcher, "--env=atari_pong", "--device=cpu", "--num_workers=2", "--num_envs_per_worker=8",
           "--batch_size=256", "--async_rl=True", f"--train_for_seconds={int(wall)}", "--with_wandb=False",
           f"--train_dir={out_dir}", "--experiment=sf_pong", "--restart_behavior=overwrite"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    path = os.path.join(out_dir, "sample_factory.log")
    with open(path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=out_dir, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: its workers stop with it
    deadline = time.monotonic() + wall
    try:
        while proc.poll() is None and time.monotonic() < deadline and len(_sf_steady(path)) < wanted:
            time.sleep(5.0)  # SF reports through its log only
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(20)
    with open(path, errors="replace") as stream:
        text = stream.read()
    steady = _sf_steady(path)
    if not steady:
        return None, f"no steady throughput report within {wall:g} s; its log ends: " + text[-1200:]
    lag = re.findall(r"Policy #0 lag: \(([^)]*)\)", text)
    return statistics.mean(steady) / 4, (f"{len(steady)} 10-s reports after start-up, {statistics.mean(steady):,.0f} "
                                         f"frames/s" + (f"; policy lag {lag[-1]}" if lag else ""))


def _sf_steady(path: str) -> List[float]:
    """SF's 10-s frames/s reports after its start-up: it reports 'nan', then 0 while its
    workers start; the first two non-zero reports still include the start."""
    with open(path, errors="replace") as stream:
        fps = [float(v) for v in re.findall(r"Fps is \(10 sec: ([\d.]+)", stream.read())]
    first = next((i for i, value in enumerate(fps) if value > 0), len(fps))
    return fps[first + 2:]


# --------------------------------------------------------------- (d) collection only
def _noop(x: torch.Tensor) -> torch.Tensor:
    return x


def _collect(world: Any, seconds: float) -> Dict[str, Any]:
    group = world.create_rpc_group("bench", world.get_members())
    wait = 20 * seconds + 600  # a barrier waits for the others' whole phase (set-up included)
    out: Dict[str, Any] = {}
    # One torch thread everywhere: a 2-thread forward on two cores that the actors keep
    # busy waits for its second thread at every layer (the server's queue-wait p95 was
    # 118 ms with two threads in an earlier run, 0.6 ms with one).
    torch.set_num_threads(1)
    _util.reuse_large_buffers()
    if world.rank == 0:
        policies = {wait: InferenceServerImpl(f"policy{wait:g}", group, NatureCNN(ACTIONS), max_batch=64,
                                              max_wait=wait, version=1) for wait in WAITS}
        noop = InferenceServerImpl("noop", group, _noop, max_wait=0.0)
        group.register("echo", _noop)
    else:
        sampler = Sampler(GAME, ENVS, 1000 * world.rank, torch.Generator().manual_seed(world.rank))
        model = NatureCNN(ACTIONS)
    group.barrier(timeout=wait)
    if world.rank == 1:  # a no-op round trip, blocks alternated so that noise hits both
        x, acc = torch.zeros(1, 1), group.get_paired("noop").to_here()
        infer_t, raw_t = [], []
        for _ in range(9):
            for times, call in ((infer_t, lambda: acc.infer(x, timeout=30)),
                                (raw_t, lambda: group.registered_sync("echo", args=(x,), timeout=30))):
                block = []
                for _ in range(100):
                    began = time.perf_counter()
                    call()
                    block.append(time.perf_counter() - began)
                times.append(statistics.median(block))
        # The ratio: the median of neighbouring blocks' ratios (the machine's load drifts).
        out["noop_ratio"] = statistics.median(i / r for i, r in zip(infer_t, raw_t))
        out.update(noop_infer_us=statistics.median(infer_t) * 1e6, noop_raw_us=statistics.median(raw_t) * 1e6)
    group.barrier(timeout=wait)
    for mode in ("local", *(f"central{wait:g}" for wait in WAITS)):
        if world.rank > 0:
            if mode == "local":
                def act(obs: torch.Tensor) -> Tuple[torch.Tensor, int]:
                    with torch.no_grad():
                        return model(obs)[0], 0
            else:
                acc = group.get_paired(mode.replace("central", "policy")).to_here()

                def act(obs: torch.Tensor) -> Tuple[torch.Tensor, int]:
                    (logits, _), version = acc.infer(obs, timeout=60, with_version=True)
                    return logits, version
            sampler.unroll(act, UNROLL)  # warm-up
            steps, began = 0, time.monotonic()
            while time.monotonic() - began < seconds:
                sampler.unroll(act, UNROLL)
                steps += UNROLL * ENVS
            out[mode] = steps / (time.monotonic() - began)
        group.barrier(timeout=wait)
    if world.rank == 0:
        for wait, policy in policies.items():
            out[f"server{wait:g}"] = policy.stats()
            policy.close()
        noop.close()
    group.destroy()
    return out


def collection(quick: bool) -> Dict[str, Any]:
    results = launch(_collect, 3, args=(10.0 if quick else 30.0,), timeout=1800)
    actors = results[1:]
    out: Dict[str, Any] = {"local": sum(r["local"] for r in actors), "noop_infer_us": results[1]["noop_infer_us"],
                           "noop_raw_us": results[1]["noop_raw_us"], "noop_ratio": results[1]["noop_ratio"],
                           "central": {}}
    for wait in WAITS:
        server = results[0][f"server{wait:g}"]
        out["central"][wait] = (sum(r[f"central{wait:g}"] for r in actors), server["mean_batch"],
                                1e3 * (server["queue_wait_p95"] or 0.0))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter phases: the same comparison in < 10 min")
    parser.add_argument("--parts", default="abcd",
                        help="which parts to run, e.g. 'ad' (default abcd; the last line needs a, b and c)")
    options = parser.parse_args()
    quick, parts = options.quick, set(options.parts)
    if not parts or parts - set("abcd"):
        parser.error(f"--parts {options.parts!r}: letters among a, b, c, d")
    began = time.monotonic()
    out_dir = tempfile.mkdtemp(prefix="machinlike-atari-bench-")
    load = os.getloadavg()[0]
    print(f"atari benchmark ({'quick' if quick else 'full'}); {os.cpu_count()} cores; load average {load:.1f} at "
          f"the start (a shared machine: figures are lower bounds)", flush=True)

    nan = float("nan")
    c: Dict[str, float] = {"train": nan}
    if "a" in parts:
        c = ceiling(quick)
        print(f"(a) ceiling: env alone {c['env']:,.0f} agent steps/s on {c['cores']:.0f} cores "
              f"({4 * c['env']:,.0f} frames/s); Nature-CNN forward {c['forward_ms']:.3f} ms/obs at batch {ENVS}; "
              f"forward+backward+step {c['learn_ms']:.3f} ms/sample at batch {ENVS // MINIBATCHES}x{UNROLL}; implied "
              f"ceilings: training {c['train']:,.0f} agent steps/s ({4 * c['train']:,.0f} frames/s), collection "
              f"{c['collect']:,.0f}", flush=True)

    rates: Dict[str, Optional[float]] = {}
    if "b" in parts:
        seconds = 90.0 if quick else 240.0
        for inference in ("local", "central"):
            rate, detail = ours(inference, seconds, out_dir)
            rates[inference] = rate
            shown = (f"{rate:,.0f} agent steps/s ({4 * rate:,.0f} frames/s), {rate / c['train']:.2f}x the ceiling; "
                     f"{detail}") if rate else f"did not report a throughput: {detail}"
            print(f"(b) ours, {inference} inference ({seconds:g} s budget): {shown}", flush=True)

    sf_rate: Optional[float] = None
    if "c" in parts:
        sf_rate, sf_detail = sample_factory(360.0 if quick else 900.0, 6 if quick else 24, out_dir)
        if sf_rate is not None:
            print(f"(c) Sample Factory 2.1.1 APPO, 2 workers x 8 envs: {sf_rate:,.0f} agent steps/s "
                  f"({4 * sf_rate:,.0f} frames/s); {sf_detail}", flush=True)
        else:
            print(f"(c) Sample Factory 2.1.1 did not run Atari here: {sf_detail}", flush=True)

    if "d" in parts:
        d = collection(quick)
        central = "; ".join(f"central max_wait={1e3 * wait:g} ms {rate:,.0f} ({rate / d['local']:.2f}x local, mean "
                            f"batch {batch:.1f}, server queue-wait p95 {p95:.2f} ms)"
                            for wait, (rate, batch, p95) in d["central"].items())
        print(f"(d) collection only, 2 actors x {ENVS} games: local {d['local']:,.0f} agent steps/s; {central}; "
              f"no-op round trip: infer {d['noop_infer_us']:.0f} us, raw registered_sync {d['noop_raw_us']:.0f} us "
              f"({d['noop_ratio']:.2f}x, the median of alternated blocks' ratios)", flush=True)

    shutil.rmtree(out_dir, ignore_errors=True)
    print(f"total {time.monotonic() - began:.0f} s; load average now {os.getloadavg()[0]:.1f}", flush=True)
    best = max((r for r in rates.values() if r), default=None)
    r1 = f"{best / c['train']:.2f}" if best and c["train"] == c["train"] else "n/a"
    r2 = f"{best / sf_rate:.2f}" if best and sf_rate else "n/a"  # n/a: said in (c)
    print(f"atari: ours/ceiling {r1}, ours/sample-factory {r2}")


if __name__ == "__main__":
    main()
