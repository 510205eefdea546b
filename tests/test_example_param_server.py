"""Smoke test of examples/param_server.py: a short real run through the gradient server."""

from __future__ import annotations

import csv
import importlib
import os
import re
import sys

import example_run
import pytest
from example_chaos import earlier_run, only_this_run, read_scalars
from proc_util import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_example(script, *args, timeout=150):
    return example_run.run_example(script, args, timeout=timeout)


def test_param_server_trains_and_writes_its_curve(tmp_path):
    out = tmp_path / "ps.csv"
    earlier_run(str(tmp_path / "ps"))  # a re-run: its metrics (runs/<name>/) start afresh
    done = run_example("param_server.py", "--num-workers", 2, "--epochs", 2, "--time-budget", 20, "--out", out,
                       "--device", "cpu")
    assert done.returncode == 0, done.stdout + done.stderr
    with open(out, newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert rows and "test_accuracy" in rows[0]
    assert "test accuracy" in done.stdout and "secondary reducers" in done.stdout
    # Both trainers' pushes went through their own secondary reducer.
    line = next(x for x in done.stdout.splitlines() if "secondary reducers" in x)
    assert line.count("pushes taken") == 2 and " 0 pushes taken" not in line
    # Every push a secondary took was applied (flushed at the end); the ones it refused
    # (its queue full: back-pressure, counted) make up the rest of the two epochs.
    taken = [int(n) for n in re.findall(r"(\d+) pushes taken", line)]
    refused = [int(n) for n in re.findall(r"(\d+) refused", line)]
    applied = int(re.search(r"optimizer steps from (\d+) pushes", done.stdout).group(1))
    assert applied == sum(taken), (applied, line)
    epochs = float(rows[-1]["epochs"])
    assert epochs * (sum(taken) + sum(refused)) / applied >= 1.99, (epochs, line)
    scalars = read_scalars(str(tmp_path / "ps"))  # runs/<name>/ beside the curve, x = pushes applied
    missing = [t for t in ("eval/test_accuracy", "eval/train_loss", "server/primary/applied",
                           "server/primary/dropped", "server/primary/lag_mean", "world/members_alive",
                           "world/deaths", "rss_mb/0", "rss_mb/1") if t not in scalars]
    assert not missing, sorted(scalars)
    accuracy = scalars["eval/test_accuracy"]
    # Well above chance (10 digits): 70-79 % alone, 45 % seen with two cores shared three
    # ways, where the pulls lag 15 versions behind (asynchronous SGD learns less per step).
    assert 0 <= accuracy[0][1] <= 1 and accuracy[-1][1] > 0.3 and accuracy[-1][0] == scalars["server/primary/applied"][-1][1]
    only_this_run(str(tmp_path / "ps"))


def test_param_server_help(monkeypatch, capsys):
    # main() in this process: argparse answers --help before anything starts (no new
    # interpreter importing torch to print a help text).
    monkeypatch.syspath_prepend(os.path.join(ROOT, "examples"))
    param_server = importlib.import_module("param_server")
    monkeypatch.setattr(sys, "argv", ["param_server.py", "--help"])
    with pytest.raises(SystemExit) as stopped:
        param_server.main()
    out = capsys.readouterr().out
    assert stopped.value.code == 0 and "--num-workers" in out and "--time-budget" in out


def test_param_server_trains_through_a_trainer_killed_by_chaos(tmp_path):
    # --chaos: an elastic world; every second the launcher SIGKILLs a trainer and restarts
    # it. 30 epochs, about 2 s on an idle 2-core machine: 12 took 0.8 s there and ended
    # before the first kill. Then a kill, rejoins and training after them, without a long
    # run slowed by a restart a second (at least 12 epochs within the budget).
    out = tmp_path / "ps.csv"
    done = run_example("param_server.py", "--num-workers", 2, "--epochs", 30, "--time-budget", 25, "--chaos", 1,
                       "--out", out, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    lost = next(i for i, x in enumerate(lines) if x.startswith("[server] member") and "was lost" in x)
    # Training went on past the kill: a later progress line, and the run applied every epoch.
    assert any(x.startswith("[") and "pushes applied" in x for x in lines[lost + 1:]), done.stdout
    with open(out, newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert float(rows[-1]["epochs"]) >= 12
    chaos = next(x for x in lines if x.strip().startswith("chaos") and "trainers lost" in x)
    assert " 0 trainers lost" not in chaos
    deaths = read_scalars(str(tmp_path / "ps"))["world/deaths"]
    assert deaths[-1][1] >= 1, deaths  # the kills show in the metrics (and as red lines in metrics.png)


def test_under_srun_a_dead_trainer_ends_every_task_at_once(tmp_path):
    # srun (without --kill-on-bad-exit) lets the other tasks of a step run on when one dies:
    # the server waited out its time budget plus 60 s for a trainer that was gone. It now
    # ends at its next look (every --eval-every s), naming the trainer. Three tasks as srun
    # starts them (its environment; no SLURM daemons needed).
    import signal
    import subprocess
    import time

    port = free_port()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))}
    base.update(SLURM_STEP_ID="0", SLURM_JOB_ID="43", SLURM_NTASKS="3", SLURM_STEP_NUM_TASKS="3",
                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, os.path.join(ROOT, "examples", "param_server.py"), "--num-workers", "2",
               "--epochs", "1000", "--time-budget", "100", "--no-metrics", "--out", str(tmp_path / "ps.csv")]
    logs = [tmp_path / f"task{r}.log" for r in range(3)]
    tasks = [subprocess.Popen(command, env=dict(base, SLURM_PROCID=str(r), SLURM_LOCALID=str(r)), cwd=tmp_path,
                              stdout=open(logs[r], "w"), stderr=subprocess.STDOUT) for r in range(3)]
    try:
        deadline = time.monotonic() + 90
        while "pushes applied" not in logs[0].read_text() and time.monotonic() < deadline:
            assert tasks[0].poll() is None, logs[0].read_text()
            time.sleep(0.2)
        tasks[2].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        codes = [task.wait(timeout=60) for task in tasks]
        took = time.monotonic() - killed
    finally:
        for task in tasks:
            task.kill()
    server = logs[0].read_text()
    assert "RuntimeError: trainers ['2'] died before they finished" in server and "--kill-on-bad-exit" in server, \
        server[-3000:]
    assert codes[0] != 0 and took < 30, (codes, took, server[-2000:])


