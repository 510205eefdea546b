"""Which network interface TensorPipe (RPC) and gloo (collectives) use on this host.

Both libraries advertise one address of this host to their peers, and by default they
take the address the *hostname* resolves to. On a cluster that is often wrong: the
hostname may map to a loopback address (many distributions' ``/etc/hosts``), to a
management network, or to nothing. Each library reads an interface name from its own environment
variable (``TP_SOCKET_IFNAME``, ``GLOO_SOCKET_IFNAME``) when it starts, so the choice is
made here, once per World, in this order:

    1. the ``interface`` argument of World            (both variables, overriding them)
    2. ``MACHINLIKE_SOCKET_IFNAME``                     (both variables, overriding them)
    3. ``TP_SOCKET_IFNAME`` / ``GLOO_SOCKET_IFNAME``    (each kept as the user set it)
    4. the interface holding the address this host uses to reach the master: the kernel's
       routing table answers (a UDP ``connect`` sends no packet), so whatever address the
       store connection uses, RPC and gloo use too; a loopback master gives ``lo``.

An interface may be named (``"eth0"``) or given by one of its addresses (``"10.0.0.5"``).
A loopback-only choice is refused when the master is another host: its ranks could
never connect back, and the libraries would wait far past any timeout before saying so.
"""

from __future__ import annotations

import ctypes
import ipaddress
import logging
import os
import socket
import sys
from typing import Dict, List, Optional, Tuple

__all__ = ["ENV_VAR", "LIBRARY_VARS", "interface_addresses", "route_source", "configured_interface", "plan_interface",
           "refuse_loopback_for_remote_master", "describe"]

log = logging.getLogger(__name__)

ENV_VAR = "MACHINLIKE_SOCKET_IFNAME"
LIBRARY_VARS = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")


class _SockAddr(ctypes.Structure):
    # Linux layout: the family is a native unsigned short at offset 0.
    _fields_ = [("family", ctypes.c_ushort), ("data", ctypes.c_ubyte * 14)]


class _SockAddrIn(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16), ("addr", ctypes.c_ubyte * 4)]


class _SockAddrIn6(ctypes.Structure):
    _fields_ = [("family", ctypes.c_ushort), ("port", ctypes.c_uint16), ("flowinfo", ctypes.c_uint32),
                ("addr", ctypes.c_ubyte * 16), ("scope_id", ctypes.c_uint32)]


class _IfAddrs(ctypes.Structure):
    pass


_IfAddrs._fields_ = [
    ("next", ctypes.POINTER(_IfAddrs)), ("name", ctypes.c_char_p), ("flags", ctypes.c_uint),
    ("addr", ctypes.POINTER(_SockAddr)), ("netmask", ctypes.POINTER(_SockAddr)),
    ("ifu", ctypes.POINTER(_SockAddr)), ("data", ctypes.c_void_p),
]


def interface_addresses() -> Dict[str, List[str]]:
    """IPv4 and IPv6 addresses of each network interface of this host (``getifaddrs``).

    Returns:
        Interface name -> its addresses, in the kernel's order (IPv4 first). Empty where
        ``getifaddrs`` cannot be read this way (platforms other than Linux).
    """
    if not sys.platform.startswith("linux"):
        return {}
    libc = ctypes.CDLL(None, use_errno=True)  # the C library this interpreter runs on
    head = ctypes.POINTER(_IfAddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"getifaddrs failed: {os.strerror(err)}")
    found: Dict[str, List[str]] = {}
    try:
        node = head
        while node:
            entry = node.contents
            name = entry.name.decode(errors="replace")
            found.setdefault(name, [])
            if entry.addr:
                family = entry.addr.contents.family
                if family == socket.AF_INET:
                    raw = ctypes.cast(entry.addr, ctypes.POINTER(_SockAddrIn)).contents.addr
                    found[name].append(socket.inet_ntop(socket.AF_INET, bytes(raw)))
                elif family == socket.AF_INET6:
                    raw6 = ctypes.cast(entry.addr, ctypes.POINTER(_SockAddrIn6)).contents.addr
                    found[name].append(socket.inet_ntop(socket.AF_INET6, bytes(raw6)))
            node = entry.next
    finally:
        libc.freeifaddrs(head)
    return found


def route_source(host: str, port: int) -> Optional[str]:
    """The local address this host would use to reach ``host:port``; None if it has none.

    No packet is sent: connecting a UDP socket only asks the routing table.
    """
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (socket.gaierror, UnicodeError):
        return None
    for family, _, _, _, address in infos:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.connect(address)
            except OSError:  # no route from here for this family: try the next one
                continue
            return str(ipaddress.ip_address(probe.getsockname()[0].split("%", 1)[0]))
    return None


def _owner_of(address: str, table: Dict[str, List[str]]) -> Optional[str]:
    wanted = ipaddress.ip_address(address)
    for name, addresses in table.items():
        if any(ipaddress.ip_address(a.split("%", 1)[0]) == wanted for a in addresses):
            return name
    return None


