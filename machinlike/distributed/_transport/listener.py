"""Is this process's RPC listener still accepting connections?

TensorPipe closes an agent's listener for good when one incoming connection fails before
its first message: a peer SIGKILLed while it connects, or anything that opens the port
and closes it (a port scan, a health probe). The agent looks healthy afterwards, and its
existing connections keep working, but no process that has not called it yet ever can:
a member that joins later gets ECONNREFUSED. Only a new agent (a new listener) repairs
that, so the membership monitor asks :class:`ListenerWatch` on every tick.

The check reads ``/proc``: the listening socket is found once (its port is in the
address the agent published), then each check is one ``readlink`` of its descriptor.
Without ``/proc`` nothing is watched.
"""

from __future__ import annotations

import os
from typing import Optional, Tuple

__all__ = ["ListenerWatch"]


def _listening_inode(port: int) -> Optional[str]:
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table, encoding="ascii") as stream:
                next(stream, None)  # the header
                for line in stream:
                    fields = line.split()
                    # local address "HEXIP:HEXPORT"; state 0A is LISTEN; field 9 the inode
                    if fields[3] == "0A" and int(fields[1].rpartition(":")[2], 16) == port:
                        return fields[9]
        except OSError:
            continue
    return None


def _descriptor_of(inode: str) -> Optional[int]:
    target = f"socket:[{inode}]"
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return None
    for name in names:
        try:
            if os.readlink(f"/proc/self/fd/{name}") == target:
                return int(name)
        except OSError:
            continue
    return None


class ListenerWatch:
    """Watches the listening socket behind an agent's published address.

    Args:
        address: The agent's address as TensorPipe publishes it, e.g.
            ``"uv://127.0.0.1:46535"``; None or another scheme: nothing is watched.
    """

    def __init__(self, address: Optional[str]) -> None:
        self._socket: Optional[Tuple[int, str]] = None  # (descriptor, "socket:[inode]")
        if address is None or not address.startswith("uv://"):
            return
        try:
            port = int(address.rpartition(":")[2])
        except ValueError:
            return
        inode = _listening_inode(port)
        fd = _descriptor_of(inode) if inode is not None else None
        if fd is not None:
            self._socket = (fd, f"socket:[{inode}]")

    @property
    def watching(self) -> bool:
        """Whether the listening socket was found (else :meth:`alive` always says None)."""
        return self._socket is not None

    def alive(self) -> Optional[bool]:
        """False once the listener is closed; None when it is not watched."""
        if self._socket is None:
            return None
        fd, target = self._socket
        try:
            return os.readlink(f"/proc/self/fd/{fd}") == target
        except OSError:
            return False
