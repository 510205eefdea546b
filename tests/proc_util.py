"""Helpers the process and pool tests share."""

from __future__ import annotations

import os
import select
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
