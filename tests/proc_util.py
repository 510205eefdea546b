"""Helpers the process and pool tests share."""

from __future__ import annotations

import os
import select
import time
from typing import List


def printed(stdout: str) -> List[str]:
    """The lines a test's script printed: ``stdout``'s, without gloo's own (torch 2.8's gloo
    prints "[Gloo] Rank 0 is connected to 0 peer ranks ..." there for each group it makes)."""
    return [line for line in stdout.splitlines() if not line.startswith("[Gloo] ")]


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