def test_sigterm_to_the_job_writes_the_servers_checkpoint_first(tmp_path):
    # A scheduler's stop (or torchrun restarting its workers) sends SIGTERM: with
    # --checkpoint-dir the server writes the newest version before it goes, so the next
    # run resumes there rather than at the last periodic checkpoint (every 100 versions).
    import signal
    import subprocess
    import time

    import torch

    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    log = tmp_path / "run.log"
    command = [sys.executable, os.path.join(ROOT, "examples", "param_server.py"), "--num-workers", "2",
               "--epochs", "1000", "--time-budget", "100", "--no-metrics", "--print-every", "0.5",
               "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "ps.csv")]
    job = subprocess.Popen(command, env=env, cwd=tmp_path, stdout=open(log, "w"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 90
        while not re.search(r"version +[1-9]\d{2,}", log.read_text()) and time.monotonic() < deadline:
            assert job.poll() is None, log.read_text()
            time.sleep(0.2)
        job.send_signal(signal.SIGTERM)  # the launcher passes it on to its ranks
        job.wait(timeout=60)
    finally:
        job.kill()
    text = log.read_text()
    assert "told to stop (SIGTERM; a Ctrl-C reaches the ranks as SIGTERM): checkpoint written" in text, text[-3000:]
    saved = torch.load(tmp_path / "ckpt" / "digits_0.ckpt", weights_only=False)
    printed = max(int(v) for v in re.findall(r"version +(\d+)", text))
    assert saved["state"]["version"] >= printed >= 100, (saved["state"]["version"], printed)
