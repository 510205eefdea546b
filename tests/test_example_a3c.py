"""Smoke tests of examples/a3c.py: a short real run, and Ctrl-C stopping every process."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time

import pytest
from example_chaos import COMMON_TAGS, earlier_run, only_this_run, read_scalars
from example_run import run_example

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "examples", "a3c.py")


def example_env():
    # The examples import machinlike from the checkout, installed or not.
    return dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))


def test_a3c_runs_to_its_budget_and_writes_its_curve(tmp_path):
    out = tmp_path / "a3c.csv"
    earlier_run(str(tmp_path / "a3c"))  # a re-run: its metrics (runs/<name>/) start afresh
    done = run_example(SCRIPT, ["--num-workers", "2", "--envs-per-worker", "2", "--time-budget", "3",
                                "--out", str(out), "--metrics-every", "0.3", "--device", "cpu"], timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out, newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert rows, "no episode finished"
    assert {r["worker"] for r in rows} <= {"1", "2"} and int(rows[-1]["episode"]) == len(rows)
    assert "time budget of 3 s ran out" in done.stdout and "mean return" in done.stdout
    scalars = read_scalars(str(tmp_path / "a3c"))  # runs/<name>/ beside the curve
    missing = [t for t in COMMON_TAGS + ["learner/loss_actor", "learner/loss_critic", "learner/entropy",
                                         "learner/grad_norm", "learner/policy_lag", "server/actor/primary/applied",
                                         "server/actor/primary/dropped"] if t not in scalars]
    assert not missing, sorted(scalars)
    last = {tag: points[-1][1] for tag, points in scalars.items()}
    assert last["world/members_alive"] == 3 and last["server/actor/primary/applied"] > 0
    assert last["env/steps"] > 0 and 0 < last["learner/entropy"] <= 0.7
    only_this_run(str(tmp_path / "a3c"))


def test_ctrl_c_stops_the_whole_example(tmp_path):
    # Its own session, so that Ctrl-C (SIGINT to the foreground process group) reaches
    # the script and every process it started, as in a terminal.
    # As in a terminal, the example starts with SIGINT at its default action, also when this
    # run ignores it (a job started with '&' from a script inherits SIGINT ignored, and so
    # would the example: it then ran on after Ctrl-C, which is what the shell asked for). A
    # handler here is reset to the default in the exec'd child.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, SCRIPT, "--num-workers", "2", "--envs-per-worker", "2",
                                 "--stop-at", "0", "--time-budget", "120", "--print-every", "0.5",
                                 "--out", str(tmp_path / "a3c.csv")],
                                cwd=ROOT, env=example_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    try:
        for line in proc.stdout:  # wait until training runs (a progress line)
            if line.startswith("["):
                break
        os.killpg(proc.pid, signal.SIGINT)
        begin = time.monotonic()
        try:
            _, err = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            # Where it hangs: the launcher and every rank print their threads' stacks on
            # SIGUSR1 (faulthandler), and the failure shows them.
            os.killpg(proc.pid, signal.SIGUSR1)
            try:
                _, err = proc.communicate(timeout=10)
            except subprocess.TimeoutExpired as late:
                err = late.stderr.decode(errors="replace") if isinstance(late.stderr, bytes) else late.stderr
            pytest.fail(f"the example still ran 60 s after Ctrl-C; its stacks:\n{(err or '')[-30000:]}")
        stopped_in = time.monotonic() - begin
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 130, err
    assert "interrupted" in err
    assert stopped_in < 30.0
    left = group_members(proc.pid, deadline=time.monotonic() + 10.0)
    if left:
        os.killpg(proc.pid, signal.SIGKILL)
    assert not left, f"processes of the example outlived it: {left}"


def group_members(pgid, deadline):
    """Live (not zombie) processes of process group ``pgid``, waiting until ``deadline`` for them to go."""
    while True:
        left = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/stat") as stream:
                    fields = stream.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid and fields[0] != "Z":
                with open(f"/proc/{pid}/cmdline", "rb") as stream:
                    left.append((int(pid), stream.read().replace(b"\0", b" ").decode()[:120]))
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)  # polling the end of processes we do not own, not synchronising


def test_a3c_trains_through_a_worker_killed_by_chaos(tmp_path):
    # --chaos: an elastic world; every 2 s the launcher SIGKILLs a worker and restarts it.
    # The budget starts on the learner once the world formed: several kills fall inside it.
    out = tmp_path / "a3c.csv"
    done = run_example(SCRIPT, ["--num-workers", "2", "--envs-per-worker", "2", "--stop-at", "0",
                                "--time-budget", "8", "--chaos", "2", "--print-every", "0.5", "--out", str(out)],
                       timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    lost = next(i for i, x in enumerate(lines) if x.startswith("[learner] member") and "was lost" in x)
    # Training went on past the kill: a later progress line, and a restarted worker's episodes.
    assert any(x.startswith("[") and "env steps" in x for x in lines[lost + 1:]), done.stdout
    with open(out, newline="") as stream:
        assert list(csv.DictReader(stream)), "no episode in the learning curve"
    chaos = next(x for x in lines if x.strip().startswith("chaos") and "workers lost" in x)
    assert " 0 workers lost" not in chaos
