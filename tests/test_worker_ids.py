"""torch's 16-bit worker ids come round in a long-lived elastic world, and every call,
paired value and remote result still reaches the member it names.

The id space is shrunk to 32 (``MACHINLIKE_WORKER_ID_SPACE``) so that ids are given again
several times within the test: actors join under new names, talk to the host both ways
(services, paired values, remote results), and leave or are SIGKILLed. A handle to a
gone actor's value must fail naming that actor, never answer with a newer actor's value.
"""

from __future__ import annotations

import faulthandler
import os
import signal

import pytest
from torch.distributed import rpc

import machinlike
from machinlike import launch
from machinlike.distributed import World, get_world
from machinlike.exception import PeerLostError
from machinlike.process import Process

# 16 ran out under CI's load (twice in four sessions: an actor's join found 64 ids in a
# row held, by live workers or gone ones not yet pruned). 32 keeps the wrap-arounds with
# room; 2 * SPACE actors make the last one's worker number at least 2 * SPACE.
SPACE = 32
CYCLES = 2 * SPACE
#: The monitors tick every liveness / 8 s (0.25 s here, 0.5 s at the default 10 s), and each
#: cycle waits for its actor's leave or loss to be seen. A member on this host is declared
#: lost only once /proc shows its process gone, so a short bound brings no false loss.
LIVENESS = 2.0


def _tag(x: int):
    return get_world().name, x


def _actor(address: str, i: int, out, go) -> None:
    # An actor that hangs shows where, before its host gives up on it (60 s): a grandchild
    # of the test, its stacks reach no other dump.
    faulthandler.dump_traceback_later(45, exit=False)
    with World(f"a{i}", elastic=True, init_method=address, dist_timeout=30, rpc_timeout=20,
               liveness=LIVENESS) as world:
        g = world.create_rpc_group("open")
        g.pair(f"v{i}", {"i": i, "who": f"a{i}"})
        g.register(f"s{i}", _tag)
        assert g.get_paired("hostval").to_here() == "host-value"
        assert g.registered_sync("host_svc", args=(i,)) == ("host", i)
        assert g.remote("host", _tag, args=(i,)).to_here() == ("host", i)
        # An elastic rank is the worker's sequence number; the id is torch's.
        out.put((i, os.getpid(), world.rank, rpc.get_worker_info().id), timeout=30)
        go.get(timeout=60)
    faulthandler.cancel_dump_traceback_later()


def _host_body(world):
    g = world.create_rpc_group("open")
    g.pair("hostval", "host-value")
    g.register("host_svc", _tag)
    held = None
    for i in range(CYCLES):
        go = machinlike.SimpleQueue()  # its own: a reader SIGKILLed in get() may take a shared queue's lock along
        # Its own too: a writer is SIGKILLed once its item was read, which may come before
        # its put let the write lock go (a shared one hung the next actor's put: CI-sized
        # run once, under load).
        out = machinlike.SimpleQueue()
        child = Process(target=_actor, args=(world.store_address, i, out, go))
        child.start()
        got, pid, seq, tid = out.get(timeout=60)
        assert got == i and tid == seq % SPACE, (i, seq, tid)
        ref = g.get_paired(f"v{i}", timeout=20)
        assert ref.to_here(timeout=20) == {"i": i, "who": f"a{i}"}
        assert g.registered_sync(f"s{i}", args=(i,), timeout=20) == (f"a{i}", i)
        assert g.remote(f"a{i}", _tag, args=(i,), timeout=20).to_here(timeout=20) == (f"a{i}", i)
        if held is not None:  # the previous actor's value: its owner is gone
            with pytest.raises(PeerLostError, match=f"'a{i - 1}'"):
                held.to_here(timeout=10)
        held = ref
        if i % 2:
            os.kill(pid, signal.SIGKILL)
        else:
            go.put(True)
        world.wait_for_members([f"a{i}"], timeout=30, gone=True)
        child.join(30)
    return seq, world.membership.endpoint.recycles


def test_worker_ids_come_round_and_every_call_reaches_its_member(monkeypatch):
    monkeypatch.setenv("MACHINLIKE_WORKER_ID_SPACE", str(SPACE))
    seq, recycles = launch(_host_body, 1, names=["host"], max_restarts=1, liveness=LIVENESS, timeout=240)[0]
    assert seq >= 2 * SPACE, f"ids did not come round twice: the last actor's worker was number {seq}"
    # The host recycles its agent a quarter of the id space after each (its actors' deaths
    # alone would make it recycle every 8).
    assert recycles >= 5, recycles
