"""Finding the world's store: explicit store, ``tcp://``, ``env://``, torchrun's or SLURM's environment.

One c10d ``TCPStore`` serves the whole world: the RPC rendezvous (handed to
``rpc.init_rpc`` through a private rendezvous scheme), the default process group and
machinlike's own tables, each under its own prefix. When this process hosts it, the
listening socket is bound here, to the master address only, and handed to the store, so
nothing listens on other interfaces and a port of 0 picks a free port without a race.

Where rank, world size and master come from, first match wins, per value::

    rank / world_size   argument  >  RANK / WORLD_SIZE (torchrun)  >  SLURM_PROCID / SLURM_NTASKS (srun)
    master address      init_method  >  MASTER_ADDR  >  first host of the SLURM node list  >  127.0.0.1
    master port         init_method  >  MASTER_PORT  >  derived from SLURM_JOB_ID          >  29500

torchrun's variables win over SLURM's because torchrun is often started by ``srun`` (one
agent per node), and then SLURM's task numbers describe the agents, not the workers.
"""

from __future__ import annotations

import datetime
import itertools
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple
from urllib.parse import urlparse

import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from .client import SilentStoreError, new_client, own_client
from .closing import connect_open
from .registry import STORE_OF_RANK0

__all__ = ["StoreInfo", "open_store", "resolve_rank_and_size", "rpc_init_method", "forget_rpc_store",
           "parse_nodelist", "slurm_master_port", "external_launcher", "host_store"]

DEFAULT_MASTER_ADDR = "127.0.0.1"
DEFAULT_MASTER_PORT = 29500
# A SLURM job's master port is SLURM_PORT_BASE + job id mod SLURM_PORT_SPAN: below Linux's
# ephemeral range (32768+), so an outgoing connection cannot already hold it, and two
# jobs sharing a first node collide only when their ids are SLURM_PORT_SPAN apart.
SLURM_PORT_BASE = 20000
SLURM_PORT_SPAN = 10000
# torch before 2.8: its libuv store server refuses a listening socket (NotImplementedError,
# after logging an error line), so the older server takes it there (``_serve``). Not libuv
# on a port: before 2.8 it listens on every interface, and the store is bound to the master
# address only (the docs' trust model). The cost: the older server holds every reply of an
# empty value 208 ms (a withdrawn key holds one), which keeps 2.6 and 2.7 out of the range.
_LIBUV_TAKES_FD = TorchVersion(torch.__version__) >= "2.8"
_SLURM_HINT = ("start every rank with srun (it sets SLURM_PROCID, SLURM_NTASKS, SLURM_JOB_NODELIST and "
               "SLURM_JOB_ID), or pass rank and world_size")


@dataclass
class StoreInfo:
    """The store a world uses, and how to describe it in errors.

    ``server``: where this process hosts the store, the hosting ``TCPStore``; its listener
    lives exactly as long as this reference (``close_server``). Everything else talks to
    the store through ``store``, a client connection: torch's RPC agent keeps the store
    it was given for the rest of the process, and the World's own objects form reference
    cycles freed only at a gc pass, so either holding the hosting store left the port
    bound after ``stop()``, and the next World on that port failed with "Address already
    in use".
    """

    store: dist.Store
    host: str
    port: int
    hosted_here: bool
    owner: str
    server: Optional[dist.Store] = None

    def close_server(self) -> None:
        """Drop the hosting store: its listener closes now (clients' next requests fail)."""
        self.server = None


def _env_int(name: str) -> Optional[int]:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def _first(*names: str) -> Tuple[str, Optional[str]]:
    """The first of ``names`` set (non-empty) in the environment, and its value."""
    for name in names:
        value = os.environ.get(name)
        if value:
            return name, value
    return names[0], None


def _slurm_int(*names: str) -> Optional[int]:
    name, value = _first(*names)
    if value is None:
        return None
    if not value.strip().isdecimal():  # int() would take "12_3" (an array task's "job_task") as 123
        raise ValueError(f"environment variable {name}={value!r} is not an integer")
    return int(value)


def _in_slurm_step() -> bool:
    """Whether this process is a task of an srun step (SLURM's batch script is not)."""
    return bool(os.environ.get("SLURM_STEP_ID") or os.environ.get("SLURM_STEPID"))


def _slurm_rank_and_size() -> Optional[Tuple[int, int]]:
    """(SLURM_PROCID, task count) of an srun task, None outside SLURM; a partial environment is named.

    A step's own task count (``SLURM_STEP_NUM_TASKS``) wins over the job's: ``srun -n 2``
    inside an allocation of 4 tasks runs a world of 2. SLURM's batch script also has
    ``SLURM_PROCID=0`` and the job's ``SLURM_NTASKS``, but it is one process, not a task of
    a step (no ``SLURM_STEP_ID``): it is not taken for rank 0 of a world that would then
    wait for ranks nobody starts.
    """
    rank = _slurm_int("SLURM_PROCID")
    size = _slurm_int("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS", "SLURM_NPROCS")
    if rank is None and size is None:
        return None
    if rank is None or size is None:
        have, missing = ("SLURM_NTASKS", "SLURM_PROCID") if rank is None else ("SLURM_PROCID", "SLURM_NTASKS")
        raise ValueError(f"the SLURM environment is incomplete: {have} is set but {missing} is missing; "
                         f"{_SLURM_HINT}")
    if not _in_slurm_step():
        raise ValueError("this looks like SLURM's batch script, not a task started by srun (SLURM_PROCID and "
                         "SLURM_NTASKS are set but SLURM_STEP_ID is missing): start the ranks with srun, or "
                         "call machinlike.launch(...) here to start them on this node")
    return rank, size


