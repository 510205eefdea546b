"""The RPC transport: torch's TensorPipe agent, started static or dynamic, and pruned.

Everything machinlike needs from torch's *private* RPC internals lives here, so that a
torch upgrade has one file to check (written against torch 2.13):

- ``rpc._init_rpc_backend``: start an agent on a store we choose. ``rpc.init_rpc`` in
  dynamic mode wraps the store in a prefix taken from a per-process counter, so a process
  that ran an earlier World would land in another namespace than its peers.
- ``agent._update_group_membership(info, [], {}, True)`` on each listed worker: tell it
  about a joiner (what torch's dynamic ``init_rpc`` does).
- ``_reset_current_rpc_agent`` and ``api._get_current_rpc_agent``: retire an agent whose
  listener closed, so that a new one can start while the old one keeps serving.
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
import os
import threading
import time
import warnings
from typing import Callable, Iterable, Iterator, List, Optional, Tuple

import torch.distributed as dist
import torch.distributed.autograd as dist_autograd
from torch.distributed import rpc

from . import _agent_stop

__all__ = ["claim_worker_id", "id_space", "worker_seq", "worker_id", "id_held", "start_static",
           "static_start_quiet", "start_dynamic", "retire_current", "wait_current", "wait_steady",
           "no_agent_error", "closed_agent_error", "reap_retired", "forget_retired", "pool_threads",
           "rrefs_bound_elsewhere", "published_address", "prune_workers", "release_token_of", "token_holder",
           "listed_workers", "set_default_timeout", "shutdown"]

log = logging.getLogger(__name__)

_TOKEN = "RpcGroupManagementToken"
_INFOS = "names/_ALL_WORKER_INFOS"

# torch's worker ids are 16-bit (int16). An elastic worker is named "<member>_<seq>" by a
# sequence number that never comes round, and answers as torch id seq mod the id space;
# _endpoint says why an id can be given again safely.
ID_SPACE_ENV = "MACHINLIKE_WORKER_ID_SPACE"
DEFAULT_ID_SPACE = 32000


def id_space() -> int:
    """How many torch worker ids an elastic world cycles through (``MACHINLIKE_WORKER_ID_SPACE``,
    default 32,000; smaller values are for tests that make ids come round quickly).

    Raises:
        ValueError: the variable is not a whole number in [16, 32767].
    """
    text = os.environ.get(ID_SPACE_ENV, str(DEFAULT_ID_SPACE))
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 16 <= value <= 32767:
        raise ValueError(f"{ID_SPACE_ENV}={text!r} must be a whole number from 16 to 32767 (torch's worker ids "
                         f"are 16-bit); unset it for the default {DEFAULT_ID_SPACE}")
    return value


def worker_seq(worker: str) -> Optional[int]:
    """The sequence number of elastic worker ``worker`` (``<member>_<seq>``); None for a
    static world's worker (its name is its member's)."""
    base, _, seq = worker.rpartition("_")
    return int(seq) if base and seq.isdigit() else None


def worker_id(worker: str) -> Optional[int]:
    """The torch id of elastic worker ``worker``; None for a static world's worker."""
    seq = worker_seq(worker)
    return None if seq is None else seq % id_space()


def id_held(store: dist.Store, tid: int) -> bool:
    """Whether torch id ``tid`` is claimed in the dynamic group kept in ``store`` (by a
    live worker, or a gone one whose keys are not deleted yet)."""
    return bool(store.check([f"names/{tid}"]))


# TensorPipe channels of an elastic member's agents. torch's default list adds mpt_uv (a
# multi-lane TCP channel) and xth (same process); an agent with them holds about 175
# descriptors before it opens any pipe, with these about 64. A long-lived elastic member
# holds up to three agents at once (its first, which torch's RRef context keeps, the
# current one, and one retiring after a recycling), so under ``ulimit -n 1024`` the
# default list left too little room: benchmarks/soak.py peaked at 930 descriptors and
# the store stopped accepting its actors' connections; with these, 424-704 over 100
# cycles. cma moves CPU tensors between processes of one host; basic carries everything
# else over the transport's own connection (shm on one host, uv TCP between hosts).
ELASTIC_CHANNELS = ["cma", "basic"]


