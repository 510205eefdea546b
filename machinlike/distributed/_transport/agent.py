"""Starting torch's TensorPipe agent, static or dynamic, and swapping it for a new one.

Everything machinlike needs from torch's *private* RPC internals lives in this folder
(here, ``agents``, ``dynamic_group``), so that a torch upgrade has one folder to check
(written against torch 2.13):

- ``rpc._init_rpc_backend``: start an agent on a store we choose. ``rpc.init_rpc`` in
  dynamic mode wraps the store in a prefix taken from a per-process counter, so a process
  that ran an earlier World would land in another namespace than its peers.
- ``agent._update_group_membership(info, [], {}, True)`` on each listed worker: tell it
  about a joiner (what torch's dynamic ``init_rpc`` does).
- ``_reset_current_rpc_agent`` and ``api._get_current_rpc_agent``: retire an agent whose
  listener closed, so that a new one can start while the old one keeps serving.
- ``rpc.internal._internal_rpc_pickler._dispatch_table`` (in ``tensor_parts``): its tensor
  entry, wrapped so that tensors without a storage travel as their parts.
- The store key ``addrs/<worker>``: the address an agent listens on; ``names/<id>``: the
  worker that claimed torch id <id> (deleted with the worker's other keys).
- The store layout of torch's dynamic join: the joiner takes the token
  ``RpcGroupManagementToken``, reads ``names/_ALL_WORKER_INFOS`` ("name-id," entries) and
  calls every listed worker. A worker that died stays listed (and every later join fails
  calling it, leaving the token held), so the dead are pruned from that list under the
  token, and a token left by a dead joiner is released.

Why a dynamic agent at all: a static agent has a fixed world size and cannot admit a
process that starts later or comes back after a crash.

Why a gone worker is never removed from an agent (only from the store's list): torch's
agent guards its worker maps with a lock only in *static* groups, and hands out
references into them. Removing an entry while another thread sends or frees an RRef is a
use-after-free: the chaos loop crashed survivors with SIGSEGV, or lost a live worker's
entry ("could not find destination name"). Entries of gone workers stay (a few bytes
each; every worker has its own name, so none is ever reused); calls never reach them
because the membership layer refuses a gone member first. The maps then only grow, so
their rare rehashes are the one unsynchronised mutation left.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
import warnings
from typing import Callable, Iterator, List, Optional

import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch.distributed import rpc

from . import agents as _agents, dynamic_group as _group, tensor_parts as _tensor_parts
from .workers import worker_id

__all__ = ["claim_worker_id", "start_static", "static_start_quiet", "start_dynamic", "wait_current", "wait_steady",
           "renewing", "no_agent_error", "closed_agent_error", "introduce_current", "set_default_timeout",
           "ELASTIC_CHANNELS"]


log = logging.getLogger(__name__)


# TensorPipe channels of an elastic member's agents. torch's default list adds mpt_uv (a
# multi-lane TCP channel) and xth (same process); an agent with them holds about 175
# descriptors before it opens any pipe, with these about 64. A long-lived elastic member
# holds up to three agents at once (its first, which torch's RRef context keeps, the
# current one, and one retiring after a recycling), so under ``ulimit -n 1024`` the
# default list left too little room: benchmarks/soak.py peaked at 930 descriptors and
# the store stopped accepting its actors' connections; with these, 424-704 over 100
# cycles. cma moves CPU tensors between processes of one host; basic carries everything
# else over the transport's own connection (shm on one host, uv TCP between hosts).
# A static World all of whose ranks run on one host takes them too (``start_static``'s
# ``channels``): there mpt_uv's lanes carried nothing (cma outranks it, and the lane and
# shared memory carry the calls) and cost each process 16 event-loop threads and about
# 110 descriptors.
ELASTIC_CHANNELS = ["cma", "basic"]


def _options(threads: int, timeout: float, init_method: Optional[str], channels: Optional[List[str]] = None,
             transports: Optional[List[str]] = None) -> rpc.TensorPipeRpcBackendOptions:
    """torch's backend options; ``channels`` / ``transports`` None: torch's default list."""
    chosen = None if channels is None else list(channels)
    ways = None if transports is None else list(transports)
    if init_method is None:
        return rpc.TensorPipeRpcBackendOptions(num_worker_threads=threads, rpc_timeout=timeout, _channels=chosen,
                                               _transports=ways)
    return rpc.TensorPipeRpcBackendOptions(num_worker_threads=threads, rpc_timeout=timeout,
                                           init_method=init_method, _channels=chosen, _transports=ways)


@contextlib.contextmanager
def static_start_quiet() -> Iterator[None]:
    """Around torch's static ``init_rpc``: hide the one deprecation warning torch raises at itself.

    Where it comes from: a static TensorPipe start (``world_size`` given) builds a bare
    gloo *Backend* (``rpc/backend_registry.py: _init_process_group`` calls
    ``dist.ProcessGroupGloo(store, rank, size, timeout)``) and hands it to
    ``dist.all_gather_object`` to exchange device maps, whose ``_get_object_coll_device``
    warns that a Backend is not a ProcessGroup. Neither object is ours, and torch offers
    no way to pass a ProcessGroup there, so the warning is hidden for exactly that call,
    in this thread's warning state, and nothing else.
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="You are using a Backend", category=UserWarning)
        yield


