"""examples/impala.py: V-trace against its on-policy identity, the inbox's back-pressure, and
smoke runs of the whole script (one learner, and two DDP learners) as a user starts it."""

from __future__ import annotations

import csv
import importlib
import os
import sys

import pytest
import torch
from example_chaos import COMMON_TAGS, read_scalars, trains_through_chaos
from example_run import run_example

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


@pytest.fixture(scope="module")
def impala():
    sys.path.insert(0, EXAMPLES)
    try:
        yield importlib.import_module("impala")
    finally:
        sys.path.remove(EXAMPLES)


def test_vtrace_on_policy_is_the_discounted_return(impala):
    # With pi = mu (rho = c = 1), v_s is the discounted return up to the end of the
    # episode, or bootstrapped with V(x_T) when the unroll ends first.
    gen = torch.Generator().manual_seed(0)
    length, width, gamma = 6, 3, 0.9
    values = torch.randn(length, width, generator=gen)
    bootstrap = torch.randn(width, generator=gen)
    rewards = torch.randn(length, width, generator=gen)
    discounts = torch.full((length, width), gamma)
    discounts[2, 1] = 0.0  # column 1: an episode ends at step 2
    vs, advantages = impala.vtrace(values, bootstrap, rewards, discounts, torch.zeros(length, width))
    expected = torch.empty(length, width)
    following = bootstrap.clone()
    for t in reversed(range(length)):
        following = rewards[t] + discounts[t] * following
        expected[t] = following
    assert torch.allclose(vs, expected, atol=1e-5)
    next_vs = torch.cat([expected[1:], bootstrap.unsqueeze(0)])
    assert torch.allclose(advantages, rewards + discounts * next_vs - values, atol=1e-5)


def test_vtrace_truncates_importance_weights(impala):
    # A very off-policy action (rho = e^3) counts with rho-bar, and cuts nothing above c-bar.
    values, bootstrap = torch.zeros(1, 1), torch.zeros(1)
    rewards, discounts = torch.ones(1, 1), torch.zeros(1, 1)
    vs, advantages = impala.vtrace(values, bootstrap, rewards, discounts, torch.full((1, 1), 3.0), rho_bar=1.0)
    assert vs.item() == pytest.approx(1.0) and advantages.item() == pytest.approx(1.0)
    vs, _ = impala.vtrace(values, bootstrap, rewards, discounts, torch.full((1, 1), -1.0))
    assert vs.item() == pytest.approx(torch.exp(torch.tensor(-1.0)).item())


def test_inbox_parks_senders_when_full_and_answers_stop_on_close(impala):
    inbox = impala.Inbox(capacity=2)
    first, second = inbox.put({"n": 1}), inbox.put({"n": 2})
    assert first.done() and first.value() is True and second.value() is True
    parked = inbox.put({"n": 3})
    assert not parked.done()  # full: the actor waits for its reply
    assert [t["n"] for t in inbox.take(1, timeout=5)] == [1]
    assert parked.done() and parked.value() is True and len(inbox) == 2
    late = inbox.put({"n": 4})
    assert not late.done()
    inbox.close()  # the learner stops: parked and later senders hear "stop"
    assert late.value() is False and inbox.put({"n": 5}).value() is False
    with pytest.raises(TimeoutError, match="0 of 1 trajectories"):
        inbox.take(1, timeout=0.05)


def _run_script(tmp_path, *extra):
    out = tmp_path / "curve.csv"
    proc = run_example("impala.py", ["--time-budget", "2", "--target", "0", "--out", str(out), "--device", "cpu",
                                     *extra], timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out, newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert rows and float(rows[-1]["env_steps"]) > 0
    assert "== IMPALA on CartPole-v1" in proc.stdout and "time budget used up" in proc.stdout
    assert "learner on cpu" in proc.stdout  # --device cpu reached the learner
    return proc


def test_smoke_two_ddp_learners(tmp_path):
    # One run for the static world's figures and DDP (a run with one learner, its own test
    # before, started the same world minus the collective group: 13 s of CI for nothing new).
    proc = _run_script(tmp_path, "--learners", "2", "--num-workers", "2", "--metrics-every", "0.2")
    assert "2 learner(s), 2 actor(s)" in proc.stdout
    assert "watch it: python -m machinlike status tcp://" in proc.stdout
    # runs/<name>/ beside the curve: TensorBoard's event files hold the usual figures.
    scalars = read_scalars(str(tmp_path / "curve"))
    missing = [t for t in COMMON_TAGS + ["learner/loss_policy", "learner/loss_value", "learner/entropy",
                                         "learner/grad_norm", "learner/policy_lag", "learner/updates_per_s",
                                         "server/model/version"] if t not in scalars]
    assert not missing, sorted(scalars)
    last = {tag: points[-1][1] for tag, points in scalars.items()}
    assert last["world/members_alive"] == 4 and last["world/deaths"] == 0
    assert last["env/steps"] > 0 and 0 < last["learner/entropy"] <= 0.7
    assert max(v for _, v in scalars["env/steps_per_s"]) > 0  # the last interval may see no report (a loaded host)
    assert 8 <= last["episode/return_mean100"] == last["episode/length_mean100"] <= 500  # CartPole: 1 per step
    assert 50 < last["rss_mb/0"] < 4000 and last["learner/grad_norm"] > 0
    assert (tmp_path / "curve" / "metrics.png").exists()


def _progress_steps(line):
    """The env-step count of a learner's progress line ('... env steps  12,345  ...'), else None."""
    if " env steps " not in line:
        return None
    return int(line.split(" env steps ", 1)[1].split()[0].replace(",", ""))


def test_trains_through_an_actor_killed_by_chaos(tmp_path):
    # --chaos: an elastic world; every 2 s the launcher SIGKILLs an actor and restarts it.
    trains_through_chaos("impala.py", ["--time-budget", "7", "--target", "0", "--chaos", "2", "--print-every", "0.5",
                                       "--envs-per-actor", "4", "--out", str(tmp_path / "curve.csv"),
                                       "--metrics-every", "0.3"],
                         "[learner 0]", _progress_steps)
    deaths = read_scalars(str(tmp_path / "curve"))["world/deaths"]
    assert deaths[-1][1] >= 1, deaths  # the kills show in the metrics


def test_chaos_refuses_two_ddp_learners(impala, tmp_path, monkeypatch, capsys):
    # main() in this process (argparse's checks run before anything starts): no new
    # interpreter importing torch for an argument error. A short budget bounds a regression.
    monkeypatch.setattr(sys, "argv", ["impala.py", "--learners", "2", "--chaos", "3", "--time-budget", "1",
                                      "--out", str(tmp_path / "curve.csv")])
    with pytest.raises(SystemExit) as stopped:
        impala.main()
    assert stopped.value.code == 2 and "--chaos needs --learners 1" in capsys.readouterr().err
