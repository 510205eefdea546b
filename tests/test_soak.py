"""A CI-sized soak: a long-lived member stays within its resources while peers die.

Same-host actors join an elastic world, call the learner, are called back and are
SIGKILLed, under ``ulimit -n 1024`` (a common default). torch's agent alone keeps about 24
descriptors per dead actor it called, so without recycling the learner dies with "Too
many open files" after about 30 deaths; ``benchmarks/soak.py`` is the long version.

It keeps the store records of only the last 16 departures instead of 18,432 (see
machinlike/distributed/_membership/departures.py), so that the store's key count levels off within
the run: every actor joins under a new name, and each name left about 7 keys for good
before.
"""

from __future__ import annotations

import os
import re
import resource
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 40 deaths: past the ~34 at which a learner that did not recycle its agent runs out of
# descriptors, with 25 cycles after the baseline for growth to show (the bounds below
# stay well apart from what no recycling gives); benchmarks/soak.py runs the long soak.
CYCLES = 40
WARMUP = 15


def _limit_open_files() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))


def test_learner_stays_flat_while_actors_die_under_ulimit_1024():
    # --liveness 2: the monitors tick every 0.25 s instead of 0.5 s, so that each SIGKILLed
    # actor is declared lost sooner (a cycle waits for it). No false loss under load: a
    # member on this host is declared lost only once /proc shows its process gone.
    # Its own session, so that a run that overstays takes its actors and forkserver along.
    proc = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "benchmarks", "soak.py"), "--cycles", str(CYCLES),
         "--every", "15", "--warmup", str(WARMUP), "--departures-kept", "16", "--liveness", "2"],
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
    last = re.search(r"soak: \d+ cycles, rss ([-+\d.]+) MB, fds ([-+\d]+), maps ([-+\d]+), shm [-+\d.]+ MB, "
                     r"store keys ([-+\d]+)", out)
    assert last is not None, out[-4000:]
    rss, fds, maps, keys = float(last.group(1)), int(last.group(2)), int(last.group(3)), int(last.group(4))
    # 25 cycles after the baseline (cycle 15). Without recycling that is +200 MB and +600
    # descriptors (the learner dies of "Too many open files" first, at about 34 deaths).
    # With it the learner holds at most a few agents' worth of dead pipes: a sawtooth
    # (agents retire and are shut down), whose top is where the last line may fall.
    assert rss < 160, out[-4000:]
    assert fds < 400 and maps < 400, out[-4000:]
    # 25 departures after the baseline: +175 keys when each name left its 7 for good; a
    # sawtooth of a few blocks' worth now, plus the event log's positions: each event is a
    # key of its own (a join and a loss per cycle, 50 here) until its range of 256 is
    # deleted, KEEP ranges behind the newest snapshot, so they level off at 1,500-1,800
    # keys (benchmarks/soak.py's long run), not within these 40 cycles.
    assert keys < 80 + 2 * (CYCLES - WARMUP), out[-4000:]
    # The learner hosts the store: once the probe left it stops at once, instead of
    # waiting its whole stop timeout for a leave its stopped monitor never read.
    assert "closes the store while members remain" not in out, out[-4000:]
    recycles = re.search(r"the learner answers as '\w+' after (\d+) recyclings", out)
    assert recycles is not None and int(recycles.group(1)) >= 2, out[-4000:]
