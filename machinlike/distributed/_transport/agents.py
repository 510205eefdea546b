"""The RPC agents this process started: the current one, the retired ones, their shutdown.

Owns three lists, touched only through the functions here::

    started(agent)        the first dynamic agent is kept: torch's RRef context is bound
                          to it for the life of the process, so it is never shut down
    retire_current()      the current agent joins _retired (it keeps serving its pipes)
    reap_retired(...)     retired and done ──► _reaping (an AgentStop thread each) ──► gone
    shutdown(...)         the current one and every retired one, within one bound
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import List, Optional, Tuple

from torch.distributed import rpc

from . import agent_stop as _agent_stop

__all__ = ["started", "any_retired", "retire_current", "reap_retired", "pool_threads", "shutdown"]


log = logging.getLogger(__name__)


# Agents this process started. torch's RRef context is made once per process, bound to
# the first agent: RRefs made here after a second start name the first one.
_agents_started = 0


# The first of them, once it is started dynamically (held only to tell it apart).
_first: List[object] = []


def started(agent: Optional[object]) -> None:
    """Count an agent this process started; the first one, when it is ``agent`` (a dynamic
    start; None for a static one), is kept apart (see ``_first``)."""
    global _agents_started
    _agents_started += 1
    if _agents_started == 1 and agent is not None:
        _first.append(agent)


def any_retired() -> bool:
    """Whether a retired agent waits to be reaped."""
    return bool(_retired)


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
    runs on a thread of its own (see agent_stop): it waits for the calls its agent still
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
    if not _retired and not _reaping:
        return []  # the liveness tick's common case: no call into torch
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


# The current agent, read in the parent just before a fork (see _after_fork_in_child).
_at_fork: List[object] = []


def _before_fork() -> None:
    # In the parent, where torch may be called (the child may not: a lock another thread
    # held at the fork, torch's included, is held for good there).
    if rpc.is_available() and rpc.api._is_current_rpc_agent_set():
        _at_fork.append(rpc.api._get_current_rpc_agent())


def _after_fork_in_parent() -> None:
    _at_fork.clear()


def _after_fork_in_child() -> None:
    # A forked child (os.fork) inherits this process's agents as husks: their threads did
    # not cross the fork, and an agent's destructor joins them. Run by exit()'s static
    # destructors (the current agent) or by the interpreter's teardown (the lists here),
    # that join crashed the child (SIGSEGV) in place of the exit status it asked for. The
    # child keeps them for good instead: it has nothing of its own to free in them. (Only
    # Python here: no call into torch.)
    agents = [agent for agent, _ in _retired] + list(_first) + list(_at_fork)
    agents += [stop.agent for stop in _reaping if stop.agent is not None]
    for agent in agents:
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(agent))


os.register_at_fork(before=_before_fork, after_in_parent=_after_fork_in_parent,
                    after_in_child=_after_fork_in_child)


def shutdown(graceful: bool, timeout: float) -> None:
    """Stop this process's agent and the retired ones, waiting at most ``timeout`` seconds
    (at least 1) for the calls they still serve; never raises for an agent torch already
    tore down.

    ``graceful``: first a static group's graceful shutdown (every worker's barrier, then
    the calls under way finish) within ``timeout``; the local one follows in any case. An
    agent whose shutdown outruns the bound goes on shutting down in the background (see
    agent_stop) and this returns anyway: ``World.stop(timeout)`` keeps its word when a
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
