"""Which process a pid names: the pid with its start time, so that a reused pid is not it.

Why: a lease of shared memory (``_shm._segments``) or of a CUDA slab (``cuda_ipc_area``)
names its taker in a word that the owner reads to take the lease back once the taker died,
and a member's published process identity (``_membership.processes``) tells the others
whether it still runs on this host. A bare pid lies once the kernel hands it to a new
process: the lease then stays lent, or the member looks alive, for as long as the newcomer
lives. ``pid_max`` is 32768 on many hosts, so a learner running for days beside actors that
come and go sees pids come back. The kernel's start time of a process (``/proc/<pid>/stat``,
field 22, clock ticks since boot) never changes while it lives and differs for a successor
started a tick later or more::

    word (int64):  [ start time (41 bits) | pid (22 bits) ]     start 0: a bare pid
    state_of(pid, start): /proc/<pid>/stat's state letter; "" when there is no such
        process, it is a zombie, or (start given) it started at another time

A pid needs at most 22 bits (the kernel's ``PID_MAX_LIMIT``); 41 bits of ticks at 100 Hz
last 700 years, so the word stays positive (the leases' states are other words). No torch:
the status tool (``machinlike._lean``) reads identities too.
"""

from __future__ import annotations

import os
from typing import List, Optional

__all__ = ["PID_BITS", "PID_MASK", "pid_alive", "pid_of", "own_identity", "identity", "start_of", "state_of"]

PID_BITS = 22
PID_MASK = (1 << PID_BITS) - 1

_own: Optional[int] = None


def _fields(pid: int) -> Optional[List[bytes]]:
    """The fields of ``/proc/<pid>/stat`` from the state on (field 3); None: no such process."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        # (after the parenthesised command name, which may hold spaces and parentheses)
        return os.read(fd, 4096).rpartition(b")")[2].split()
    except OSError:
        return None
    finally:
        os.close(fd)


def start_of(pid: int) -> int:
    """Process ``pid``'s start time (clock ticks since boot); 0 when it cannot be read."""
    fields = _fields(pid)
    return int(fields[19]) if fields is not None and len(fields) > 19 else 0  # (field 22)


def state_of(pid: int, start: int = 0) -> str:
    """Process ``pid``'s state letter (``R``, ``S``, ``T``...); "" when it is gone: no such
    process, a zombie, or (``start`` not 0) one that started at another time than ``start``."""
    fields = _fields(pid)
    if not fields or fields[0] in (b"Z", b"X"):
        return ""
    if start and (len(fields) <= 19 or int(fields[19]) != start):
        return ""
    return fields[0].decode()


def pid_of(word: int) -> int:
    """The pid in an identity word (or a bare pid)."""
    return word & PID_MASK


def identity(pid: int) -> int:
    """Process ``pid``'s identity word (a bare pid when its start time cannot be read)."""
    return pid | start_of(pid) << PID_BITS if pid <= PID_MASK else pid


def own_identity() -> int:
    """This process's identity word (read once; a forked child reads its own)."""
    global _own
    if _own is None:
        _own = identity(os.getpid())
    return _own


def pid_alive(word: int) -> bool:
    """Whether the process ``word`` names (an identity, or a bare pid of this PID namespace)
    runs and is not a zombie; False when its pid now belongs to a process started later."""
    return state_of(word & PID_MASK, word >> PID_BITS) != ""


def _after_fork_in_child() -> None:
    global _own
    _own = None


os.register_at_fork(after_in_child=_after_fork_in_child)
