"""Is a peer process still alive? Cheaply, without a network round trip where possible.

Each rank publishes an identity at start-up: the machine's host name (for people: the
status view shows it) and boot id, its PID and network namespaces, its pid and its start
time (so that a pid the kernel gave to a new process once the rank died is not the rank:
``machinlike._pids``). A peer
with the same host, boot id and namespaces is checked through ``/proc`` (a zombie counts
as dead); any other peer is another host as far as liveness is concerned (a network
namespace can lose its network while its process lives on), and only its heartbeats tell.
"""

from __future__ import annotations

import os
import re
import socket
from typing import Optional

from ..._pids import PID_BITS, own_identity, state_of

__all__ = ["process_identity", "pid_in", "host_name", "alive_here", "running_here", "is_here", "DEFAULT_LIVENESS", "MAX_TICK", "tick_of"]

#: The World's default ``liveness`` (seconds): a silent member on another host is declared
#: lost after 3/4 of it. Shorter bounds declare busy members lost: a process that imports
#: ``torch._dynamo`` (the first optimizer) or collects a large heap can be silent for
#: seconds on a loaded machine, and a false loss frees the keys of a live member.
DEFAULT_LIVENESS = 10.0

#: Seconds between the monitor's ticks at most. A tick costs each member two store
#: requests (see watch), so the tick follows the liveness bound (an eighth of it): 0.25 s
#: at ``liveness=2`` (a death named to all within 2 s), 0.5 s at the default, half the
#: store load of the 0.25 s it was for every bound (a thousand members at 0.25 s kept
#: the store's one thread about half busy). A dead process on this host is seen within
#: a tick.
MAX_TICK = 0.5


def tick_of(liveness: Optional[float]) -> float:
    """The monitor's tick for a liveness bound (seconds; None: the default bound)."""
    return max(0.02, min(MAX_TICK, (liveness or DEFAULT_LIVENESS) / 8))


def _read(path: str) -> str:
    try:
        with open(path) as stream:
            return stream.read().strip()
    except OSError:
        return "?"


_cached: Optional[str] = None  # this process's namespace; a forked child reads it again


def _after_fork_in_child() -> None:
    global _cached
    _cached = None


os.register_at_fork(after_in_child=_after_fork_in_child)


def _namespace() -> str:
    # Called for every watched member at every liveness tick: no system call once cached.
    global _cached
    if _cached is not None:
        return _cached
    boot = _read("/proc/sys/kernel/random/boot_id")
    spaces = []
    for kind in ("pid", "net"):
        try:
            spaces.append(str(os.stat(f"/proc/self/ns/{kind}").st_ino))
        except OSError:
            spaces.append("?")
    # (a host name holds none of "@|/" in practice; a record or this format would break on them)
    name = re.sub(r"[@|/\s]", "_", socket.gethostname()) or "?"
    space = f"{name}@{boot}/{spaces[0]}:{spaces[1]}"
    _cached = space
    return space


def process_identity() -> str:
    """``<host name>@<boot id>/<pid namespace>:<net namespace>/<pid>+<start>`` of this
    process (``<start>``: its start time, in clock ticks since boot; with ``+``, absent
    where ``/proc`` does not tell it)."""
    start = own_identity() >> PID_BITS
    return f"{_namespace()}/{os.getpid()}" + (f"+{start}" if start else "")


def pid_in(identity: str) -> int:
    """The pid ``identity`` names; 0 when it holds none."""
    pid = identity.rpartition("/")[2].partition("+")[0]
    return int(pid) if pid.isdigit() else 0


def host_name(identity: str) -> str:
    """The host name an identity starts with; "" for one without (none recorded)."""
    return identity.partition("@")[0] if "@" in identity else ""


def is_here(identity: str) -> bool:
    """Whether ``identity`` names a process whose liveness ``/proc`` shows (no file read)."""
    space = identity.rpartition("/")[0]
    return "?" not in space and space == _namespace()


def _state_here(identity: str) -> Optional[str]:
    """The ``/proc`` state letter of the process ``identity`` names; "" when it is gone,
    None when it is not local."""
    space, _, tail = identity.rpartition("/")
    if "?" in space or space != _namespace():
        return None
    pid, _, start = tail.partition("+")
    if not pid.isdigit() or (start and not start.isdigit()):
        return ""
    return state_of(int(pid), int(start or 0))  # ("": gone, a zombie, or its pid went to a later process)


def alive_here(identity: str) -> Optional[bool]:
    """Whether the process ``identity`` names is alive; None when it is not local."""
    state = _state_here(identity)
    return None if state is None else state != ""


def running_here(identity: str) -> Optional[bool]:
    """Like :func:`alive_here`, but None for a local process stopped by a signal (SIGSTOP,
    SIGTSTP: state ``T``), whose liveness is then its heartbeat's, as a remote member's.

    Why: a stopped process serves no call, yet "alive here" kept it from ever being
    declared lost, and every call to it waited out its timeout (cold trial 24). One
    stopped by a debugger (``t``) counts as running: it is being looked at.
    """
    state = _state_here(identity)
    return None if state is None or state == "T" else state != ""
