"""Shutting down a torch RPC agent within a bound.

Why: an agent's ``shutdown()`` closes its connections at once, then waits, with no bound,
for every call the agent is still serving to return (torch's TensorPipe agent waits for
its thread pool). A service that blocks, say a handler waiting on a queue nobody fills,
held ``World.stop(timeout=3)`` for the handler's whole 59 s, and would hold the liveness
monitor (which shuts retired agents down) as long; TensorPipe's own join has stalled too
(seen once in a soak: spinning in ``shm::ContextImpl::join``). So a shutdown runs on a
thread of its own, and whoever started it waits as long as it chooses:

    AgentStop(agent) ──► thread "machinlike-rpc-stop-<worker>": agent.shutdown()
        .wait(bound)     True once it returned; False when ``bound`` ran out first:
                         nothing can cancel it, so it goes on in the background
        .done()          the monitor's form: start now, look again on a later tick

A stalled shutdown keeps its agent alive on purpose (its thread holds it): destroying the
agent would wait for the same calls. While one is stalled, torch's Python RPC handler
must stay (the calls that agent still serves return through it): see :func:`stalled`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import List, Optional

__all__ = ["AgentStop", "stalled"]

log = logging.getLogger(__name__)

# Shutdowns started in this process and not finished yet (torch's agents are per process).
_running: List["AgentStop"] = []
_lock = threading.Lock()


class AgentStop:
    """One agent's shutdown, started on a thread of its own when this object is made.

    Attributes:
        worker: The agent's worker name.
        started: ``time.monotonic()`` when the shutdown began.
    """

    def __init__(self, agent: object) -> None:
        self.worker: str = agent.get_worker_info().name  # type: ignore[attr-defined]
        self.started = time.monotonic()
        self._agent: Optional[object] = agent
        self._finished = threading.Event()
        with _lock:
            _running[:] = [s for s in _running if not s.done()]
            _running.append(self)
        threading.Thread(target=self._run, name=f"machinlike-rpc-stop-{self.worker}", daemon=True).start()

    def _run(self) -> None:
        try:
            self._agent.shutdown()  # type: ignore[union-attr]
        except RuntimeError as err:  # torch already tore it down
            log.debug("RPC shutdown of %r: %s", self.worker, err)
        finally:
            # The agent's pipes (and their descriptors and shared memory) go with the
            # object, not with its shutdown: let it go here, on this thread.
            self._agent = None
            self._finished.set()

    @property
    def agent(self) -> Optional[object]:
        """The agent, until its shutdown returned (then None)."""
        return self._agent

    def done(self) -> bool:
        """Whether the shutdown returned."""
        return self._finished.is_set()

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds (0 or less: just look); whether it returned."""
        return self._finished.wait(max(timeout, 0.0))

    def warn_stalled(self) -> None:
        """Log that this shutdown outran its bound (once per caller's decision)."""
        log.warning("machinlike: RPC agent %r has not shut down after %.1f s: a call it serves has not returned "
                    "(a service that blocks without a timeout?); it goes on shutting down in the background",
                    self.worker, time.monotonic() - self.started)


def stalled() -> List[str]:
    """The workers whose shutdown started in this process and has not returned."""
    with _lock:
        _running[:] = [s for s in _running if not s.done()]
        return [s.worker for s in _running]