def claim_worker_id(rank: int) -> None:
    """Give this process's distributed-autograd container the id ``rank``, as a static
    ``init_rpc`` does first; here, once the store is reached and before the ranks exchange
    names, so that a refusal comes at once, with its cause and fix, instead of after the
    other ranks' rendezvous.

    Raises:
        RuntimeError: an earlier World in this process had another worker id (an elastic
            one's, or another rank); torch keeps the first id for the life of the process.
    """
    try:
        dist_autograd._init(rank)
    except RuntimeError as err:
        raise RuntimeError(
            f"this process cannot start a static World as rank {rank}: an earlier World here ran as another RPC "
            f"worker id, and torch's distributed autograd keeps that id for the life of the process ({err}); "
            f"start the static World in a fresh process (machinlike.launch or a new interpreter), or join an "
            f"elastic World instead") from err


def start_static(name: str, rank: int, world_size: int, init_method: str, threads: int, timeout: float,
                 transports: Optional[List[str]] = None, channels: Optional[List[str]] = None) -> None:
    """Start a static agent (``world_size`` fixed) through ``init_method``'s rendezvous;
    ``transports``, ``channels`` None: TensorPipe's default lists."""
    _tensor_parts.install()
    with static_start_quiet():
        rpc.init_rpc(name, rank=rank, world_size=world_size,
                     rpc_backend_options=_options(threads, timeout, init_method, channels, transports))
    _agents.started(None)


