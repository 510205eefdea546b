"""Opening a descriptor of another process of this host, through ``/proc/<pid>/fd``.

Why one place: the shared-memory receiver and the CUDA export area both reach a sender's
memfd this way, and both must refuse the same two failures in the same words: the sender
is gone (the path no longer opens), or it closed that descriptor and the number now names
other memory (the inode the sender announced no longer matches). And both take a claim
through such a descriptor (a lock the sender only ever tries, and holds for microseconds),
retried the same way: ``retry_within``.
"""

from __future__ import annotations

import os
import time
from typing import Callable

__all__ = ["open_peer_fd", "retry_within"]


def open_peer_fd(pid: int, fd: int, inode: int, what: str) -> int:
    """A descriptor of this process onto descriptor ``fd`` of process ``pid``, opened
    read-write and close-on-exec; the caller closes it.

    Args:
        pid, fd: The sender's process and its descriptor number.
        inode: The inode the sender announced for that descriptor.
        what: What the memory is, for the messages ("the shared memory").

    Raises:
        RuntimeError: the sender is gone or closed the descriptor ("cannot reach ..."), or
            the number now names other memory ("... was closed or released before ...").
    """
    try:
        handle = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as exc:
        raise RuntimeError(
            f"cannot reach {what} of process {pid} (descriptor {fd}): the sender is gone or closed it "
            f"before this receiver loaded its tensors ({exc.strerror})"
        ) from exc
    try:
        if os.fstat(handle).st_ino != inode:
            raise RuntimeError(
                f"{what} of process {pid} (descriptor {fd}) was closed or released before this receiver "
                f"loaded its tensors: the descriptor now names other memory"
            )
    except BaseException:
        os.close(handle)
        raise
    return handle


def retry_within(attempt: Callable[[], bool], seconds: float) -> bool:
    """Call ``attempt`` (a non-blocking lock: there is no timed wait for one) until it
    returns True, pausing from 0.1 ms, doubling to 10 ms, between tries; whether it did
    within ``seconds``."""
    deadline = time.monotonic() + seconds
    pause = 0.0001
    while not attempt():
        if time.monotonic() >= deadline:
            return False
        time.sleep(pause)
        pause = min(pause * 2, 0.01)
    return True