def _check(value: str, source: str, table: Dict[str, List[str]]) -> str:
    """The interface named by ``value`` (a name or an address of this host).

    Raises:
        TypeError, ValueError: naming ``source`` and the interfaces this host has.
    """
    if not isinstance(value, str):
        raise TypeError(f"{source} must be a str (an interface name or address), not {type(value).__name__}")
    if not table:  # nothing to check against on this platform: the libraries will say
        return value
    try:
        ipaddress.ip_address(value)
    except ValueError:
        is_address = False
    else:
        is_address = True
    if is_address:
        owner = _owner_of(value, table)
        if owner is None:
            raise ValueError(f"{source}={value!r} is not an address of this host; its interfaces: "
                             f"{_describe(table)}")
        return owner
    if value not in table:
        raise ValueError(f"{source}={value!r} is not a network interface of this host; pick one of "
                         f"{_describe(table)}")
    if not table[value]:
        raise ValueError(f"{source}={value!r} has no IP address; pick one that has: {_describe(table)}")
    return value


def _describe(table: Dict[str, List[str]]) -> str:
    return ", ".join(f"{n} ({' '.join(a) or 'no address'})" for n, a in sorted(table.items())) or "none found"


def configured_interface(interface: Optional[str]) -> Optional[str]:
    """The interface the user asked for: ``interface``, else ``MACHINLIKE_SOCKET_IFNAME``.

    Returns:
        Its name (an address is mapped to the interface holding it); None: neither is set.

    Raises:
        TypeError, ValueError: it is not an interface (or address) of this host; the
            message names the setting and lists the interfaces there are.
    """
    if interface is not None:
        return _check(interface, "interface", interface_addresses())
    configured = os.environ.get(ENV_VAR)
    if configured:
        return _check(configured, f"environment variable {ENV_VAR}", interface_addresses())
    return None


def plan_interface(configured: Optional[str], master_host: str, master_port: int) -> Tuple[Optional[str], Dict[str, str]]:
    """Choose the interface for this World (see the module docstring for the order).

    Args:
        configured: What :func:`configured_interface` returned.
        master_host, master_port: Where the world's store is (for the route look-up).

    Returns:
        (the interface TensorPipe will use, None: its own guess), and the environment
        variables to set for that.
    """
    if configured is not None:
        return configured, {var: configured for var in LIBRARY_VARS}
    derived = None
    source = route_source(master_host, master_port)
    if source is not None:
        derived = _owner_of(source, interface_addresses())
    if derived is None and not all(os.environ.get(var) for var in LIBRARY_VARS):
        log.warning("could not tell which interface reaches the master %s:%s (route source %s); TensorPipe "
                    "and gloo fall back to the address the hostname resolves to. Set %s or World(interface=...) "
                    "if other hosts cannot reach it.", master_host, master_port, source, ENV_VAR)
    settings = {var: os.environ.get(var) or derived for var in LIBRARY_VARS}
    return settings["TP_SOCKET_IFNAME"], {var: value for var, value in settings.items() if value}


def refuse_loopback_for_remote_master(settings: Dict[str, str], master_host: str) -> None:
    """Refuse an interface that only has loopback addresses when the master is another host.

    Peers on the master's host could never connect to this process (torch's libraries
    would wait far past any timeout, then fail with a message about refused connections).

    Raises:
        ValueError: naming the variable, its interface and the interfaces there are.
    """
    table = interface_addresses()
    try:
        master = {ipaddress.ip_address(str(info[4][0]).split("%", 1)[0])
                  for info in socket.getaddrinfo(master_host, None, type=socket.SOCK_STREAM)}
    except (socket.gaierror, UnicodeError, ValueError):
        return
    local = {ipaddress.ip_address(a.split("%", 1)[0]) for addresses in table.values() for a in addresses}
    if not table or any(a.is_loopback or a in local for a in master):
        return  # the master is this host: loopback is fine
    for var, name in settings.items():
        addresses = table.get(name, [])
        if addresses and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addresses):
            raise ValueError(
                f"{var}={name!r} is a loopback interface, but the master {master_host} is another host, "
                f"whose ranks could not connect to this one; set World(interface=...) or {ENV_VAR} to an "
                f"interface the other hosts reach, or unset {var}. This host has: {_describe(table)}"
            )


def describe(interface: Optional[str]) -> str:
    """A hint for errors of TensorPipe/gloo start-up: what this host advertises to its peers."""
    if interface is None:
        shown = "the address its hostname resolves to (no interface set)"
    else:
        shown = f"interface {interface} ({' '.join(interface_addresses().get(interface, [])) or 'no address'})"
    return (f"machinlike: this process offers {shown} to its peers for RPC and collectives; if they "
            f"cannot connect to it, choose the interface with World(interface=...) or {ENV_VAR}")
