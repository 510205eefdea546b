"""The training examples' ``--device``: the pure check of a value, and a device that does
not exist refused by the script itself, with a message naming the flag, the value and the
fix, before any rank starts."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

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


# One interpreter runs every script's main (runpy) in turn: each refuses at argument
# parsing, so a fresh interpreter per script would only pay torch's import five times.
_DRIVER = """
import contextlib, io, json, os, runpy, sys, time
report = {}
where = sys.argv[1]
for script in list(sys.argv[2:]):
    out, err = io.StringIO(), io.StringIO()
    curve = os.path.join(where, script + ".csv")
    argv = [script, "--device", "cuda:7", "--out", curve, "--time-budget", "60"]
    saved, sys.argv = sys.argv, argv
    start = time.monotonic()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(os.path.join(os.environ["EXAMPLES"], script), run_name="__main__")
        except SystemExit as exit:
            code = exit.code
    sys.argv = saved
    report[script] = dict(code=code, out=out.getvalue(), err=err.getvalue(), took=time.monotonic() - start,
                          curve=os.path.exists(curve))
print(json.dumps(report))
"""


@pytest.fixture(scope="module")
def refusals(tmp_path_factory):
    scripts = [s for s in TRAINING if s != "impala_atari.py" or importlib.util.find_spec("ale_py") is not None]
    where = tmp_path_factory.mktemp("device")
    env = dict(os.environ, EXAMPLES=EXAMPLES,
               PYTHONPATH=os.pathsep.join(filter(None, [EXAMPLES, ROOT, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", _DRIVER, str(where), *scripts], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a cuda:7")
@pytest.mark.parametrize("script", TRAINING)
def test_missing_device_fails_before_any_rank_starts(script, refusals):
    if script not in refusals:
        pytest.skip("the Atari example needs ale-py (the test extra installs it)")
    done = refusals[script]
    assert done["code"] == 2, done
    # argparse names the flag; the message names the value and the fix.
    assert "argument --device: 'cuda:7'" in done["err"] and "--device cpu" in done["err"], done["err"]
    # Nothing started: no rank printed, no curve was written, no launch timeout was waited.
    assert done["out"] == "" and not done["curve"], done["out"]
    assert done["took"] < 60, f"{script} took {done['took']:.1f} s to refuse --device cuda:7"
