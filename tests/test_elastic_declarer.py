"""Elastic core: a member that began the clean-up after a dead member and died itself
before finishing must not leave the dead member live in every view (found by the gradient
server's churn test, where chaos kills declarers mid-clean-up)."""

from __future__ import annotations

import os
import signal
import threading
import time

from machinlike import launch


def _body(world):
    if world.name == "victim":
        if world.incarnation > 1:
            return world.incarnation
        world.create_rpc_group("ready", ["a", "victim"]).barrier(timeout=30)
        os.kill(os.getpid(), signal.SIGKILL)
    # Play the part of a declarer that claimed the victim's clean-up, then died: its
    # claim is this counter, and it never wrote the victim's "gone" key.
    world.membership.registry.add(world.membership.keys.lost("victim", 1), 1)
    lost = threading.Event()
    world.on_member_change(lambda e: lost.set() if (e.kind, e.member, e.incarnation) == ("lost", "victim", 1)
                           else None)
    world.create_rpc_group("ready", ["a", "victim"]).barrier(timeout=30)
    start = time.monotonic()
    assert lost.wait(20), "the victim was never declared lost"
    return time.monotonic() - start


def test_a_dead_declarer_does_not_leave_the_dead_member_live():
    result = launch(_body, 2, names=["a", "victim"], max_restarts=1, essential=["a"], timeout=60)
    assert result[0] < 10, result
    assert result[1] == 2
