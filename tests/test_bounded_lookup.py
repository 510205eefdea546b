"""A call whose owner must be looked up in a *silent* store (its host stopped) ends within
the call's own timeout, naming the store: a c10d client would wait its own timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from machinlike.distributed import World

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


def _wait_stopped(pid: int, within: float = 10.0) -> None:
    """Until every thread of ``pid`` is stopped: ``kill`` only queues SIGSTOP, and a thread
    busy on a loaded box stops a moment later (CI once saw the store answer after it)."""
    deadline = time.monotonic() + within
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                states.append(f.read().rsplit(")", 1)[1].split()[0])
        if all(state in "Tt" for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: its threads are {states}"
        time.sleep(0.005)


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
                _wait_stopped(host.pid)
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
