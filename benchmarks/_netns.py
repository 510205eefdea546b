"""Two "hosts" on one Linux machine for the benchmarks: network namespaces joined by a
veth pair (198.18.0.1 and 198.18.0.2, a link that exists only inside them).

Why namespaces: each has its own interfaces and ports, so TensorPipe and gloo see a peer
on another host (TCP over the veth, no shared-memory shortcut by address), while the
processes still run on this machine. Needs root.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
from typing import Iterator, List

__all__ = ["ADDRESSES", "two_hosts"]

ADDRESSES = ("198.18.0.1", "198.18.0.2")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=10)


@contextlib.contextmanager
def two_hosts(prefix: str) -> Iterator[List[str]]:
    """The two namespaces' names (``ADDRESSES[i]`` is host ``i``'s address); on exit every
    process left in them is SIGKILLed (deleting a namespace leaves its processes running)
    and the namespaces are deleted.

    Raises:
        subprocess.CalledProcessError: ``ip`` refused (not root, no netns support).
    """
    tag = f"{prefix}-{os.getpid()}-{secrets.token_hex(3)}"
    hosts = [f"{tag}-h0", f"{tag}-h1"]
    created: List[str] = []
    try:
        for ns in hosts:
            _ip("netns", "add", ns)
            created.append(ns)
        _ip("-n", hosts[0], "link", "add", "eth0", "type", "veth", "peer", "name", "eth0", "netns", hosts[1])
        for ns, address in zip(hosts, ADDRESSES):
            _ip("-n", ns, "addr", "add", f"{address}/30", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        yield hosts
    finally:
        for ns in created:
            left = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, timeout=10).stdout
            for pid in left.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
