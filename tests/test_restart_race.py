"""The restart race (issue 21): right after ``launch(..., max_restarts=1)`` restarts a rank
in place, every rank groups with it. The survivors learn from the store that it is back,
before their view has seen the new incarnation; group creation must wait for the view to
catch up instead of failing a healthy rank ("it was lost from the world"), and the ranks
must agree. The restarted rank registers its predecessor's service again at once.
``benchmarks/restart_race.py`` runs it 50 times in a row."""

from __future__ import annotations

import os
import signal

from machinlike.distributed import World, launch


def _noop() -> None:
    return None


def _race_body(world: World) -> int:
    keys, registry = world.membership.keys, world.membership.registry
    # The restarted rank registers its service again at once: its predecessor's keys must
    # be free by the time its claim is (they were freed after it, and the registration
    # failed now and then with "already registered ... (by member '2')").
    world.create_rpc_group("open").register(f"svc/{world.rank}", _noop)
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


def _again_body(world: World) -> str:
    keys, registry = world.membership.keys, world.membership.registry
    if world.incarnation == 1:
        group = world.create_rpc_group("g", ["0", "1", "2"], timeout=30)
        group.barrier(timeout=30)
        if world.rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        group.destroy()  # (its keys stay: the dead member never counts itself out)
        registry.wait_all(keys.scratch("again/"), ["up"], 60, "the restarted rank")
    else:
        registry.set(keys.scratch("again/up"), "1")
    # Made again with the member's next incarnation. Each process counts its own
    # creations of a name, so the restarted one (at 0) and the others (at 1) agreed on no
    # epoch: it read the old incarnation's keys and "made" the group alone while the
    # others waited for it until their timeout.
    group = world.create_rpc_group("g", ["0", "1", "2"], timeout=30)
    group.register(f"svc{world.rank}", _noop)
    group.barrier(timeout=30)
    assert all(group.is_registered(f"svc{r}") for r in range(3))
    group.barrier(timeout=30)
    return group._epoch


def test_a_group_is_made_again_with_a_restarted_member():
    results = launch(_again_body, 3, max_restarts=1, timeout=90)
    assert len(set(results)) == 1, list(results)
    assert [r.rank for r in results.restarts] == [2], results.restarts