def start_dynamic(store: dist.Store, name: str, tid: int, threads: int, timeout: float, deadline: float,
                  holder_dead: Callable[[str], bool], dead: Callable[[str], bool],
                  freed: Optional[Callable[[str], bool]] = None, transports: Optional[List[str]] = None) -> None:
    """Join the dynamic agent group kept in ``store`` as worker ``name`` with id ``tid``.

    torch's own dynamic join (``init_rpc`` without a world size) calls every listed worker
    under the membership token and, when one of them is dead, fails with the token still
    held and then waits for it in its own shutdown. This one holds the token in a
    ``finally``, prunes dead workers first, skips a worker that dies while it is being
    told about the newcomer, and gives up (to be retried) when a live one stays silent.

    Args:
        timeout: Seconds for each call to an existing worker; also the store's timeout.
        deadline: ``time.monotonic()`` deadline for taking the token.
        holder_dead: Whether a token value's holder is dead (then it is released).
        dead: Whether a listed worker is dead (pruned before joining).
        freed: Whether a pruned worker's member is gone for good, so that its address
            goes too (a live member's retired worker keeps its own: calls that still
            name it are introduced with it); None: every address stays.
        transports: TensorPipe's transports; None: its default list.

    Raises:
        TimeoutError: the token stayed held by a live joiner until ``deadline``.
        RuntimeError: the agent could not start, or a live worker did not answer.
    """
    from torch.distributed.rpc import TensorPipeAgent

    _tensor_parts.install()
    store.set_timeout(datetime.timedelta(seconds=timeout))
    _group.remember(store)
    try:
        dist_autograd._init(tid)
    except RuntimeError:
        # The container keeps the first id this process had (an earlier World); it only
        # numbers distributed-autograd contexts, which elastic worlds do not support.
        pass
    mine = f"Token_for_{name}_join"
    _group.acquire_token(store, mine, deadline, holder_dead)
    swapped = False
    try:
        stale = [w for w in _group.listed_workers(store) if w != name and dead(w)]
        if stale:
            _group.prune_locked(store, stale, freed)
        agent = TensorPipeAgent(store, name, tid, None, _options(threads, timeout, None, ELASTIC_CHANNELS, transports), {},
                                [])
        # A renewal: the agent this one replaces stays current until the new one is built
        # and listening, so that calls of this process meet no agent-less gap but the
        # swap itself (sync calls wait it out: see wait_current).
        _swap(agent)
        swapped = True
        _agents.started(agent)
        me = agent.get_worker_info()
        gone = []
        for worker in agent.get_worker_infos():
            if worker.name != name and not _tell(worker.name, me, timeout, dead):
                gone.append(worker.name)
        if gone:  # so that the next joiner does not call them again
            _group.prune_locked(store, gone)
    except BaseException:
        try:
            _group.prune_locked(store, [name])
        finally:
            if swapped and not _agents.any_retired():
                _agents.shutdown(False, timeout)
            # A renewal's new agent that failed to join stays current until the next
            # attempt's swap retires it: it listens and reaches every worker it knows (the
            # others are introduced on demand, see _calls), where dropping it left this
            # process with no agent at all, and a user's RRef.to_here() made then failed
            # with "Current RPC agent is not set".
        raise
    finally:
        _group.release_token(store, mine)


def _swap(agent: "rpc.TensorPipeAgent") -> None:
    """Make ``agent`` this process's current one; the one it replaces is retired.

    torch sets an agent only where none is set, so there is a gap, and each of the two
    calls releases the GIL inside it. A thread of torch's that turns a reply into Python
    (``PythonRpcHandler::deserialize``) asks for the current agent once it holds the GIL:
    in the gap it fails ("Current RPC agent is not set") although the call ran. So this
    process's calls are held at the gate (see :func:`wait_steady`) and the old agent's
    calls under way are given up to ``_DRAIN`` seconds to be answered before the swap;
    a call that finds no agent waits it out (see :func:`wait_current`).
    """
    from torch._C._distributed_rpc import _set_and_start_rpc_agent

    names = {info.name for info in agent.get_worker_infos()}
    _steady.clear()
    try:
        if rpc.api._is_current_rpc_agent_set():
            _drain(rpc.api._get_current_rpc_agent(), time.monotonic() + _DRAIN)
            _agents.retire_current()
        _set_and_start_rpc_agent(agent)
        rpc.api._ALL_WORKER_NAMES = names  # what torch's _init_rpc_states would set
    finally:
        _steady.set()


# Seconds a swap waits for the replies to the calls under way on the agent it retires.
_DRAIN = 2.0


def _drain(agent: object, deadline: float) -> None:
    """Wait until ``agent`` awaits no reply, or ``deadline`` (``time.monotonic()``)."""
    pause = 0.0005
    while time.monotonic() < deadline:
        if agent.get_metrics().get("agent.client_active_calls", "0") == "0":  # type: ignore[attr-defined]
            return
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    log.debug("RPC agent swap: calls still under way after %g s", _DRAIN)


def wait_steady(timeout: float) -> None:
    """Hold a call while this process swaps its agent (at most ``timeout`` s; at once if not)."""
    if not _steady.is_set():
        _steady.wait(max(0.0, timeout))


