"""A child process ends when its parent dies.

``watch_parent()`` starts one daemon thread, ``machinlike-parent-watch``, that blocks on
``multiprocessing.parent_process().sentinel`` (a pipe whose other end only the parent
holds: it becomes readable at EOF, when the parent is gone, however it died) and then
ends this process with ``os._exit``. No polling, no signals from the parent needed, so a
SIGKILLed parent still takes its children along. Used by :class:`machinlike.process.Process`
for daemon children, and meant for pool workers and launched ranks.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import sys
import threading
from typing import Optional

__all__ = ["watch_parent", "PARENT_DIED_EXITCODE", "THREAD_NAME"]

#: Exit code of a process ended because its parent died.
PARENT_DIED_EXITCODE = 70
#: Name of the watchdog thread.
THREAD_NAME = "machinlike-parent-watch"

_lock = threading.Lock()
_watcher: Optional[threading.Thread] = None
_watcher_pid: Optional[int] = None


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held it at fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def watch_parent(exitcode: int = PARENT_DIED_EXITCODE) -> Optional[threading.Thread]:
    """End this process with ``os._exit(exitcode)`` as soon as its parent dies.

    Idempotent: one watchdog per process. Call it in the child, early.

    Args:
        exitcode: Exit code to end with.

    Returns:
        The watchdog thread, or None when this process has no multiprocessing parent
        (the main process, or one started without a parent sentinel).
    """
    global _watcher, _watcher_pid
    parent = multiprocessing.parent_process()
    sentinel = getattr(parent, "sentinel", None)
    if parent is None or sentinel is None:
        return None
    with _lock:
        # after a fork the inherited record names a thread that does not exist here
        if _watcher is not None and _watcher_pid == os.getpid() and _watcher.is_alive():
            return _watcher
        watcher = threading.Thread(
            target=_watch, args=(sentinel, parent.pid, os.getppid(), exitcode), name=THREAD_NAME, daemon=True
        )
        watcher.start()
        _watcher, _watcher_pid = watcher, os.getpid()
        return watcher


def _watch(sentinel: int, parent_pid: Optional[int], started_by: int, exitcode: int) -> None:
    """``started_by``: the pid of the process that forked this one (a warm forkserver's,
    where one started it: its death ends its children too, the parent living on)."""
    try:
        multiprocessing.connection.wait([sentinel])
    except (OSError, ValueError):  # the sentinel was closed here: nothing left to watch
        return
    if started_by != parent_pid and parent_pid is not None and _alive(parent_pid):
        # (it said "parent process <pid> is gone" of a parent that was alive; cold trial 27)
        said = (f"machinlike: the process server that started process {os.getpid()} (pid {started_by}) died, "
                f"which ends its children; their parent, process {parent_pid}, goes on; process {os.getpid()} exits\n")
    else:
        said = f"machinlike: parent process {parent_pid} is gone; process {os.getpid()} exits\n"
    try:
        sys.stderr.write(said)
        sys.stderr.flush()
    except Exception:  # stderr may be closed; exiting matters more than saying so
        pass
    os._exit(exitcode)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's: it exists)
        return True
    return True
