"""Is a peer process still alive? Cheaply, without a network round trip where possible.

Each rank publishes an identity at start-up: the machine's boot id, its PID namespace and
its pid. A peer with the same boot id and namespace is checked through ``/proc`` (a
zombie counts as dead); any other peer can only be asked over RPC.
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["process_identity", "alive_here"]


def _read(path: str) -> str:
    try:
        with open(path) as stream:
            return stream.read().strip()
    except OSError:
        return "?"


def _namespace() -> str:
    boot = _read("/proc/sys/kernel/random/boot_id")
    try:
        pidns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        pidns = "?"
    return f"{boot}/{pidns}"


def process_identity() -> str:
    """``<boot id>/<pid namespace>/<pid>`` of this process."""
    return f"{_namespace()}/{os.getpid()}"


def alive_here(identity: str) -> Optional[bool]:
    """Whether the process ``identity`` names is alive; None when it is not local."""
    space, _, pid = identity.rpartition("/")
    if "?" in space or space != _namespace():
        return None
    stat = _read(f"/proc/{pid}/stat")
    if stat == "?":
        return False
    # The state letter follows the parenthesised command name, which may contain spaces.
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")
