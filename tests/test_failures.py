"""A member dies: calls, barriers and stop fail fast with errors naming it; nothing hangs."""

from __future__ import annotations

import os
import signal
import time

import pytest

from machinlike.exception import PeerLostError
from machinlike.testing import run_world

MEMBERS = ["0", "1", "2"]


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _whoami():
    from machinlike.distributed import get_cur_name

    return get_cur_name()


def _killed_member_body(world):
    g = world.create_rpc_group("g", MEMBERS)
    survivors = world.create_rpc_group("s", ["0", "1"]) if world.name != "2" else None
    if world.name == "2":
        g.register("die", _die)
        g.register("echo", _whoami)
        g.pair("value", 42)
    g.barrier()
    if world.name == "2":
        return "victim"  # then waits in World.stop until member 0 has it killed
    if world.name == "0":
        start = time.monotonic()
        with pytest.raises(PeerLostError, match="member '2' is unreachable"):
            g.registered_sync("die", timeout=10)
        assert time.monotonic() - start < 5
    survivors.barrier(timeout=20)  # from here both survivors know member 2 is gone
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="'2'") as info:
        g.registered_sync("echo", timeout=5)
    assert info.value.member == "2"
    with pytest.raises(PeerLostError, match="'2'"):
        g.registered_async("echo", timeout=5).wait()
    with pytest.raises(PeerLostError, match="'2'"):
        g.rpc_sync("2", _whoami, timeout=5)
    with pytest.raises(PeerLostError, match="'2'"):
        g.get_paired("value", timeout=5)
    assert time.monotonic() - start < 5  # each failed at once, not at its timeout
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"barrier of RpcGroup 'g': members: '2' did not arrive within 1 s"):
        g.barrier(timeout=1)
    assert time.monotonic() - start < 4
    survivors.barrier(timeout=20)
    start = time.monotonic()
    world.stop(timeout=2)
    elapsed = time.monotonic() - start
    # Member 2 reached its own stop before it died: stop must notice it is gone rather
    # than wait for it inside torch's graceful shutdown.
    assert elapsed < 2 + 3, f"stop took {elapsed:.1f} s"
    return "survived"


def test_killed_member_is_named_and_nothing_hangs():
    results = run_world(_killed_member_body, 3, timeout=90, return_exceptions=True, rpc_timeout=20)
    assert results[:2] == ["survived", "survived"], results
    assert results[2] == "victim"


def _stop_waits_for_absent_peer_body(world):
    group = world.create_rpc_group("pair", ["0", "1"])
    start = time.monotonic()
    if world.rank == 1:
        world.stop(timeout=1.5)  # rank 0 is busy for 3 s and misses it
        return time.monotonic() - start
    with pytest.raises(TimeoutError, match="'1' did not arrive"):
        group.barrier(timeout=3)  # rank 1 never comes: it is stopping
    start = time.monotonic()
    world.stop(timeout=1.5)
    return time.monotonic() - start


def test_stop_is_bounded_when_a_peer_does_not_stop():
    results = run_world(_stop_waits_for_absent_peer_body, 2, timeout=60)
    assert all(elapsed < 1.5 + 3 for elapsed in results), results
