"""The restart race (issue 21): right after ``launch(..., max_restarts=1)`` restarts a rank
in place, every rank groups with it. The survivors learn from the store that it is back,
before their view has seen the new incarnation; group creation must wait for the view to
catch up instead of failing a healthy rank ("it was lost from the world"), and the ranks
must agree. ``benchmarks/restart_race.py`` runs it 50 times in a row."""

from __future__ import annotations

import os
import signal

from machinlike.distributed import World, launch


def _race_body(world: World) -> int:
    keys, registry = world.membership.keys, world.membership.registry
    if world.rank == 2 and world.incarnation == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if world.rank == 2:
        registry.set(keys.scratch("race/up"), "1")
    else:
        registry.wait_all(keys.scratch("race/"), ["up"], 60, "the restarted rank")
    world.create_rpc_group("after", ["0", "1", "2"]).barrier(timeout=30)
    return world.incarnation


def test_a_rank_restarted_in_place_is_grouped_with_at_once_three_times_in_a_row():
    for _ in range(3):
        results = launch(_race_body, 3, max_restarts=1, timeout=90)
        assert list(results) == [1, 1, 2]
        assert [r.rank for r in results.restarts] == [2], results.restarts  # no healthy rank restarted
