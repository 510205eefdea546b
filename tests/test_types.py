"""The package type-checks: ``python -m mypy`` at the strictness stated in setup.cfg's
``[mypy]`` section, run as CI runs the suite (mypy is in the ``test`` extra)."""

from __future__ import annotations

import os
import subprocess

import pytest

import _background

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# A first run (no .mypy_cache yet) reads torch's sources: about 40 s of CPU, minutes on a
# loaded machine; later runs take seconds. In a session it runs beside the suite from the
# start (conftest, _background); this test collects it.
@pytest.mark.timeout(330)
def test_mypy_finds_no_errors():
    try:
        done = _background.outcome("mypy", 300)
        if done is None:  # not started beside the suite: run it here
            done = subprocess.run(_background.mypy_argv(), cwd=ROOT, capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"mypy did not finish within {err.timeout} s")
    report = (done.stdout + done.stderr).strip()
    assert "No module named mypy" not in report, "mypy is missing: pip install -c constraints.txt -e '.[test]'"
    assert done.returncode == 0, f"mypy found errors (config: setup.cfg [mypy]):\n{report}"
    assert report.startswith("Success"), report
