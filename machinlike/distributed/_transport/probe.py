"""AgentProbe: whether this member's own RPC agent still answers calls.

Why: a member whose RPC stops answering while its process lives keeps beating its
heartbeat, so nobody declares it lost, and every call to it waits out its timeout, for
good. A soak saw it once: a member's TensorPipe shared-memory reactor stopped (its Python
went on). Only the member itself can tell a wedged agent from a slow peer, so it sends
its own agent a no-op call, through the same listener, reactor and threads a peer's call
takes; one unanswered within the bound means the agent is wedged, and the monitor renews
it (a new agent has its own reactor and threads; the old one goes through the bounded
shutdown of _transport.agent_stop).

When: only once a call timed out, either this member's own (its agent may be the one
wedged) or a peer's call to it (the peer bumps ``m/probe/<member>``; the monitor reads it
every second). Not all the time: a call to itself opens a pipe to itself, which holds
about 56 descriptors for the agent's life, and under ``ulimit -n 1024`` a member that
recycles its agents has none to spare.

    request()          a call timed out
    check(worker), each tick:
      requested, none under way     rpc_async(own worker, answer, timeout=within)
      answered                      fine
      unanswered after ``within``   wedged: renew ... unless every RPC thread is busy
                                    (services that block hold them all: renewing would
                                    only churn; warned once per stretch instead)
      the worker changed            the probe of the old agent is dropped
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from typing import Optional, Tuple

import torch
from torch.distributed import rpc

from . import agents as _agents

__all__ = ["AgentProbe", "answer", "least_within", "MIN_WITHIN", "WITHIN_ENV"]

log = logging.getLogger(__name__)

#: The least bound, seconds: a loaded machine can hold a process that long; a false
#: alarm costs one renewal.
MIN_WITHIN = 10.0
#: Sets another least bound (tests use a few seconds).
WITHIN_ENV = "MACHINLIKE_PROBE_WITHIN"


def least_within() -> float:
    """The least probe bound, seconds: ``MACHINLIKE_PROBE_WITHIN``, else :data:`MIN_WITHIN`.

    Raises:
        ValueError: the variable is not a positive number of seconds.
    """
    text = os.environ.get(WITHIN_ENV, "")
    if not text:
        return MIN_WITHIN
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{WITHIN_ENV}={text!r} must be a positive number of seconds; unset it for the "
                         f"default {MIN_WITHIN:g}")
    return value


def answer() -> None:
    """The probe's remote function (run by this very process)."""


class AgentProbe:
    """The probes of one member's agent: ``request`` from any thread, ``check`` from the
    liveness thread only.

    Args:
        within: Seconds a probe may stay unanswered (at least :func:`least_within`).

    Raises:
        ValueError: a bad ``MACHINLIKE_PROBE_WITHIN``.
    """

    def __init__(self, within: float) -> None:
        self.within = max(within, least_within())
        self._pending: Optional[Tuple[torch.futures.Future, float, str]] = None  # (future, sent, worker)
        self._requested = threading.Event()
        self._warned_busy = False
        #: Probes unanswered while every RPC thread was busy (not renewed for).
        self.busy_alarms = 0

    def request(self) -> None:
        """Probe at the next check (a call timed out); returns at once."""
        self._requested.set()

    def check(self, worker: str) -> Optional[str]:
        """Look at the probe under way, or send one when requested.

        Args:
            worker: The RPC worker this member answers as now.

        Returns:
            Why the agent must be renewed, or None.
        """
        now = time.monotonic()
        if self._pending is not None:
            future, sent, probed = self._pending
            if probed != worker:  # renewed meanwhile: that agent's answer no longer matters
                self._pending = None
            elif future.done():
                self._pending = None
                if _timed_out(future):
                    return self._verdict(worker, now - sent)
                self._warned_busy = False
            elif now - sent > self.within:  # (torch's own timeout needs a free RPC thread to fire)
                self._pending = None
                return self._verdict(worker, now - sent)
            return None
        if self._requested.is_set():
            self._requested.clear()
            try:
                self._pending = (rpc.rpc_async(worker, answer, timeout=self.within), now, worker)
            except RuntimeError as err:  # no agent this instant (a swap): next time
                log.debug("agent probe of %r not sent: %s", worker, err)
        return None

    def _verdict(self, worker: str, waited: float) -> Optional[str]:
        idle, size = _agents.pool_threads()
        if idle == 0:
            self.busy_alarms += 1
            if not self._warned_busy:
                self._warned_busy = True
                log.warning("machinlike: every one of the %d RPC threads of worker %r has been busy for %.0f s: "
                            "services that block hold them (give them a timeout, or raise World(rpc_threads=))",
                            size, worker, waited)
            return None
        return f"its RPC agent {worker!r} did not answer its own call within {waited:.0f} s"


def _timed_out(future: torch.futures.Future) -> bool:
    """Whether a finished probe failed by its timeout (other errors: the agent is going)."""
    try:
        future.wait()
    except RuntimeError as err:
        return "timeout" in str(err).lower()
    return False