def _options(threads: int, timeout: float, init_method: Optional[str],
             channels: Optional[List[str]] = None) -> rpc.TensorPipeRpcBackendOptions:
    """torch's backend options; ``channels`` None: torch's default channel list."""
    chosen = None if channels is None else list(channels)
    if init_method is None:
        return rpc.TensorPipeRpcBackendOptions(num_worker_threads=threads, rpc_timeout=timeout, _channels=chosen)
    return rpc.TensorPipeRpcBackendOptions(num_worker_threads=threads, rpc_timeout=timeout,
                                           init_method=init_method, _channels=chosen)


# Agents this process started. torch's RRef context is made once per process, bound to
# the first agent: RRefs made here after a second start name the first one.
_agents_started = 0
# The first of them, once it is started dynamically (held only to tell it apart).
_first: List[object] = []
# The store of the dynamic group the agents joined (where workers' addresses are).
_group_store: List[dist.Store] = []


def rrefs_bound_elsewhere() -> bool:
    """Whether RRefs made in this process name an agent other than the current one."""
    return _agents_started > 1


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


def start_static(name: str, rank: int, world_size: int, init_method: str, threads: int, timeout: float) -> None:
    """Start a static agent (``world_size`` fixed) through ``init_method``'s rendezvous."""
    with static_start_quiet():
        rpc.init_rpc(name, rank=rank, world_size=world_size,
                     rpc_backend_options=_options(threads, timeout, init_method))
    global _agents_started
    _agents_started += 1


