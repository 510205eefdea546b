"""A CI-sized soak: a long-lived member stays within its resources while peers die.

Same-host actors join an elastic world, call the learner, are called back and are
SIGKILLed, under ``ulimit -n 1024`` (a common default). torch's agent alone keeps about 24
descriptors per dead actor it called, so without recycling the learner dies with "Too
many open files" after about 30 deaths; ``benchmarks/soak.py`` is the long version.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CYCLES = 40


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


# Recycling is opt-in while the servers' kill test still fails with every member
# recycling (see the elastic tutorial, "What a dead peer costs"); this soak then overstays
# now and then, so it runs only where asked (MACHINLIKE_SOAK=1), beside benchmarks/soak.py.
@pytest.mark.skipif(os.environ.get("MACHINLIKE_SOAK") != "1", reason="set MACHINLIKE_SOAK=1 to run the soak")
def test_learner_stays_flat_while_actors_die_under_ulimit_1024():
    # Its own session, so that a run that overstays takes its actors and forkserver along.
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--cycles", str(CYCLES),
         "--every", "15", "--warmup", "15"],
        cwd=ROOT, preexec_fn=_limit_open_files, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=160)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=10)
        raise AssertionError("the soak overstayed 160 s:\n" + out[-4000:])
    assert proc.returncode == 0, out[-4000:]
    assert "open-files limit 1024" in out
    last = re.search(r"soak: \d+ cycles, rss ([-+\d.]+) MB, fds ([-+\d]+), maps ([-+\d]+)", out)
    assert last is not None, out[-4000:]
    rss, fds, maps = float(last.group(1)), int(last.group(2)), int(last.group(3))
    # 25 cycles after the baseline: without recycling that is +200 MB and +600
    # descriptors; with it, at most one agent's worth of dead pipes is held at a time.
    assert rss < 100, out[-4000:]
    assert fds < 250 and maps < 250, out[-4000:]