def resolve_rank_and_size(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """Fill ``rank``/``world_size`` from torchrun's, then SLURM's environment, when not given.

    Raises:
        ValueError: a value is missing everywhere, not an int, or out of range; or the
            SLURM environment is partial (the message names the missing variable).
    """
    if rank is None:
        rank = _env_int("RANK")
    if world_size is None:
        world_size = _env_int("WORLD_SIZE")
    if rank is None or world_size is None:
        slurm = _slurm_rank_and_size()
        if slurm is not None:
            rank = slurm[0] if rank is None else rank
            world_size = slurm[1] if world_size is None else world_size
    if rank is None or world_size is None:
        missing = "rank" if rank is None else "world_size"
        raise ValueError(
            f"World needs {missing}: pass it (World(rank=..., world_size=...)) or start the "
            f"script with torchrun, which sets RANK and WORLD_SIZE, or srun, which sets "
            f"SLURM_PROCID and SLURM_NTASKS"
        )
    for param, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{param} must be an int, not {type(value).__name__} ({value!r})")
    if world_size < 1:
        raise ValueError(f"world_size={world_size} must be at least 1")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} must be in [0, world_size={world_size})")
    return rank, world_size


def external_launcher() -> Optional[str]:
    """Who started this process as one rank of a world: ``"torchrun"``, ``"srun"`` or None.

    srun counts only as a step of more than one task: SLURM's batch script (no step) and
    ``srun -n 1`` are one process, whose :func:`machinlike.launch` starts the ranks itself.

    Raises:
        ValueError: the environment of an srun task is partial or not numeric.
    """
    if os.environ.get("TORCHELASTIC_RUN_ID"):
        return "torchrun"
    if not _in_slurm_step():
        return None
    slurm = _slurm_rank_and_size()
    if slurm is not None and slurm[1] > 1:
        return "srun"
    return None


# ------------------------------------------------------------------- SLURM node lists
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def _split_top(text: str, where: str) -> List[str]:
    """``text`` split at the commas outside brackets."""
    parts, depth, start = [], 0, 0
    for i, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ValueError(f"{where}: nested '[' in {text!r}")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"{where}: unmatched ']' in {text!r}")
        elif char == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise ValueError(f"{where}: unmatched '[' in {text!r}")
    parts.append(text[start:])
    return parts


def _expand_ranges(body: str, where: str) -> List[str]:
    """``"01-03,07"`` -> ``["01", "02", "03", "07"]`` (zero padding kept, as SLURM does)."""
    out: List[str] = []
    for item in body.split(","):
        match = _RANGE.match(item)
        if match is None:
            raise ValueError(f"{where}: {item!r} inside [...] is not a number or a range like 01-03")
        lo, hi = match.group(1), match.group(2) or match.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"{where}: range {item!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 1
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_name(pattern: str, where: str) -> List[str]:
    """One comma-free entry, with any number of ``[...]`` groups (``r[1-2]n[01-02]``)."""
    names = [""]
    rest = pattern
    while rest:
        open_at = rest.find("[")
        if open_at < 0:
            names = [n + rest for n in names]
            break
        close_at = rest.index("]", open_at)
        prefix, choices = rest[:open_at], _expand_ranges(rest[open_at + 1:close_at], where)
        names = [n + prefix + c for n in names for c in choices]
        rest = rest[close_at + 1:]
    return names


def parse_nodelist(nodelist: str, where: str = "node list") -> List[str]:
    """Expand a SLURM host list: ``"node[01-03,07],gpu5"`` -> node01, node02, node03, node07, gpu5.

    Args:
        nodelist: SLURM's compressed form (as in ``SLURM_JOB_NODELIST``).
        where: What to call it in errors (e.g. the variable's name).

    Returns:
        The host names in SLURM's order.

    Raises:
        ValueError: the list is empty or malformed (the message quotes it).
    """
    text = nodelist.strip()
    if not text:
        raise ValueError(f"{where} is empty")
    hosts: List[str] = []
    for entry in _split_top(text, where):
        if not entry:
            raise ValueError(f"{where}: empty entry in {nodelist!r}")
        hosts.extend(_expand_name(entry, where))
    return hosts


def slurm_master_port(job_id: int) -> int:
    """The master port of the SLURM job ``job_id``: ``SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN``."""
    return SLURM_PORT_BASE + job_id % SLURM_PORT_SPAN


