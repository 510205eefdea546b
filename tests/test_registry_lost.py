"""A world's store that died: the Registry's main connection fails through torch once, and
every later request on it at once, without reaching torch again (torch's client never
reconnects, and each of its failures prints a C++ warning with a stack)."""

from __future__ import annotations

import datetime
import signal
import subprocess
import sys

import pytest
import torch.distributed as dist

from machinlike.distributed._store import Registry
from machinlike.exception import PeerLostError

HOST = """
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()
"""


class _Counted(dist.Store):
    """Forwards to a TCPStore client and counts the requests that reach it."""

    def __init__(self, inner: dist.TCPStore) -> None:
        super().__init__()
        self.inner, self.requests = inner, 0

    def add(self, key, amount):
        self.requests += 1
        return self.inner.add(key, amount)

    def compare_set(self, key, expected, desired):
        self.requests += 1
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        self.requests += 1
        return self.inner.check(keys)

    def set(self, key, value):
        self.requests += 1
        return self.inner.set(key, value)


def test_after_the_main_connection_broke_requests_fail_without_reaching_torch():
    host = subprocess.Popen([sys.executable, "-c", HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        port = int(host.stdout.readline())
        store = _Counted(dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10)))
        registry = Registry(store, "rank 0")
        assert registry.add("n", 1) == 1 and registry.claim("k", "me") is None
        host.send_signal(signal.SIGKILL)
        host.wait(10)
        said = r"member 'rank 0' is unreachable: the world's store is unreachable"
        with pytest.raises(PeerLostError, match=said):
            registry.add("n", 1)
        reached = store.requests
        for request in (lambda: registry.add("n", 1), lambda: registry.claim("k2", "me"),
                        lambda: registry.present(["k"]), lambda: registry.owner("k"), lambda: registry.set("a", "b")):
            with pytest.raises(PeerLostError, match=said):
                request()
        assert store.requests == reached, "a request reached torch's broken connection again"
    finally:
        if host.poll() is None:
            host.kill()
        host.stdin.close()
        host.wait(10)