# Clear while this process swaps its current agent for a new one (a renewal): a call
# made in that instant finds no agent and may wait for the swap to end (wait_current).
_steady = threading.Event()


_steady.set()


# Clear while this process renews its agent, every attempt of the join included: a call
# that finds no current agent then (the swap's gap) waits for the renewal to end.
_settled = threading.Event()


_settled.set()


@contextlib.contextmanager
def renewing() -> Iterator[None]:
    """Mark an agent renewal under way (all its join attempts) for :func:`wait_current`."""
    _settled.clear()
    try:
        yield
    finally:
        _settled.set()


def wait_current(timeout: float) -> bool:
    """Wait (at most ``timeout`` s) until no agent swap or renewal is under way; whether an
    agent is current."""
    deadline = time.monotonic() + max(0.0, timeout)
    _steady.wait(max(0.0, timeout))
    if not rpc.api._is_current_rpc_agent_set():
        _settled.wait(max(0.0, deadline - time.monotonic()))
    return bool(rpc.api._is_current_rpc_agent_set())


def no_agent_error(err: BaseException) -> bool:
    """Whether ``err`` is torch's "no current agent" error (nothing was sent)."""
    text = str(err)
    return "Current RPC agent is not set" in text or "RPC has not been initialized" in text


def closed_agent_error(err: BaseException) -> bool:
    """Whether ``err`` comes from an agent shut down under the call (nothing was sent):
    TensorPipe's closed context knows no transport any more."""
    return isinstance(err, ValueError) and "unsupported transport" in str(err)


def introduce_current(worker: str) -> bool:
    """Tell this process's current agent of RPC worker ``worker`` of an elastic world (it
    joined while this process renewed its agent: see ``_calls.send._renewed_worker``).

    Returns:
        Whether the agent knows ``worker`` now (False: static world, no agent, or the
        worker's address is not published, e.g. it is gone).
    """
    if not rpc.api._is_current_rpc_agent_set():
        return False
    return _add_worker(rpc.api._get_current_rpc_agent(), worker, "the current")


def _add_worker(agent: object, worker: str, which: str) -> bool:
    """Add elastic RPC worker ``worker`` (``<name>_<id>``) to ``agent``'s tables, reading its
    address from the store; whether it could (a static world's name, or a worker gone
    before its address could be read, cannot)."""
    tid = worker_id(worker)
    if tid is None:
        return False  # a static world's worker: its agent is never renewed
    # torch reads the address with a store get that waits for the key: a gone worker's
    # address is deleted (see dynamic_group._forget), and that wait would last the store's whole timeout.
    store = _group.group_store()
    if store is None or _group.published_address(store, worker) is None:
        return False
    try:
        agent._update_group_membership(rpc.WorkerInfo(worker, tid), [], {}, True)  # type: ignore[attr-defined]
    except RuntimeError as err:
        log.debug("introducing %r to %s RPC agent: %s", worker, which, err)
        return False
    return True


def set_default_timeout(seconds: float) -> None:
    """The agent's default RPC timeout from now on."""
    rpc._set_rpc_timeout(seconds)


def _tell(worker: str, me: "rpc.WorkerInfo", timeout: float, dead: Callable[[str], bool]) -> bool:
    """Tell ``worker`` about the joiner ``me``; False when it is dead (skipped).

    A live worker that does not answer is not skipped: it would stay unknown to the
    joiner for good (agents' worker tables are never repaired). The attempt fails
    instead and is made again, without the token (the worker may need it: one whose
    listener closed renews its agent through a join of its own).

    Raises:
        RuntimeError: it is alive but did not answer.
    """
    from torch.distributed.rpc import api
    from torch.distributed.rpc._utils import _update_group_membership

    try:
        api.rpc_sync(worker, _update_group_membership, args=(me, [], {}, True), timeout=timeout)
        return True
    except RuntimeError as err:
        if dead(worker):
            log.info("RPC join of %r: %r is dead; skipping it", me.name, worker)
            return False
        raise RuntimeError(f"RPC join of {me.name!r}: {worker!r} is alive but does not answer ({err})") from err
