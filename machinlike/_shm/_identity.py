"""Which process holds a lease: a pid with its start time, so that a reused pid is not it.

Why: a lease of shared memory (``_segments``) or of a CUDA slab (``cuda_ipc_area``) names
its taker in a word that the owner reads to take the lease back once the taker died. A bare
pid lies once the kernel hands it to a new process: the lease then stays lent for as long
as the newcomer lives. ``pid_max`` is 32768 on many hosts, so a learner running for days
beside actors that come and go sees pids come back. The kernel's start time of a process
(``/proc/<pid>/stat``, field 22, clock ticks since boot) never changes while it lives and
differs for its successor, so a taker writes ``pid | start << PID_BITS``::

    word (int64):  [ start time (41 bits) | pid (22 bits) ]     start 0: a bare pid
    pid_alive(word): /proc/<pid>/stat exists, not a zombie, and (start given) same start

A pid needs at most 22 bits (the kernel's ``PID_MAX_LIMIT``); 41 bits of ticks at 100 Hz
last 700 years, so the word stays positive (the leases' states are other words).
"""

from __future__ import annotations

import os
from typing import Optional

__all__ = ["PID_BITS", "PID_MASK", "pid_alive", "pid_of", "own_identity", "identity"]

PID_BITS = 22
PID_MASK = (1 << PID_BITS) - 1

_own: Optional[int] = None


def _stat(pid: int) -> Optional[bytes]:
    """The fields of ``/proc/<pid>/stat`` after the command's name; None: no such process."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 4096).rpartition(b")")[2]
    except OSError:
        return None
    finally:
        os.close(fd)


def pid_of(word: int) -> int:
    """The pid in an identity word (or a bare pid)."""
    return word & PID_MASK


def identity(pid: int) -> int:
    """Process ``pid``'s identity word (a bare pid when its start time cannot be read)."""
    fields = _stat(pid)
    if fields is None or pid > PID_MASK:
        return pid
    return pid | int(fields.split()[19]) << PID_BITS  # (field 22; the first after the name is field 3)


def own_identity() -> int:
    """This process's identity word (read once; a forked child reads its own)."""
    global _own
    if _own is None:
        _own = identity(os.getpid())
    return _own


def pid_alive(word: int) -> bool:
    """Whether the process ``word`` names (an identity, or a bare pid of this PID namespace)
    runs and is not a zombie; False when its pid now belongs to a process started later."""
    fields = _stat(word & PID_MASK)
    if fields is None:
        return False
    parts = fields.split()
    if parts[0] in (b"Z", b"X"):
        return False
    start = word >> PID_BITS
    return not start or int(parts[19]) == start


def _after_fork_in_child() -> None:
    global _own
    _own = None


os.register_at_fork(after_in_child=_after_fork_in_child)
