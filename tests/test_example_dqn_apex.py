"""examples/dqn_apex.py: the Ape-X epsilon schedule, n-step transitions, the prioritised shard,
the pacer, and a smoke run of the whole script as a user starts it."""

from __future__ import annotations

import csv
import importlib
import os
import sys

import numpy as np
import pytest
import torch
from example_chaos import COMMON_TAGS, read_scalars, trains_through_chaos
from example_run import run_example

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


@pytest.fixture(scope="module")
def apex():
    sys.path.insert(0, EXAMPLES)
    try:
        yield importlib.import_module("dqn_apex")
    finally:
        sys.path.remove(EXAMPLES)


def test_epsilon_schedule_is_apex(apex):
    eps = [apex.actor_epsilon(i, 3, 0.4, 7.0) for i in range(3)]
    assert eps == pytest.approx([0.4, 0.4 ** 4.5, 0.4 ** 8])
    assert apex.actor_epsilon(0, 1, 0.4, 7.0) == 0.4  # one actor: the base epsilon


def test_n_step_transitions_end_and_truncate(apex):
    gamma = 0.5
    obs = [np.full(4, float(i), np.float32) for i in range(6)]
    nstep = apex.NStep(3, gamma)
    out = []
    for t in range(3):  # rewards 1, 2, 3; the window fills at step 2
        out += nstep.step(obs[t], t % 2, float(t + 1), obs[t + 1], False, False)
    assert len(out) == 1
    first_obs, action, ret, next_obs, discount = out[0]
    assert first_obs[0] == 0 and action == 0 and next_obs[0] == 3
    assert ret == pytest.approx(1 + 0.5 * 2 + 0.25 * 3) and discount == pytest.approx(gamma ** 3)
    # Terminated at the next step: the three pending steps flush with discount 0.
    out = nstep.step(obs[3], 1, 4.0, obs[4], True, True)
    assert [o[0][0] for o in out] == [1, 2, 3] and all(o[4] == 0.0 for o in out)
    assert [o[2] for o in out] == pytest.approx([2 + 0.5 * 3 + 0.25 * 4, 3 + 0.5 * 4, 4])
    # Truncated after two steps: the value of the last observation is still owed.
    nstep.step(obs[0], 0, 1.0, obs[1], False, False)
    out = nstep.step(obs[1], 0, 1.0, obs[2], False, True)
    assert [o[4] for o in out] == pytest.approx([gamma ** 2, gamma])
    assert all(o[3][0] == 2 for o in out)


def test_shard_samples_in_proportion_and_skips_stale_updates(apex):
    shard = apex.ReplayShard(capacity=4, obs_dim=4, alpha=1.0, seed=0)
    obs = np.arange(16, dtype=np.float32).reshape(4, 4)
    shard.add(obs, np.arange(4), np.zeros(4, np.float32), obs, np.ones(4, np.float32),
              np.array([1.0, 1.0, 2.0, 4.0]))
    assert shard.size() == (4, pytest.approx(8.0))
    counts = np.zeros(4)
    for _ in range(200):
        batch = shard.sample(40)
        counts += np.bincount(batch["slot"].numpy(), minlength=4)
    assert counts / counts.sum() == pytest.approx([1 / 8, 1 / 8, 2 / 8, 4 / 8], abs=0.01)
    assert batch["priority"].tolist() == [1.0 if s < 2 else 2.0 if s == 2 else 4.0 for s in batch["slot"].tolist()]
    sampled = shard.sample(4)
    # Slot 0 is overwritten after sampling: its update is dropped, the others apply.
    shard.add(obs[:1], np.zeros(1, np.int64), np.zeros(1, np.float32), obs[:1], np.ones(1, np.float32),
              np.array([3.0]))
    shard.update(torch.arange(4), torch.arange(4), torch.full((4,), 10.0))
    assert shard.size()[1] == pytest.approx(3.0 + 30.0)
    assert len(sampled["slot"]) == 4


def test_pacer_releases_waiters_in_order_and_stops(apex):
    pacer = apex.Pacer()
    early, late = pacer.wait_for("a", 2), pacer.wait_for("b", 5)
    assert not early.done() and not late.done()
    pacer.wait_actors(2, timeout=1)
    with pytest.raises(TimeoutError, match="of 3 finished their warm-up"):
        pacer.wait_actors(3, timeout=0.05)
    pacer.advance(3)
    assert early.value() == 3 and not late.done()
    assert pacer.wait_for("a", 1).value() == 3  # already there: answered at once
    pacer.close()
    assert late.value() == -1 and pacer.wait_for("a", 9).value() == -1


def test_smoke(tmp_path):
    out = tmp_path / "curve.csv"
    proc = run_example("dqn_apex.py", ["--time-budget", "3", "--warmup", "200", "--target", "0", "--num-workers", "2",
                                       "--out", str(out), "--metrics-every", "0.3", "--device", "cpu"], timeout=170)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out, newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert rows and float(rows[-1]["env_steps"]) > 0
    assert "== Ape-X DQN on CartPole-v1" in proc.stdout and "time budget used up" in proc.stdout
    assert "warm-up done" in proc.stdout
    scalars = read_scalars(str(tmp_path / "curve"))  # runs/<name>/ beside the curve
    missing = [t for t in COMMON_TAGS + ["learner/loss_td", "learner/grad_norm", "learner/policy_lag",
                                         "learner/updates_per_s", "server/model/version"] if t not in scalars]
    assert not missing, sorted(scalars)
    last = {tag: points[-1][1] for tag, points in scalars.items()}
    assert last["world/members_alive"] == 3 and last["learner/loss_td"] >= 0 and last["env/steps"] > 0


def test_shard_drops_priority_updates_meant_for_a_previous_incarnation(apex):
    shard = apex.ReplayShard(capacity=4, obs_dim=4, alpha=1.0, seed=0, token=2)
    obs = np.zeros((2, 4), np.float32)
    shard.add(obs, np.zeros(2, np.int64), np.zeros(2, np.float32), obs, np.ones(2, np.float32), np.array([1.0, 1.0]))
    assert shard.sample(2)["token"] == 2
    shard.update(torch.arange(2), torch.arange(2), torch.full((2,), 5.0), 1)  # sampled from incarnation 1
    assert shard.size()[1] == pytest.approx(2.0)
    shard.update(torch.arange(2), torch.arange(2), torch.full((2,), 5.0), 2)
    assert shard.size()[1] == pytest.approx(10.0)


def _progress_updates(line):
    """The update count of a learner's progress line ('... updates   1234 (...'), else None."""
    if not line.startswith("[learner] ") or " updates " not in line:
        return None
    return int(line.split(" updates ", 1)[1].split()[0])


def test_trains_through_an_actor_killed_by_chaos(tmp_path):
    # --chaos: an elastic world; every 2 s the launcher SIGKILLs an actor and restarts it.
    # The learner keeps updating past the kill, sampling the surviving shards.
    trains_through_chaos("dqn_apex.py", ["--time-budget", "8", "--warmup", "200", "--target", "0",
                                         "--num-workers", "2", "--chaos", "2", "--print-every", "0.5",
                                         "--out", str(tmp_path / "curve.csv")],
                         "[learner]", _progress_updates)
