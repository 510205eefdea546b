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
