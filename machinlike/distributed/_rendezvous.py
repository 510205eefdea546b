"""Finding the world's store: explicit store, ``tcp://``, ``env://`` or the torchrun environment.

One c10d ``TCPStore`` serves the whole world: the RPC rendezvous (handed to
``rpc.init_rpc`` through a private rendezvous scheme), the default process group and
machinlike's own tables, each under its own prefix. When this process hosts it, the
listening socket is bound here, to the master address only, and handed to the store, so
nothing listens on other interfaces and a port of 0 picks a free port without a race.
"""

from __future__ import annotations

import datetime
import itertools
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import Dict, Iterator, Optional, Tuple
from urllib.parse import urlparse

import torch.distributed as dist

__all__ = ["StoreInfo", "open_store", "resolve_rank_and_size", "rpc_init_method", "forget_rpc_store"]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500


@dataclass
class StoreInfo:
    """The store a world uses, and how to describe it in errors."""

    store: dist.Store
    host: str
    port: int
    hosted_here: bool
    owner: str


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def resolve_rank_and_size(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """Fill ``rank``/``world_size`` from ``RANK``/``WORLD_SIZE`` (torchrun) when not given.

    Raises:
        ValueError: a value is missing everywhere, not an int, or out of range.
    """
    if rank is None:
        rank = _env_int("RANK")
    if world_size is None:
        world_size = _env_int("WORLD_SIZE")
    if rank is None or world_size is None:
        missing = "rank" if rank is None else "world_size"
        raise ValueError(
            f"World needs {missing}: pass it (World(rank=..., world_size=...)) or start the "
            f"script with torchrun, which sets RANK and WORLD_SIZE"
        )
    for param, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{param} must be an int, not {type(value).__name__} ({value!r})")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    return rank, world_size


def _master_from(init_method: Optional[str]) -> Tuple[str, int, bool]:
    """(host, port, all ranks are clients) from ``init_method`` and the environment."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if init_method is None or init_method == "env://":
        host = os.environ.get("MASTER_ADDR")
        port = _env_int("MASTER_PORT")
        if init_method == "env://" and (host is None or port is None):
            raise ValueError("init_method='env://' needs MASTER_ADDR and MASTER_PORT in the environment")
        return host or DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT if port is None else port, agent_store
    url = urlparse(init_method)
    if url.scheme != "tcp" or not url.hostname or url.port is None:
        raise ValueError(
            f"init_method={init_method!r} is not supported; use 'tcp://host:port', 'env://' or "
            f"None (MASTER_ADDR/MASTER_PORT, default {DEFAULT_MASTER_ADDR}:{DEFAULT_MASTER_PORT})"
        )
    return url.hostname, url.port, False


def _listen(host: str, port: int) -> socket.socket:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as err:
        raise ValueError(f"master address {host!r} does not resolve: {err}") from None
    family, _, _, _, address = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(1024)
    except OSError as err:
        sock.close()
        raise OSError(
            err.errno,
            f"rank 0 cannot listen on {host}:{port} for the world's store ({err.strerror}); "
            f"pick another port (init_method='tcp://{host}:PORT' or MASTER_PORT) or an address "
            f"of this machine",
        ) from None
    return sock


def open_store(rank: int, world_size: int, init_method: Optional[str], timeout: float) -> StoreInfo:
    """Host or join the world's TCPStore.

    Raises:
        ValueError: unsupported ``init_method`` or bad environment.
        OSError: rank 0 cannot listen on the master address.
        TimeoutError: the master cannot be reached within ``timeout`` seconds.
    """
    host, port, all_clients = _master_from(init_method)
    delta = datetime.timedelta(seconds=timeout)
    if rank == 0 and not all_clients:
        sock = _listen(host, port)
        port = sock.getsockname()[1]
        # The store takes over the listening fd (and closes it when it goes).
        store = dist.TCPStore(host, port, world_size, True, delta, wait_for_workers=False,
                              master_listen_fd=sock.detach())
        return StoreInfo(store, host, port, True, "rank 0")
    return StoreInfo(connect_store(host, port, timeout), host, port, False,
                     "the torchrun agent" if all_clients else "rank 0")


def connect_store(host: str, port: int, timeout: float) -> dist.TCPStore:
    """Connect to a store at ``host:port`` as a client, waiting for it at most ``timeout``.

    The master may start after this process, so connecting is retried until the deadline.
    The store's own connect loop overshoots its timeout (it checks the deadline only
    between attempts, and one attempt can block for seconds: a master that is down on the
    local network answers no ARP, about 3 s per attempt on Linux), so the waiting is done
    here first, every attempt cut to what is left of one deadline; the store then
    connects at once.

    Raises:
        TimeoutError: nothing accepted connections at ``host:port`` within ``timeout``
            seconds (the message names both and the last error).
    """
    deadline = time.monotonic() + timeout
    pause = 0.01
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.01, deadline - time.monotonic())):
                break
        except OSError as err:  # refused, unreachable, timed out, or the name does not resolve (yet)
            left = deadline - time.monotonic()
            if left <= 0:
                raise _unreachable(host, port, timeout, err) from None
        # Nothing can be waited on until the master listens: back off, never past the deadline.
        time.sleep(min(pause, left))
        pause = min(2 * pause, 0.5)
    try:
        return dist.TCPStore(host, port, None, False, datetime.timedelta(seconds=timeout))
    except (RuntimeError, ConnectionError, TimeoutError) as err:
        raise _unreachable(host, port, timeout, err) from None


def _unreachable(host: str, port: int, timeout: float, err: BaseException) -> TimeoutError:
    return TimeoutError(
        f"could not reach the world's store (the master) at {host}:{port} within {timeout:g} s: is "
        f"rank 0 running, and is {host}:{port} reachable from here? (last attempt: {err})"
    )


# --------------------------------------------------------------- RPC rendezvous scheme
# rpc.init_rpc insists on a rendezvous URL; this scheme hands it the world's store.
_SCHEME = "machinlike"
_rpc_stores: Dict[str, Tuple[dist.Store, int, int]] = {}
_rpc_lock = threading.Lock()
_rpc_registered = False
_tokens = itertools.count()


def _rendezvous_handler(url: str, **kwargs: object) -> Iterator[Tuple[dist.Store, int, int]]:
    token = urlparse(url).netloc
    with _rpc_lock:
        entry = _rpc_stores.get(token)
    if entry is None:
        raise RuntimeError(f"no machinlike store registered for rendezvous {url!r}")
    yield entry
    raise RuntimeError("machinlike rendezvous does not support re-rendezvous")


def rpc_init_method(store: dist.Store, rank: int, world_size: int) -> str:
    """A rendezvous URL that makes ``rpc.init_rpc`` use ``store``."""
    global _rpc_registered
    with _rpc_lock:
        if not _rpc_registered:
            from torch.distributed.rendezvous import register_rendezvous_handler

            register_rendezvous_handler(_SCHEME, _rendezvous_handler)
            _rpc_registered = True
        token = f"w{os.getpid()}x{next(_tokens)}"
        _rpc_stores[token] = (store, rank, world_size)
    return f"{_SCHEME}://{token}"


def forget_rpc_store(init_method: str) -> None:
    with _rpc_lock:
        _rpc_stores.pop(urlparse(init_method).netloc, None)