def _slurm_master(host: Optional[str], port: Optional[int]) -> Tuple[Optional[str], Optional[int]]:
    """Fill a missing master host/port from SLURM's environment (only in an srun task)."""
    if (host is not None and port is not None) or not _in_slurm_step():
        return host, port
    if host is None:
        name, nodelist = _first("SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
        if nodelist is None:
            raise ValueError(f"the SLURM environment is incomplete: SLURM_PROCID is set but SLURM_JOB_NODELIST is "
                             f"missing (or set MASTER_ADDR); {_SLURM_HINT}")
        host = parse_nodelist(nodelist, where=f"environment variable {name}")[0]
    if port is None:
        job_id = _slurm_int("SLURM_JOB_ID", "SLURM_JOBID")
        if job_id is None:
            raise ValueError(f"the SLURM environment is incomplete: SLURM_PROCID is set but SLURM_JOB_ID is missing "
                             f"(or set MASTER_PORT); {_SLURM_HINT}")
        port = slurm_master_port(job_id)
    return host, port


def _is_host_port(text: str) -> bool:
    try:
        return urlparse(f"tcp://{text}").port is not None
    except ValueError:  # a port that is not a number
        return False


def _master_from(init_method: Optional[str]) -> Tuple[str, int, bool]:
    """(host, port, all ranks are clients) from ``init_method`` and the environment."""
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    if init_method is None or init_method == "env://":
        host = os.environ.get("MASTER_ADDR") or None
        port = _env_int("MASTER_PORT")
        if init_method == "env://" and (host is None or port is None):
            raise ValueError("init_method='env://' needs MASTER_ADDR and MASTER_PORT in the environment")
        if not agent_store:
            host, port = _slurm_master(host, port)
        return host or DEFAULT_MASTER_ADDR, DEFAULT_MASTER_PORT if port is None else port, agent_store
    url = urlparse(init_method)
    if "://" not in init_method and _is_host_port(init_method):  # (the form the status view takes)
        raise ValueError(f"init_method={init_method!r} needs its scheme: init_method='tcp://{init_method}'")
    try:
        port = url.port
    except ValueError as err:  # urllib's "Port could not be cast to integer value as 'x'" / "out of range"
        raise ValueError(f"init_method={init_method!r}: its port is no port number ({err}); use "
                         f"'tcp://host:PORT' with PORT in 1..65535") from None
    if url.scheme != "tcp" or not url.hostname or port is None:
        raise ValueError(
            f"init_method={init_method!r} is not supported; use 'tcp://host:port', 'env://' or "
            f"None (MASTER_ADDR/MASTER_PORT, default {DEFAULT_MASTER_ADDR}:{DEFAULT_MASTER_PORT})"
        )
    return url.hostname, port, False


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


def open_store(rank: int, world_size: Optional[int], init_method: Optional[str], timeout: float) -> StoreInfo:
    """Host or join the world's TCPStore (``world_size`` None: an elastic world, no fixed size).

    Raises:
        ValueError: unsupported ``init_method`` or bad environment.
        OSError: rank 0 cannot listen on the master address.
        TimeoutError: the master cannot be reached within ``timeout`` seconds.
    """
    host, port, all_clients = _master_from(init_method)
    delta = datetime.timedelta(seconds=timeout)
    if rank == 0 and not all_clients:
        server = _serve(_listen(host, port), host, world_size, delta)
        port = server.port
        return StoreInfo(own_client(server, delta) or server, host, port, True, STORE_OF_RANK0, server)
    if all_clients:  # (torchrun's agent keeps its store: no rank closes it)
        return StoreInfo(connect_store(host, port, timeout), host, port, False, "the torchrun agent")
    return StoreInfo(connect_open(connect_store, host, port, timeout), host, port, False, STORE_OF_RANK0)


def host_store(host: str, world_size: int, timeout: float) -> dist.TCPStore:
    """Host a world's store on a free port of ``host`` (a launcher's; ``.port`` tells which).

    Raises:
        ValueError: ``host`` does not resolve.
        OSError: nothing can listen on ``host``.
    """
    return _serve(_listen(host, 0), host, world_size, datetime.timedelta(seconds=timeout))


def _serve(sock: socket.socket, host: str, world_size: Optional[int], timeout: datetime.timedelta) -> dist.TCPStore:
    """A store server on ``sock``, bound and listening, which it takes over (and closes when
    it goes); ``world_size`` None: no fixed size."""
    port = sock.getsockname()[1]
    return dist.TCPStore(host, port, world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach(), use_libuv=_LIBUV_TAKES_FD)


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
        return new_client(host, port, datetime.timedelta(seconds=timeout))
    except SilentStoreError:
        raise  # (reached: what answers there is not a store, and the error says so)
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


def _registered(url: str) -> Tuple[dist.Store, int, int]:
    with _rpc_lock:
        entry = _rpc_stores.get(urlparse(url).netloc)
    if entry is None:
        raise RuntimeError(f"no machinlike store registered for rendezvous {url!r}")
    return entry


def _rendezvous_handler(url: str, **kwargs: object) -> Iterator[Tuple[dist.Store, int, int]]:
    # (no local of this frame holds the store: torch keeps the generator in a global of
    # torch.distributed.rpc for the rest of the process, and the store's connection would
    # stay open with it after the World stopped)
    yield _registered(url)
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
