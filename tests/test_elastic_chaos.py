"""Fault injection: random members of a 4-member elastic world SIGKILLed mid-operation.

A small loop here (CI); ``python benchmarks/elastic.py`` runs the long one.
"""

from __future__ import annotations

import pytest

from machinlike import launch

from chaos_targets import MEMBERS, STOP, chaos_body, schedule

# Seed 1's first 14 iterations already hold every phase (create last, at 13), every
# victim, a member killed in two iterations running (3-4, 9-10) and quiet iterations;
# more iterations repeat those cases at about a second each.
ITERATIONS = 14


@pytest.mark.parametrize("seed", [1])
def test_random_kills_never_hang_and_survivors_continue(seed):
    deaths = sum(1 for i in range(ITERATIONS) if schedule(i, seed)[0])
    results = launch(chaos_body, len(MEMBERS), args=(ITERATIONS, seed), names=MEMBERS,
                     max_restarts=ITERATIONS, essential=["d"], timeout=170)
    assert len(results.restarts) == deaths
    assert all("SIGKILL" in r.cause for r in results.restarts), results.restarts
    driver = results[0]
    # The driver lives through every iteration: it completed those without a death and
    # failed fast in (or skipped, when the victim was already back) every other one.
    assert driver["completed"] + driver["failed_fast"] + driver["skipped"] == ITERATIONS, driver
    assert driver["completed"] >= ITERATIONS - deaths, driver
    for result in results:
        assert result["stop"] < STOP + 1, results
