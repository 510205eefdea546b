"""own_client: a store connection of a thread's own, with its own timeout; new_client: a
connection whose slowness is told; server_of and store_address: which store server a
client talks to.

Why: a store client serialises its requests, so a thread that blocks in the store (a
``wait``) or needs a short timeout (the liveness watch's ``multi_get``) must not share
the world's connection with the others.

Why a slow connection is logged: torch's client looks up the name of the address it
connects to (a reverse lookup: ``getnameinfo``) on every connection, and a World opens
about six. Where the resolver drops a query now and then, a World then starts in 5 s
instead of 0.1 s; where it never answers, the first connection of each process waits
10 s (on torch 2.13 the later ones skipped the lookup once one had failed). /etc/hosts
answers the lookup only for the address torch connects to, which for an IPv4 address is
its IPv6 form (``::ffff:a.b.c.d``): an entry for ``127.0.0.1`` alone does not. Nothing of
this shows otherwise (torch warns only when the lookup fails, not when it is slow).
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import threading
import time
from typing import Callable, Hashable, List, Optional, Sequence, Tuple

import torch.distributed as dist

from ...exception import SilentStoreError

__all__ = ["own_client", "new_client", "multi_get", "value_or_empty", "PROBE", "server_of", "store_address",
           "SilentStoreError", "SLOW_CONNECT_S"]

log = logging.getLogger(__name__)

SLOW_CONNECT_S = 2.0  # seconds; a store connection that takes longer is logged, once per process
_slow_told = threading.Event()


#: A value no key holds: a compare-and-set expecting it sets nothing and reads the key.
PROBE = "\x00probe"


def value_or_empty(store: dist.Store, key: str) -> str:
    """``key``'s value, "" when absent, in one compare-and-set that sets nothing (a check
    then a get waited the store's whole timeout for a key deleted between the two)."""
    held = store.compare_set(key, PROBE, PROBE).decode()
    return "" if held == PROBE else held


def multi_get(store: dist.Store, keys: Sequence[str]) -> List[bytes]:
    """``store.multi_get(keys)``: the values of ``keys`` in one round trip (each must exist:
    the store waits for an absent one up to its timeout). (Read by name: torch 2.8's type
    stubs lack it, which its stores have.)"""
    get: Callable[[List[str]], List[bytes]] = getattr(store, "multi_get")
    return get(list(keys))


def new_client(host: str, port: int, timeout: datetime.timedelta, use_libuv: bool = True,
               connect_timeout: Optional[datetime.timedelta] = None) -> dist.TCPStore:
    """A new client of the store at ``host:port`` whose requests end after ``timeout``.

    A connection that took ``SLOW_CONNECT_S`` or more is logged as a warning with its
    usual causes and the fix, once per process (see the module doc).

    Args:
        connect_timeout: How long connecting may take, when longer than ``timeout``
            (torch gives a client's timeout to its connection too, the name lookup
            included); None: ``timeout``.

    Raises:
        RuntimeError, ConnectionError, TimeoutError: as ``TCPStore`` raises them.
    """
    start = time.monotonic()
    opening = timeout if connect_timeout is None else max(timeout, connect_timeout)
    store = _connect(host, port, opening, use_libuv)
    if opening != timeout:
        store.set_timeout(timeout)
    took = time.monotonic() - start
    if took >= SLOW_CONNECT_S and not _slow_told.is_set():
        _slow_told.set()
        log.warning("%s", slow_connection(host, port, took))
    return store


_SILENT_GRACE_S = 1.0  # past the connection's own timeout, before a silent server is given up


