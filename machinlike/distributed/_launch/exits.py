"""How a rank of :func:`~machinlike.launch` ended: the error its launcher raises, and the
record it leaves in the world's store for ``python -m machinlike status``.

    a rank's sentinel fires with no report ──► exited(process): ProcessExitedError naming
                                                its exit code or signal
    any failure (a report of an exception,  ──► RankExits.record: m/exit/<name> of the world
      or such an exit)                          (on the store launch() hosts, in this process)
                                                  static: <ns> from the rank's World counter
                                                  elastic: mlk/0/e/, the incarnation whose
                                                  claim names the pid, else the newest counted

Why the launcher writes too: it is the one process that sees a rank's exit status (a
SIGKILL, the OOM killer's, says nothing to anyone else), and it still runs when the rank
is gone. The member's own account (the exception it raised) outranks it, and it outranks
the declarer's (how the loss was seen): see ``_membership.exit_causes``.
"""

from __future__ import annotations

import logging
import signal
from typing import Any, List, Optional, Set

import torch.distributed as dist

from ... import _mainguard, _warm
from ...exception import ProcessExitedError, describe_exitcode
from .._membership import describe_exception, pid_in, record_exit
from .._store import ExitRecord, Keys, MemberRecord, value_or_empty

__all__ = ["RESTART_ROOT", "RankExits", "exited"]

log = logging.getLogger(__name__)

_NO_REPORT = "it ended without reporting a result"
# What a rank's SIGABRT most often is: C++ code of torch's that threw where nothing
# catches (TensorPipe's event loop out of descriptors, for one), its message printed first.
_ABORTED = (" (a C++ abort: its message, such as TensorPipe's 'too many open files', is on the rank's standard "
            "error just before)")
RESTART_ROOT = "0"  # the namespace root of a store launch() hosts (no torchrun rounds there)


def exited(process: Any) -> ProcessExitedError:
    """The error of a rank's ``process`` that ended without a report (it is joined first)."""
    process.join()
    server = _warm.server_of_died(process) if process.exitcode == 255 else None
    if server is not None:  # (255: the pipe of the forkserver that started it closed, not its own end)
        return ProcessExitedError(process.name, process.pid, process.exitcode, (
            f"the forkserver that started the ranks (pid {server}) died, so this rank's own end is unknown; look "
            f"for the OOM killer (dmesg) or a kill of that pid. The run ends"))
    detail = _mainguard.explain(process.exitcode) or _NO_REPORT + (
        _ABORTED if process.exitcode == -signal.SIGABRT else "")
    return ProcessExitedError(process.name, process.pid, process.exitcode, detail)


class RankExits:
    """Records each failed rank's end in the world's store, as its launcher saw it.

    Args:
        store: The world's store, as ``launch`` hosts it (its server answers from this
            process: no new connection, whose name look-up could hold up a restart).
        names: The member name of each rank.
        elastic: Whether the ranks form an elastic world (else a static one).
    """

    def __init__(self, store: dist.Store, names: List[str], elastic: bool) -> None:
        self._store = store
        self._names = names
        self._elastic = elastic
        self._chaos: Set[int] = set()  # pids killed by chaos, not yet recorded (at most one per rank)

    def chaos(self, pid: int) -> None:
        """``pid`` is being killed by ``launch(chaos=...)`` (its record says so)."""
        self._chaos.add(pid)

    def by_chaos(self, pid: Optional[int]) -> bool:
        """Whether ``pid`` was killed by ``launch(chaos=...)`` (and not recorded yet)."""
        return pid in self._chaos

    def record(self, rank: int, pid: Optional[int], failure: BaseException) -> None:
        """Record how ``rank`` (process ``pid``) ended: ``failure`` is the exception it
        reported, or the :func:`exited` error naming ``pid`` (best effort: a rank whose World
        never started has no record, and a store error is logged at debug level)."""
        chaos = pid in self._chaos
        self._chaos.discard(pid or 0)
        try:
            if isinstance(failure, ProcessExitedError) and failure.pid == pid:  # (exited's, not a reported one)
                cause = describe_exitcode(failure.exitcode) + (" (chaos)" if chaos else "")
            else:
                cause = describe_exception(failure)
            self._write(rank, pid or 0, cause)
        except Exception as err:  # the store is going (the run ends) or refused: the record is extra
            log.debug("launch: could not record how rank %d ended: %s", rank, err)

    def _write(self, rank: int, pid: int, cause: str) -> None:
        store, name = self._store, self._names[rank]
        if self._elastic:
            keys = Keys.elastic_world(RESTART_ROOT)
            claim = value_or_empty(store, keys.live(name))
            held = MemberRecord.decode(name, claim) if claim else None
            counted = value_or_empty(store, keys.incarnations(name))
            if held is not None and pid_in(held.identity) == pid:
                incarnation = held.incarnation
            elif counted:
                incarnation = int(counted)  # (its claim is cleared already: the newest one counted is it)
            else:
                return  # it died before it counted itself in
        else:
            world = value_or_empty(store, Keys.static_counter(RESTART_ROOT, rank))
            if not world:
                return  # its World never got as far as a namespace
            keys, incarnation = Keys.static_world(RESTART_ROOT, int(world)), 1
        record_exit(lambda key, old, new: store.compare_set(key, old, new).decode(), keys, name,
                    ExitRecord(incarnation, pid, "launcher", cause))
