"""Pong race: our APPO example and Sample Factory 2.1.1's APPO, each trained for the same
wall time on this machine, one after the other (each has every core while it runs).

Run:  python benchmarks/pong_race.py [--minutes 20]

    ours    examples/impala_atari.py --algo appo (its defaults for the device: on the CPU,
            2 actors x 16 games x 128-step unrolls, 2 epochs x 4 minibatches of each 2,048-step
            batch, normalised inputs and values),
            --time-budget = the race's seconds, --target 0 (no early stop), its learning
            curve beside the log.
    SF      sample-factory 2.1.1's sf_examples.atari.train_atari on PongNoFrameskip-v4:
            its Atari defaults (PPO, 4 epochs, clip 0.1, lr 2.5e-4, the Nature-CNN) with
            2 rollout workers x 8 envs, batch 256, asynchronous, CPU (the configuration
            benchmarks/atari.py runs), --train_for_seconds = the race's seconds.

The same game and preprocessing: NoFrameskip-v4 conventions (frameskip 4 max-pooled, no
sticky actions, up to 30 no-ops at reset), 84x84 grey, a 4-frame stack, rewards clipped
for training; both report the unclipped game score, the mean of the last 100 games (SF's
``policy_stats/avg_RecordEpisodeStatistics_reward`` in its TensorBoard summaries: the
``Avg episode reward`` of its log is of its own, clipped episodes). SF's virtualenv is
benchmarks/atari.py's (made on first use under ~/.cache/machinlike-bench).

The last line: ``pong race: minutes M, ours R1, sample-factory R2, frames/s ratio X``
(R: the mean return at the end, "n/a" before 100 games (SF) or one (ours) ended; X: ours' frames/s
over SF's). One run each on a shared machine: the frames/s are lower bounds.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Dict, List, Optional

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
sys.path[:0] = [BENCH_DIR]

from atari import CACHE, SF_LAUNCHER, _sf_steady, sf_python  # noqa: E402

__all__ = ["race_ours", "race_sample_factory", "main"]


def race_ours(seconds: float, out_dir: str) -> Dict[str, object]:
    """Train the example for ``seconds``; its final mean return, frames/s and milestones.

    Raises:
        RuntimeError: the example failed or printed no summary (its output's tail says why).
    """
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    log_path = os.path.join(out_dir, "ours.log")
    began = time.monotonic()
    with open(log_path, "w") as log:
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "impala_atari.py"), "--algo", "appo",
                               "--time-budget", str(seconds), "--target", "0", "--print-every", "30",
                               "--out", os.path.join(out_dir, "ours.csv"),
                               "--curve", os.path.join(out_dir, "ours_curve.png")],
                              cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=seconds + 600,
                              check=False)
    wall = time.monotonic() - began
    with open(log_path, errors="replace") as stream:
        text = stream.read()
    mean = re.search(r"mean return, last \d+ episodes\s+(\S+)", text)
    rate = re.search(r"training throughput\s+[\d,]+ agent steps/s \(([\d,]+) frames/s\)", text)
    frames = re.search(r"frames \(agent steps x 4\)\s+([\d,]+)", text)
    if proc.returncode != 0 or not mean:
        raise RuntimeError(f"the example failed (exit {proc.returncode}); {log_path} ends: {text[-1500:]}")
    return {"mean": None if mean.group(1) == "-" else float(mean.group(1)),
            "fps": float(rate.group(1).replace(",", "")) if rate else None,
            "frames": int(frames.group(1).replace(",", "")) if frames else 0,
            "milestones": re.findall(r"^first mean >= .*$", text, re.M), "wall": wall,
            "episodes": int(re.search(r"^\s+episodes\s+(\d+)\s*$", text.split("== APPO")[-1], re.M).group(1)),
            "log": log_path}


def race_sample_factory(seconds: float, wall: float, out_dir: str) -> Dict[str, object]:
    """Train SF's APPO on Pong for ``seconds`` (``--train_for_seconds``), stopped ``wall``
    seconds after its launch at the latest; its last mean game score and steady frames/s.

    Raises:
        RuntimeError: its virtualenv could not be made, or it reported no throughput.
    """
    try:
        python = sf_python()
    except (subprocess.SubprocessError, OSError) as err:
        raise RuntimeError(f"Sample Factory's virtualenv could not be made: {err}") from err
    launcher = os.path.join(CACHE, "sf_train_atari.py")
    with open(launcher, "w") as stream:
        stream.write(SF_LAUNCHER)
    cmd = [python, launcher, "--env=atari_pong", "--device=cpu", "--num_workers=2", "--num_envs_per_worker=8",
           "--batch_size=256", "--async_rl=True", f"--train_for_seconds={int(seconds)}", "--with_wandb=False",
           f"--train_dir={out_dir}", "--experiment=sf_pong_race", "--restart_behavior=overwrite"]
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    path = os.path.join(out_dir, "sample_factory.log")
    began = time.monotonic()
    with open(path, "w") as log:
        proc = subprocess.Popen(cmd, env=env, cwd=out_dir, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # its own group: its workers stop with it
    try:
        # The same wall time from launch as ours had: SF's --train_for_seconds counts from its
        # own start of training, and on a loaded machine it was seen running minutes past it.
        proc.wait(timeout=wall)
    except subprocess.TimeoutExpired:
        pass
    finally:
        # SIGINT first: SF stops its workers and flushes its summaries on KeyboardInterrupt.
        for sig, grace in ((signal.SIGINT, 30), (signal.SIGTERM, 20), (signal.SIGKILL, 20)):
            if proc.poll() is not None:
                break
            os.killpg(proc.pid, sig)
            try:
                proc.wait(grace)
            except subprocess.TimeoutExpired:
                pass
    took = time.monotonic() - began
    with open(path, errors="replace") as stream:
        text = stream.read()
    # After its start-up (see atari._sf_steady); in a short race, any non-zero 10-s report.
    steady = _sf_steady(path) or [float(v) for v in re.findall(r"Fps is \(10 sec: ([\d.]+)", text) if float(v) > 0]
    if not steady:
        raise RuntimeError(f"it trained on no frame within {took:.0f} s of its launch (its start-up: a loaded "
                           f"machine slows it); {path} ends: {text[-600:]}")
    # SF's log prints its own episodes' clipped rewards ("Avg episode reward"), whose episodes
    # its wrappers may cut short of a game; the game's score over whole games is
    # RecordEpisodeStatistics', which it writes to TensorBoard only once 100 games ended.
    own: List[str] = re.findall(r"Avg episode reward: \[\(0, '(-?[\d.]+)'\)\]", text)
    return {"mean": _sf_game_score(os.path.join(out_dir, "sf_pong_race", ".summary", "0")),
            "own": float(own[-1]) if own else None, "fps": statistics.mean(steady), "wall": took, "log": path}


def _sf_game_score(summary_dir: str) -> Optional[float]:
    """The last ``policy_stats/avg_RecordEpisodeStatistics_reward`` SF wrote (the mean game
    score of its last 100 games), read with TensorBoard's reader; None before 100 games."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not os.path.isdir(summary_dir):
        return None
    events = EventAccumulator(summary_dir)
    events.Reload()
    tag = "policy_stats/avg_RecordEpisodeStatistics_reward"
    if tag not in events.Tags()["scalars"]:
        return None
    return float(events.Scalars(tag)[-1].value)


def _shown(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0, help="training wall time of each (default 20)")
    options = parser.parse_args(argv)
    if options.minutes <= 0:
        parser.error(f"--minutes {options.minutes:g} must be > 0 (e.g. --minutes 2 for a quick check)")
    seconds = 60.0 * options.minutes
    out_dir = tempfile.mkdtemp(prefix="machinlike-pong-race-")
    print(f"pong race: {options.minutes:g} minutes each, one after the other; {os.cpu_count()} cores, load "
          f"average {os.getloadavg()[0]:.1f}; logs in {out_dir}", flush=True)
    ours = race_ours(seconds, out_dir)
    print(f"ours (APPO, examples/impala_atari.py): mean return {_shown(ours['mean'])} over the last 100 episodes "
          f"({ours['episodes']} episodes), {ours['frames']:,} frames, {ours['fps'] or 0:,.0f} frames/s after warm-up; "
          f"{'; '.join(ours['milestones'])}; {ours['wall']:.0f} s from launch to exit", flush=True)
    try:
        sf = race_sample_factory(seconds, float(ours["wall"]), out_dir)
        print(f"Sample Factory 2.1.1 APPO (2 workers x 8 envs): mean game score {_shown(sf['mean'])} over the last "
              f"100 games (n/a: fewer ended; its own clipped episode reward {_shown(sf['own'])}), "
              f"{sf['fps']:,.0f} frames/s after start-up; {sf['wall']:.0f} s from launch to exit", flush=True)
    except RuntimeError as err:
        sf = {"mean": None, "fps": None}
        print(f"Sample Factory 2.1.1: {err}", flush=True)
    ratio = f"{ours['fps'] / sf['fps']:.2f}" if ours["fps"] and sf["fps"] else "n/a"
    print(f"pong race: minutes {options.minutes:g}, ours {_shown(ours['mean'])}, sample-factory "
          f"{_shown(sf['mean'])}, frames/s ratio {ratio}")


if __name__ == "__main__":
    main()
