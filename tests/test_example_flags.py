"""The examples refuse bad flag values while parsing, before any process starts: exit
status 2 and argparse's message naming the flag and the value (examples/_util.py's
``type=`` validators, and the cross-flag checks right after parsing)."""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


@pytest.mark.parametrize("script, argv, words", [
    ("collective.py", ["--steps", "0"], ["argument --steps", "an integer >= 1", "'0'"]),
    ("rpc_group.py", ["--num-workers", "0"], ["argument --num-workers", "an integer >= 1", "'0'"]),
    ("rpc_group.py", ["--steps", "-3"], ["argument --steps", "'-3'"]),
    ("assigner.py", ["--seed", "-1"], ["argument --seed", "an integer >= 0", "'-1'"]),
    ("ordered_server.py", ["--time-budget", "0"], ["argument --time-budget", "a number > 0", "'0'"]),
    ("exceptions_events.py", ["--time-budget", "0"], ["argument --time-budget", "'0'"]),
    ("pool.py", ["--time-budget", "nan"], ["argument --time-budget", "'nan'"]),
    ("param_server.py", ["--chaos", "0"], ["argument --chaos", "a number > 0", "'0'"]),
    ("param_server.py", ["--time-budget", "-1"], ["argument --time-budget", "'-1'"]),
    ("param_server.py", ["--engine", "ray", "--chaos", "3"], ["--chaos needs --engine local"]),
    ("a3c.py", ["--gamma", "1.5"], ["argument --gamma", "a number in [0, 1]", "'1.5'"]),
    ("a3c.py", ["--print-every", "0"], ["argument --print-every", "'0'"]),
    ("dqn_apex.py", ["--alpha", "-1"], ["argument --alpha", "a number >= 0", "'-1'"]),
    ("impala.py", ["--rpc-timeout", "0"], ["argument --rpc-timeout", "'0'"]),
    ("a3c.py", ["--metrics-every", "0"], ["argument --metrics-every", "a number > 0", "'0'"]),
    ("impala.py", ["--learners", "2", "--num-workers", "1"], ["--learners 2", "--num-workers is 1"]),
])
def test_a_bad_flag_is_refused_by_name(monkeypatch, capsys, script, argv, words):
    # The script's main in this process (as `python examples/<script>` runs it): argparse
    # refuses before any rank or pool starts, so no new interpreter is needed.
    monkeypatch.syspath_prepend(EXAMPLES)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(os.path.join(EXAMPLES, script), run_name="__main__")
    err = capsys.readouterr().err
    assert stopped.value.code == 2, err
    assert err.startswith("usage: ") and f"{script}: error: " in err, err
    for word in words:
        assert word in err, err


def test_an_out_without_extension_gets_a_metrics_folder_of_its_own(monkeypatch):
    # Cold trial 25: the folder was --out itself, so the curve's CSV could not be opened.
    import argparse

    monkeypatch.syspath_prepend(EXAMPLES)
    from _metrics import logdir_of

    assert logdir_of(argparse.Namespace(logdir=None, out="runs/impala.csv")) == "runs/impala"
    assert logdir_of(argparse.Namespace(logdir=None, out="runs/curve")) == "runs/curve.metrics"
    assert logdir_of(argparse.Namespace(logdir="elsewhere", out="runs/curve")) == "elsewhere"


def test_a_run_whose_only_due_point_was_its_first_still_gets_one_rate(monkeypatch, tmp_path):
    # The DDP smoke run under load (this session's durations run): its first update came so
    # late that the last point followed the first within every / 2, and the curves had no
    # rate at all. Such a point now gets one; later short spans still get none.
    from example_chaos import read_scalars

    monkeypatch.syspath_prepend(EXAMPLES)
    from _metrics import RunMetrics

    metrics = RunMetrics(str(tmp_path), every=60.0)
    metrics.log(0, 0)
    time.sleep(0.01)
    metrics.log(100, 2)  # the last point, well within every / 2 of the first
    time.sleep(0.01)
    metrics.log(200, 4)  # a rate was logged: a short span has none again
    metrics.close()
    scalars = read_scalars(str(tmp_path))
    assert [step for step, _ in scalars["env/steps_per_s"]] == [100]
    assert [step for step, _ in scalars["learner/updates_per_s"]] == [100]
    assert [step for step, _ in scalars["env/steps"]] == [0, 100, 200]


def test_a_chaos_run_whose_rank_dies_after_rank_0_returned_gives_none_for_it(monkeypatch, capfd):
    # CI: impala.py --chaos summed the ranks' reports and met the exception launch keeps as
    # the result of an actor killed after the learner returned (TypeError: not subscriptable).
    monkeypatch.syspath_prepend(EXAMPLES)
    import _util
    from chaos_targets import dies_after_rank_0

    args = argparse.Namespace(time_budget=5.0, chaos=600.0, seed=0)
    results = _util.run(dies_after_rank_0, 2, args, timeout_margin=60.0, chaos_ok=True)
    assert list(results) == [{"name": "0"}, None]
    out = capfd.readouterr().out
    assert "chaos: rank 1 was lost after rank 0 finished, without its report (ProcessExitedError" in out, out
