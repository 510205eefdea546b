"""The training examples' ``--device``: the pure check of a value, and a device that does
not exist refused by the script itself, with a message naming the flag, the value and the
fix, before any rank starts."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
TRAINING = ["impala.py", "a3c.py", "param_server.py", "dqn_apex.py", "impala_atari.py"]


@pytest.fixture(scope="module")
def util():
    sys.path.insert(0, EXAMPLES)
    try:
        import _util

        yield _util
    finally:
        sys.path.remove(EXAMPLES)


@pytest.mark.parametrize("value, count, expected", [
    ("cpu", 0, "cpu"), ("cpu", 2, "cpu"), ("auto", 0, "cpu"), ("auto", 2, "cuda:0"),
    ("cuda", 1, "cuda:0"), ("cuda:1", 2, "cuda:1"), ("cuda:0", 1, "cuda:0"),
])
def test_check_device_accepts(util, value, count, expected):
    assert util.check_device(value, count) == expected


@pytest.mark.parametrize("value, count, words", [
    ("cuda:7", 0, ["'cuda:7'", "no CUDA device", "--device cpu", "--device auto"]),
    ("cuda", 0, ["'cuda'", "no CUDA device", "--device cpu"]),
    ("cuda:2", 2, ["'cuda:2'", "2 CUDA device(s)", "cuda:0..cuda:1", "--device auto"]),
    ("gpu", 1, ["'gpu'", "not a device", "cpu, cuda, cuda:N or auto"]),
    ("meta", 1, ["'meta'", "meta device", "cpu, cuda, cuda:N or auto"]),
])
def test_check_device_refuses_with_the_fix(util, value, count, words):
    with pytest.raises(ValueError) as info:
        util.check_device(value, count)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_parser_takes_device_and_defaults_to_cpu(util):
    parser = util.parser("x", workers=1, budget=1.0, out="x.csv")
    assert parser.parse_args([]).device == "cpu"
    assert parser.parse_args(["--device", "auto"]).device == ("cuda:0" if torch.cuda.device_count() else "cpu")


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a cuda:7")
@pytest.mark.parametrize("script", TRAINING)
def test_missing_device_fails_before_any_rank_starts(script, tmp_path):
    if script == "impala_atari.py" and importlib.util.find_spec("ale_py") is None:
        pytest.skip("the Atari example needs ale-py (the test extra installs it)")
    out = tmp_path / "curve.csv"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    done = subprocess.run([sys.executable, os.path.join(EXAMPLES, script), "--device", "cuda:7", "--out", str(out),
                           "--time-budget", "60"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - start
    assert done.returncode == 2, done.stdout + done.stderr
    # argparse names the flag; the message names the value and the fix.
    assert "argument --device: 'cuda:7'" in done.stderr and "--device cpu" in done.stderr, done.stderr
    # Nothing started: no rank printed, no curve was written, no launch timeout was waited.
    assert done.stdout == "" and not out.exists(), done.stdout
    assert took < 60, f"{script} took {took:.1f} s to refuse --device cuda:7"
