"""This process's TCP connections to a store: found in the kernel's tables, and cut.

Why here: when a store stops answering, torch's client waits for good (see
``_membership.store_watch``); cutting the connections under it is the one way to end those
waits. ``shutdown``, not ``close``: torch keeps its descriptors and closes them itself, so
no descriptor number is reused under it.
"""

from __future__ import annotations

import ipaddress
import os
import socket
from typing import List, Optional, Set, Tuple, Union

__all__ = ["IP", "connections_to", "shut_down"]

IP = Union[ipaddress.IPv4Address, ipaddress.IPv6Address]


def _parse(hex_address: str) -> Tuple[IP, int]:
    """An address of ``/proc/net/tcp`` or ``tcp6`` (each 32-bit word in host order, x86:
    little endian) as (IP, port); an IPv4-mapped IPv6 address as its IPv4 address."""
    host, port = hex_address.split(":")
    raw = bytes.fromhex(host)
    ip = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return (mapped or ip), int(port, 16)


def connections_to(port: int, peers: Optional[Set[IP]] = None) -> List[Tuple[int, IP]]:
    """This process's TCP sockets whose far end is ``port`` (on one of ``peers``; None: any
    host), as (descriptor, far host): the tables of this process's network namespace,
    matched to its descriptors by inode."""
    inodes = {}
    for table in ("/proc/self/net/tcp", "/proc/self/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            far, far_port = _parse(fields[2])
            if far_port == port and fields[3] != "0A" and (peers is None or far in peers):  # (0A: listening)
                inodes[f"socket:[{fields[9]}]"] = far
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            peer = inodes.get(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue  # (closed meanwhile)
        if peer is not None:
            found.append((int(fd), peer))
    return found


def shut_down(fd: int) -> bool:
    """End the connection under descriptor ``fd`` both ways, leaving the descriptor to its
    owner: a request blocked on it returns, one sent later fails. False: it was closed."""
    try:
        sock = socket.socket(fileno=os.dup(fd))
    except OSError:
        return False
    try:
        sock.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        sock.close()  # (the duplicate only)
