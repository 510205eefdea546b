"""Helpers the process and pool tests share."""

from __future__ import annotations

import os
import select


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
