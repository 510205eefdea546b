"""Helpers the process and pool tests share."""

from __future__ import annotations

import os
import random
import select
import socket
import time
from typing import List, Set


def printed(stdout: str) -> List[str]:
    """The lines a test's script printed: ``stdout``'s, without gloo's own (torch 2.8's gloo
    prints "[Gloo] Rank 0 is connected to 0 peer ranks ..." there for each group it makes)."""
    return [line for line in stdout.splitlines() if not line.startswith("[Gloo] ")]


_handed: Set[int] = set()


def free_port() -> int:
    """A port of 127.0.0.1 that nothing holds now, below the kernel's ephemeral range.

    Why not ``bind(0)`` and close: the kernel hands that range out again, to another
    test's ``bind(0)`` or to any outgoing connection's local end, and a test that then
    listened there failed with "Address already in use" (a CI run saw it). Below the range
    only a test choosing the same number by chance collides, and each call checks that the
    port binds. Falls back on ``bind(0)`` where the range leaves too little below it.
    """
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    pick = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(200 if low > 12000 else 0):
        port = pick.randrange(10000, low)
        if port in _handed:
            continue
        with socket.socket() as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed.add(port)
        return port
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_for_exit(pid: int, timeout: float) -> bool:
    """Block until process ``pid`` (not necessarily our child) exits, at most ``timeout`` s.

    Returns whether it has exited (True also when it was gone already).
    """
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([fd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(fd)


def wait_stopped(pid: int, within: float = 10.0) -> None:
    """Until every thread of ``pid`` is stopped: ``kill`` only queues SIGSTOP, and a thread
    busy on a loaded box stops a moment later (CI once saw the store answer after it)."""
    deadline = time.monotonic() + within
    while True:
        states = []
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    states.append(f.read().rsplit(")", 1)[1].split()[0])
            except FileNotFoundError:
                pass  # the thread ended meanwhile
        if all(state in "Tt" for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} did not stop: its threads are {states}"
        time.sleep(0.005)