def start_dynamic(store: dist.Store, name: str, tid: int, threads: int, timeout: float, deadline: float,
                  holder_dead: Callable[[str], bool], dead: Callable[[str], bool],
                  freed: Optional[Callable[[str], bool]] = None) -> None:
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

    Raises:
        TimeoutError: the token stayed held by a live joiner until ``deadline``.
        RuntimeError: the agent could not start, or a live worker did not answer.
    """
    from torch.distributed.rpc import TensorPipeAgent, api

    store.set_timeout(datetime.timedelta(seconds=timeout))
    _group_store[:] = [store]
    try:
        dist_autograd._init(tid)
    except RuntimeError:
        # The container keeps the first id this process had (an earlier World); it only
        # numbers distributed-autograd contexts, which elastic worlds do not support.
        pass
    mine = f"Token_for_{name}_join"
    _acquire_token(store, mine, deadline, holder_dead)
    swapped = False
    try:
        stale = [w for w in listed_workers(store) if w != name and dead(w)]
        if stale:
            _prune_locked(store, stale, freed)
        agent = TensorPipeAgent(store, name, tid, None, _options(threads, timeout, None, ELASTIC_CHANNELS), {},
                                [])
        # A renewal: the agent this one replaces stays current until the new one is built
        # and listening, so that calls of this process meet no agent-less gap but the
        # swap itself (sync calls wait it out: see wait_current).
        _swap(agent)
        swapped = True
        global _agents_started
        _agents_started += 1
        if _agents_started == 1:
            _first.append(agent)
        me = agent.get_worker_info()
        gone = []
        for worker in agent.get_worker_infos():
            if worker.name != name and not _tell(worker.name, me, timeout, dead):
                gone.append(worker.name)
        if gone:  # so that the next joiner does not call them again
            _prune_locked(store, gone)
    except BaseException:
        try:
            _prune_locked(store, [name])
        finally:
            if swapped and not _retired:
                shutdown(False, timeout)
            # A renewal's new agent that failed to join stays current until the next
            # attempt's swap retires it: it listens and reaches every worker it knows (the
            # others are introduced on demand, see _calls), where dropping it left this
            # process with no agent at all, and a user's RRef.to_here() made then failed
            # with "Current RPC agent is not set".
        raise
    finally:
        _release_token(store, mine)


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
            retire_current()
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
    joined while this process renewed its agent: see ``_calls._renewed_worker``).

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
    # address is deleted (see _forget), and that wait would last the store's whole timeout.
    if not _group_store or published_address(_group_store[0], worker) is None:
        return False
    try:
        agent._update_group_membership(rpc.WorkerInfo(worker, tid), [], {}, True)  # type: ignore[attr-defined]
    except RuntimeError as err:
        log.debug("introducing %r to %s RPC agent: %s", worker, which, err)
        return False
    return True


def _forget(store: dist.Store, worker: str) -> None:
    """Delete what the dynamic group keeps in ``store`` for worker ``worker``, off the list
    now: the address its agent published and its membership-token keys (one set per worker
    that ever joined; left, they grow with every death), and ``names/<id>``, where torch's
    agent claimed its id (which can then be given again: see _endpoint). Best effort: the
    store may be gone."""
    tid = worker_id(worker)
    names = [f"names/{tid}"] if tid is not None else []
    for key in (f"addrs/{worker}", f"Token_for_{worker}_join", f"Token_for_{worker}_prune",
                f"Token_for_{worker}_leave", *names):
        try:
            store.delete_key(key)
        except (RuntimeError, ConnectionError) as err:
            log.debug("forgetting RPC worker %r: %s", worker, err)
            return


# Expected by a compare-and-set that only reads: no address equals it, and a store hands
# back the expected text for a missing key without setting it.
_READ_PROBE = "\x00read"


def published_address(store: dist.Store, worker: str) -> Optional[str]:
    """The listener address worker ``worker``'s agent published, e.g. ``"uv://10.0.0.2:41235"``;
    None when there is none (anymore).

    Read in one compare-and-set that changes nothing: a check then a get would wait the
    store's whole timeout for an address deleted in between (the monitor thread stalled
    5 s in benchmarks/soak.py when a worker was pruned just then).
    """
    held = store.compare_set(f"addrs/{worker}", _READ_PROBE, _READ_PROBE).decode()
    return None if held == _READ_PROBE else held


# Agents replaced by a newer one in this process (a renewal or a recycling), with the
# time they were retired: they keep serving the connections they have until reaped.
_retired: List[Tuple[object, float]] = []
# Retired agents whose shutdown reap_retired started and has not reported yet.
_reaping: List[_agent_stop.AgentStop] = []


def retire_current() -> None:
    """Let another agent become this process's current one; the old one keeps running.

    Its connections still carry the calls under way (either way), so a renewal fails
    nothing that was under way. :func:`reap_retired` shuts it down later, :func:`shutdown`
    at the latest.
    """
    from torch._C._distributed_rpc import _reset_current_rpc_agent

    _retired.append((rpc.api._get_current_rpc_agent(), time.monotonic()))
    _reset_current_rpc_agent()


def reap_retired(idle_before: float, retired_before: float) -> List[str]:
    """Start shutting down the retired agents that are done: retired before ``idle_before``
    and with no call under way (either way), or retired before ``retired_before`` (times of
    ``time.monotonic()``; a call under way that long has timed out by then). Each shutdown
    runs on a thread of its own (see _agent_stop): it waits for the calls its agent still
    serves, and a service that never returns must not hold the caller (the liveness monitor).

    This is what frees the pipes an agent kept to every worker it ever called (torch
    never drops one; on one host each holds TensorPipe's shared-memory ring buffers: about
    8 MB, 24 maps and 24 descriptors). The process's first agent is never shut down:
    torch's RRef context holds it for the life of the process.

    Returns:
        The workers whose shutdown returned since the last call, and those whose shutdown
        began before ``retired_before`` and still runs (logged as stalled: an agent closes
        its connections first, so nothing reaches them any more).
    """
    first = _first_agent()
    due = [(a, t) for a, t in _retired
           if a is not first and (t < retired_before or (t < idle_before and _idle(a)))]
    for entry in due:
        _retired.remove(entry)
        _reaping.append(_agent_stop.AgentStop(entry[0]))
    workers = []
    for stopping in list(_reaping):
        if not stopping.done() and stopping.started < retired_before:
            stopping.warn_stalled()
        elif not stopping.done():
            continue
        _reaping.remove(stopping)
        workers.append(stopping.worker)
    return workers


def forget_retired(store: dist.Store, worker: str) -> bool:
    """Delete the dynamic group's keys of this process's retired, shut-down worker
    ``worker`` (its address and token keys), unless it is still listed (torch reads the
    address of every listed worker while it builds an agent); whether they went."""
    if worker in listed_workers(store):
        return False
    _forget(store, worker)
    return True


def _idle(agent: object) -> bool:
    """Whether ``agent`` has no call under way, sent or served (torch's own counters)."""
    metrics = agent.get_metrics()  # type: ignore[attr-defined]
    return all(metrics.get(k, "0") == "0" for k in
               ("agent.client_active_calls", "agent.server_active_calls", "agent.server_active_async_calls"))


def pool_threads() -> Tuple[int, int]:
    """(idle, all) threads serving calls in the current agent; (-1, -1) when unknown."""
    try:
        metrics = rpc.api._get_current_rpc_agent().get_metrics()
        return int(metrics.get("agent.num_idle_threads", -1)), int(metrics.get("agent.thread_pool_size", -1))
    except (RuntimeError, ValueError):
        return -1, -1


def _first_agent() -> Optional[object]:
    """The agent torch's RRef context is bound to (the process's first), if it is retired."""
    return _first[0] if _first else None


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


def _acquire_token(store: dist.Store, mine: str, deadline: float, holder_dead: Callable[[str], bool]) -> None:
    while True:
        held = store.compare_set(_TOKEN, "", mine).decode()
        if held == mine:
            return
        if holder_dead(held):
            release_token_of(store, held)
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the RPC membership token stays held by {held!r}")
        try:
            store.wait([held], datetime.timedelta(seconds=min(left, 1.0)))
        except dist.DistStoreError:
            pass  # re-check whether the holder died meanwhile


def _release_token(store: dist.Store, mine: str) -> None:
    store.compare_set(_TOKEN, mine, "")
    store.set(mine, "Done")  # wakes whoever waits on this token's key


def release_token_of(store: dist.Store, token: str) -> None:
    """Release the membership token if ``token`` (a dead holder's) still holds it."""
    if store.compare_set(_TOKEN, token, "").decode() == "":
        log.info("released the RPC membership token left by %r", token)
    store.set(token, "Done")


def token_holder(token: str) -> Optional[str]:
    """The worker name inside a token value (``Token_for_<name>_join|leave``), if any."""
    prefix = "Token_for_"
    for suffix in ("_join", "_leave", "_prune"):
        if token.startswith(prefix) and token.endswith(suffix):
            return token[len(prefix):-len(suffix)]
    return None


def prune_workers(store: dist.Store, me: str, gone: Iterable[str], deadline: float,
                  holder_dead: Callable[[str], bool], freed: Optional[Callable[[str], bool]] = None) -> List[str]:
    """Remove workers from the dynamic group's list in ``store``, under torch's token.

    Args:
        store: The agent group's store (the one given to :func:`start_dynamic`).
        me: This process's worker name (names the token).
        gone: Worker names to remove.
        deadline: ``time.monotonic()`` deadline for taking the token.
        holder_dead: Whether the token value's holder is dead (then it is released).
        freed: As for :func:`start_dynamic`.

    Returns:
        The names that were listed and are now removed.

    Raises:
        TimeoutError: the token stayed held by a live joiner until ``deadline``.
    """
    mine = f"Token_for_{me}_prune"
    _acquire_token(store, mine, deadline, holder_dead)
    try:
        return _prune_locked(store, gone, freed)
    finally:
        _release_token(store, mine)


def _prune_locked(store: dist.Store, gone: Iterable[str], freed: Optional[Callable[[str], bool]] = None) -> List[str]:
    gone = set(gone)
    if not store.check([_INFOS]):
        return []
    entries = [e for e in store.get(_INFOS).decode().split(",") if e]
    keep = [e for e in entries if e.rpartition("-")[0] not in gone]
    if len(keep) != len(entries):
        store.set(_INFOS, "".join(f"{e}," for e in keep))
    removed = [e.rpartition("-")[0] for e in entries if e not in keep]
    for worker in removed:
        # Only once it is off the list, and under the token: torch's agent reads the
        # address of every listed worker while it is built, with a store get that waits
        # for a missing key (its whole timeout, holding the GIL: the process stood still).
        if freed is not None and freed(worker):
            _forget(store, worker)
    return removed


def listed_workers(store: dist.Store) -> List[str]:
    """Worker names the dynamic group's list holds (read without the token)."""
    if not store.check([_INFOS]):
        return []
    return [e.rpartition("-")[0] for e in store.get(_INFOS).decode().split(",") if e]


def shutdown(graceful: bool, timeout: float) -> None:
    """Stop this process's agent and the retired ones, waiting at most ``timeout`` seconds
    (at least 1) for the calls they still serve; never raises for an agent torch already
    tore down.

    ``graceful``: first a static group's graceful shutdown (every worker's barrier, then
    the calls under way finish) within ``timeout``; the local one follows in any case. An
    agent whose shutdown outruns the bound goes on shutting down in the background (see
    _agent_stop) and this returns anyway: ``World.stop(timeout)`` keeps its word when a
    service blocks, and the process can start another World.
    """
    from torch._C._distributed_rpc import _cleanup_python_rpc_handler, _destroy_rref_context, _reset_current_rpc_agent

    deadline = time.monotonic() + max(timeout, 1.0)
    try:
        agent: Optional[object] = rpc.api._get_current_rpc_agent()
    except RuntimeError:  # none: never started, or already shut down
        agent = None
    stops = list(_reaping)
    _reaping.clear()
    if agent is not None:
        if graceful:
            _graceful(agent, timeout)
            deadline = max(deadline, time.monotonic() + 1.0)  # (the local part's own second)
        try:
            _destroy_rref_context(rpc.api._ignore_rref_leak)
        except RuntimeError as err:
            log.debug("RPC shutdown, RRef context: %s", err)
        stops.append(_agent_stop.AgentStop(agent))
    while _retired:
        stops.append(_agent_stop.AgentStop(_retired.pop()[0]))
    for stopping in stops:
        if not stopping.wait(deadline - time.monotonic()):
            stopping.warn_stalled()
    if agent is None:
        return
    # torch's rpc.shutdown does these two itself, and would do them on the thread that runs
    # it: left running past its bound, it would later reset a newer World's agent.
    if not _agent_stop.stalled():  # a stalled agent's calls still return through the handler
        _cleanup_python_rpc_handler()
    _reset_current_rpc_agent()


def _graceful(agent: object, timeout: float) -> None:
    """A static group's graceful shutdown (torch's: all workers' barrier, the RRefs
    deleted, the calls under way finished), on a thread of its own within ``timeout``
    seconds: the agent's join waits for this process's calls without a bound. Elastic
    agents skip it: a member leaves through the membership, not through torch's dynamic
    leave (which calls every worker)."""
    if not getattr(agent, "is_static_group", False):
        return
    finished = threading.Event()

    def run() -> None:
        try:
            rpc.api._wait_all_workers(timeout)
            rpc.api._delete_all_user_and_unforked_owner_rrefs()
            agent.join(shutdown=True, timeout=timeout)  # type: ignore[attr-defined]
        except Exception as err:  # the local shutdown follows in any case
            log.debug("graceful RPC shutdown: %s", err)
        finally:
            finished.set()

    threading.Thread(target=run, name="machinlike-rpc-graceful", daemon=True).start()
    if not finished.wait(timeout):
        log.warning("machinlike: the graceful RPC shutdown did not finish within %.1f s; shutting down locally",
                    timeout)
