"""Ending child processes: the one escalation every part of machinlike uses.

::

    end_processes(processes, grace, linger, done)
      already ended? ─> reap
      linger: wait for them to end on their own, up to `linger` s; one whose `done`
              handle is ready (its work is over: a pipe it closed) has EXIT_S s from
              then, within the same `linger`
      else SIGTERM ──(wait on the sentinels, up to `grace` s)──> SIGKILL what is left
      └──> reap everything (up to `reap` s more: a SIGKILLed process ends at once,
           unless it sleeps uninterruptibly in the kernel, which no signal shortens)

Why one routine: the pool's workers and ``launch()``'s members end the same way, and a
second copy drifts (one waited per process, so a list of stuck processes took the grace
period once each). Waiting blocks on the processes' sentinels, never polls.
"""

from __future__ import annotations

import time
from multiprocessing import connection as _mp_connection
from typing import Any, Dict, List, Optional, Sequence

__all__ = ["end_processes", "REAP_WAIT", "EXIT_S"]

#: Seconds to wait for SIGKILLed processes to be reaped.
REAP_WAIT = 10.0
#: Seconds a lingering process whose work is done may take to end (its interpreter's
#: exit: finalizers, buffers; not a thread it left running, which SIGTERM then ends).
EXIT_S = 1.0


def end_processes(processes: Sequence[Any], grace: float, reap: float = REAP_WAIT, close: bool = False,
                  linger: float = 0.0, done: Optional[Dict[Any, Any]] = None) -> None:
    """End ``processes``: up to ``linger`` seconds for them to end by themselves, SIGTERM,
    up to ``grace`` seconds, SIGKILL, then reap them.

    One deadline covers the whole list: ``linger`` and ``grace`` each bound the wait for
    all of them together, not for each in turn.

    Args:
        processes: ``multiprocessing`` process objects (started or already ended).
        grace: Seconds between SIGTERM and SIGKILL; 0 kills at once.
        reap: Seconds to wait, all processes together, for the SIGKILLed ones to end;
            one still running after that (uninterruptible sleep) is left as it is.
        close: Also ``close()`` each reaped process object (frees its descriptors).
        linger: Seconds they may take to end on their own first (0: none).
        done: With ``linger``: a handle by process (anything ``connection.wait`` takes)
            that is ready once its work is over; it then has ``EXIT_S`` s to end (within
            ``linger``).
    """
    alive = [p for p in processes if _running(p)]
    if linger > 0:
        alive = _linger(alive, linger, done or {})
    if grace > 0:
        for p in alive:
            try:
                p.terminate()
            except (OSError, ValueError):  # ended meanwhile, or already closed
                pass
        alive = _linger(alive, grace, {})
    for p in alive:
        try:
            p.kill()
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + reap
    for p in processes:
        if p.pid is None:  # never started: nothing to reap
            continue
        try:
            p.join(max(0.0, deadline - time.monotonic()))
            if close:
                p.close()
        except ValueError:  # still running after SIGKILL, or closed already: leave it
            pass


def _linger(processes: List[Any], seconds: float, done: Dict[Any, Any]) -> List[Any]:
    """Those of ``processes`` still running once each ended, or ``seconds`` passed, or
    ``EXIT_S`` passed since its ``done`` handle was ready (none given: the sentinels alone)."""
    now = time.monotonic()
    until = {p: now + seconds for p in processes}  # when each stops being waited for
    marks = {done[p]: p for p in processes if p in done}
    sentinels = {p.sentinel: p for p in processes}
    while sentinels:
        now = time.monotonic()
        waited = [h for h, p in sentinels.items() if until[p] > now]
        if not waited:
            break
        ready = _mp_connection.wait(waited + list(marks), min(until[sentinels[h]] for h in waited) - now)
        for handle in ready:
            if handle in marks:  # its work is over: only its exit is waited for now
                process = marks.pop(handle)
                until[process] = min(until[process], time.monotonic() + EXIT_S)
            else:
                sentinels.pop(handle, None)
    return list(sentinels.values())


def _running(process: Any) -> bool:
    try:
        return process.pid is not None and process.exitcode is None
    except ValueError:  # closed: it was reaped already
        return False
