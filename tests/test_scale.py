"""Sixteen real member processes: join, calls between members, and SIGKILLed members.

The CI-sized run of ``benchmarks/scale.py`` (64 members there): every member a real
elastic World over real torch RPC and the store's real event log; deaths are SIGKILLs.
Why in the suite: the simulated thousand of ``test_liveness_scale.py`` has no RPC
agents, and a world of 16 processes on a 2-core box is what users start first.
"""

from __future__ import annotations

import math
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))

import scale  # noqa: E402


@pytest.mark.timeout(170)
def test_sixteen_processes_join_call_each_other_and_name_their_dead():
    # Spawned members, as when these bounds were set. Warm-started ones (the benchmark's
    # default) all join within seconds; every survivor then renews its first RPC agent at
    # the first death, and while the declarer's prune waited for torch's token behind
    # those renewals, the second death was named 0.5-3.3 s later at the median. The
    # "lost" event now goes before the prune: 0.13-1.75 s in eleven warm runs here, too
    # close to the bounds below for CI.
    result = scale.run(members=16, kills=2, liveness=2.0, timeout=150, start="spawn")
    assert "error" not in result, result
    # Every survivor names every death, within the liveness bound and slack for a loaded
    # box. (1 to 3 of 28 pairs used to go unnamed: a member renewing its RPC agent waited
    # for torch's join token on the world's store connection, a second at a time, and its
    # heartbeat and log reads queued behind those waits; the agent group now has a
    # connection of its own.)
    assert result["detect_missed"] == 0, result
    assert not result["false_losses"], result
    assert result["detect_p50_s"] < 2.5, result
    assert result["detect_p99_s"] < 2 * 2.0, result
    assert not math.isnan(result["call_p50_ms"]), result