def _connect(host: str, port: int, timeout: datetime.timedelta, use_libuv: bool) -> dist.TCPStore:
    """``TCPStore(host, port)`` as a client, in a thread of its own, given up after
    ``timeout`` (and a second) when it has not returned.

    Why a thread: torch's client honours its timeout while connecting, but not in its
    first exchange after (a validation and a ping, read without a timeout): a listener
    that accepts and never answers (another program on the port, a frozen store host)
    held it, and the World's start-up, for good. The thread is left behind then, blocked
    in that read until the listener closes the connection.

    Raises:
        SilentStoreError: connected, but no answer within the timeout (names the address).
    """
    made: List[dist.TCPStore] = []
    failed: List[BaseException] = []

    def run() -> None:
        try:
            made.append(dist.TCPStore(host, port, None, False, timeout, use_libuv=use_libuv))
        except BaseException as exc:  # handed to the caller's thread
            failed.append(exc)

    thread = threading.Thread(target=run, name=f"machinlike-connect-{host}:{port}", daemon=True)
    thread.start()
    within = timeout.total_seconds() + _SILENT_GRACE_S
    thread.join(within)
    if not thread.is_alive() and failed:
        raise failed[0]
    if not made:
        # (The thread stays blocked in torch's read; should the listener answer or close
        # while this process exits, torch may abort it from that thread.)
        raise SilentStoreError(
            f"the store at {host}:{port} accepted the connection but did not answer within {within:g} s: "
            f"something other than this world's store holds that port (another job or program), or the "
            f"store's process is frozen; give this world a port of its own (MASTER_PORT, or "
            f"init_method='tcp://HOST:PORT'), or see who listens there (ss -ltnp 'sport = :{port}')")
    return made[0]


def slow_connection(host: str, port: int, took: float, load: Optional[float] = None,
                    cores: Optional[int] = None) -> str:
    """What a connection to ``host:port`` that took ``took`` seconds says, with the fix;
    ``load`` / ``cores``: this machine's 1-minute load average and cores (None: read them),
    so that an overloaded machine is named before the resolver."""
    if load is None:
        load = os.getloadavg()[0]
    cores = cores or os.cpu_count() or 1
    if load > 2 * cores:
        return (f"connecting to the store at {host}:{port} took {took:.1f} s (said once per process): this "
                f"machine is overloaded (load {load:.1f} on {cores} cores), so processes wait for a core; run "
                f"fewer processes at once. (If it is not the load, see 'A World is slow to start' in machinlike's "
                f"troubleshooting guide.)")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:  # a name: torch connects to what it resolves to
        looked_up = f"the address {host!r} resolves to"
        entry = "'ADDRESS NAME' (an IPv4 ADDRESS in its form ::ffff:a.b.c.d)"
    else:
        looked_up = f"::ffff:{address}" if address.version == 4 else str(address)
        entry = f"'{looked_up} {'localhost' if address.is_loopback else 'NAME'}'"
    return (f"connecting to the store at {host}:{port} took {took:.1f} s (said once per process). Either the "
            f"store's host is too busy to answer, or this host's name resolver is slow: torch's store client "
            f"looks up the name of {looked_up} on each of its connections, and a World opens about six. "
            f"Fix: add a line {entry} to /etc/hosts (an entry for the IPv4 form alone is not used), or make the "
            f"resolver answer; see 'A World is slow to start' in machinlike's troubleshooting guide")


def own_client(store: dist.Store, timeout: datetime.timedelta,
               connect_timeout: Optional[datetime.timedelta] = None) -> Optional[dist.Store]:
    """A new connection to ``store`` whose requests end after ``timeout``; None when the
    store can be neither reached anew nor cloned (a test's HashStore, a store written in
    Python). ``connect_timeout``: as :func:`new_client`'s (a clone connects within the
    original's timeout).

    Why not ``clone()`` for a TCPStore: torch's clone took 250 ms here, holding the GIL,
    against 1 ms for a new client; 1,024 members starting at once stalled for minutes.
    """
    if isinstance(store, dist.TCPStore):
        return new_client(store.host, store.port, timeout,
                          getattr(store, "libuvBackend", True), connect_timeout)  # (not in torch's stubs)
    clone = getattr(store, "clone", None)
    if clone is None:
        return None
    try:
        own = clone()
    except (RuntimeError, NotImplementedError):
        return None  # a store that cannot be cloned: the caller shares the one it has
    own.set_timeout(timeout)
    return own


def store_address(store: dist.Store) -> Optional[Tuple[str, int]]:
    """``(host, port)`` of the server a client talks to, where it says (a TCPStore, or a
    wrapper that forwards them); None for a store with no address (a HashStore)."""
    host, port = getattr(store, "host", None), getattr(store, "port", None)
    return (host, port) if isinstance(host, str) and isinstance(port, int) else None


def server_of(store: dist.Store) -> Hashable:
    """The store server a client talks to: its ``store_address``, else the client object's
    id (a store in this process)."""
    return store_address(store) or id(store)
