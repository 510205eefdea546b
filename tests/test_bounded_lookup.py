"""A *silent* store (its host stopped: connected, never answering). A call whose owner
must be looked up in it ends within the call's own timeout, naming the store; any other
request (one with no timeout of its own, such as ``register``) ends within the World's
liveness bound (5 s at least), when this process gives the store up (``_membership.store_watch``): a
c10d client would wait for good, whatever its timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from machinlike.distributed import World
from machinlike.exception import PeerLostError

from proc_util import wait_stopped

HOST = """
import datetime, socket, sys, threading
import torch.distributed as dist
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen(64)
port = sock.getsockname()[1]
store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False,
                      master_listen_fd=sock.detach())
print(port, flush=True)
sys.stdin.read()
"""


def test_an_owner_look_up_in_a_silent_store_ends_within_the_calls_timeout():
    host = subprocess.Popen([sys.executable, "-c", HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        with World("a", elastic=True, init_method=f"tcp://127.0.0.1:{port}", dist_timeout=30) as world:
            group = world.create_rpc_group("g")
            group.register("svc", os.getpid)
            assert group.registered_sync("svc", timeout=10) == os.getpid()
            host.send_signal(signal.SIGSTOP)
            try:
                wait_stopped(host.pid)
                start = time.monotonic()
                with pytest.raises(TimeoutError, match=r"owner look-up: the world's store .* did not answer within 1.5"):
                    group.registered_sync("nobody-has-this", timeout=1.5)
                assert time.monotonic() - start < 3.0
            finally:
                host.send_signal(signal.SIGCONT)
            assert group.registered_sync("svc", timeout=10) == os.getpid()  # the store answers again
    finally:
        host.stdin.close()
        host.wait(30)


def test_a_store_silent_for_the_liveness_bound_is_lost_and_every_request_ends():
    host = subprocess.Popen([sys.executable, "-c", HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        world = World("a", elastic=True, init_method=f"tcp://127.0.0.1:{port}", dist_timeout=30, liveness=3)
        try:
            group = world.create_rpc_group("g")
            group.register("svc", os.getpid)
            # A pause shorter than the bound is no loss.
            host.send_signal(signal.SIGSTOP)
            wait_stopped(host.pid)
            time.sleep(0.5)
            host.send_signal(signal.SIGCONT)
            assert group.registered_sync("svc", timeout=10) == os.getpid()
            group.register("svc2", os.getpid)
            # Stopped for good: register (no timeout of its own: torch's client would wait
            # forever) fails once the store was silent for the bound (liveness, and
            # SILENCE_MIN = 5 s at least), and so does every call after.
            start = time.monotonic()  # (before the stop: the silence is timed from the store's last answer)
            host.send_signal(signal.SIGSTOP)
            wait_stopped(host.pid)
            said = r"member 'rank 0' is unreachable: the world's store at 127.0.0.1:\d+ did not answer for [\d.]+ s \(the bound is 5 s"
            with pytest.raises(PeerLostError, match=said):
                group.register("svc3", os.getpid)
            assert 4.5 <= time.monotonic() - start < 5.0 + 1.25 + 3.0  # (the bound, a probe period, slack)
            with pytest.raises(PeerLostError, match=said):  # (its connections to the store are shut)
                group.is_registered("svc")
        finally:
            host.send_signal(signal.SIGCONT)
            world.stop(timeout=10)
    finally:
        host.stdin.close()
        host.wait(30)


def test_the_members_of_a_process_share_one_watch_of_their_store_and_it_asks_nothing_while_they_hear_it():
    import datetime

    import torch.distributed as dist

    from machinlike.distributed._membership import Membership, store_watch
    from machinlike.distributed._store import Keys

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    members = []
    try:
        for i in range(3):
            client = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=30))
            m = Membership(client, Keys.elastic_world("shared"), "the test's store", f"m{i}", 0.5, elastic=False)
            m.enter(None, time.monotonic() + 30)
            m.announce()
            members.append(m)
        watch = store_watch._watches[("127.0.0.1", server.port)]
        assert len(watch._members) == 3
        assert sum(t.name.startswith("machinlike-store-") for t in threading.enumerate()) == 2
        time.sleep(2 * store_watch.SILENCE_MIN / 4 + 0.2)  # two of the probe's looks
        # The liveness threads heard the store all along: the probe sent nothing (one at
        # most: a loaded machine may hold every liveness thread back for a look).
        assert watch.probes <= 1, watch.probes
    finally:
        for m in members:
            m.close()
    assert ("127.0.0.1", server.port) not in store_watch._watches
    watch.join(5.0)
    assert not any(t.is_alive() for t in watch._threads)
