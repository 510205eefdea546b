"""When ``/dev/shm`` is too small: a copy goes by value, a share says how to make room.

Containers give ``/dev/shm`` 64 MB unless told otherwise (``docker run --shm-size``), and
every named or fd-shared tensor storage of torch lives there; torch then refuses with
"unable to allocate shared memory(shm) for file ...: No space left on device". Where the
receiver gets a copy anyway (a numpy array through a queue or a process's arguments),
the copy travels by value instead, slower but correct, and the process is told once.
Where sharing is the point (a tensor through a queue, ``share()``, a Hogwild model), the
error says what was asked, what is free and how to get more. Owns one flag: whether this
process has been told.

Why the room is read before torch allocates (``has_room``): torch before 2.11 sizes its
shared memory file without reserving the pages, so a copy into a file larger than the
room left killed the process with SIGBUS instead of raising; the reading is one
``statvfs`` (about a microsecond), beside an allocation that costs milliseconds.
"""

from __future__ import annotations

import os
import warnings
from typing import Optional, Tuple

__all__ = ["is_full", "has_room", "require_room", "size", "full_error", "warn_by_value"]

_SHM = "/dev/shm"
_warned = False


def is_full(err: BaseException, nbytes: Optional[int] = None) -> bool:
    """Whether ``err`` is torch's refusal to allocate shared memory for lack of room;
    ``nbytes``: what was asked for (None: unknown)."""
    text = str(err)
    if "shared memory" not in text:
        return False
    if "No space left" in text or "(28)" in text:
        return True
    # torch 2.11 words the same refusal "...: Success (0)" (its errno read after it was
    # overwritten): then the room there is decides.
    return nbytes is not None and "unable to allocate" in text and _space()[0] < nbytes


def has_room(nbytes: int) -> bool:
    """Whether /dev/shm has ``nbytes`` free (True when its size cannot be read: torch decides).
    Another process may take the room meanwhile; then torch's own refusal (``is_full``) is
    the answer, or, before torch 2.11, its SIGBUS."""
    free, total = _space()
    return not total or free >= nbytes


def size() -> int:
    """Bytes /dev/shm holds in all, free or not; 0 when it cannot be read."""
    return _space()[1]


def require_room(nbytes: int, what: str) -> None:
    """Raise ``full_error(nbytes, what)`` unless /dev/shm has ``nbytes`` free (see ``has_room``)."""
    if not has_room(nbytes):
        raise full_error(nbytes, what)


def _space() -> Tuple[int, int]:
    """Bytes (free, total) of /dev/shm; (0, 0) when they cannot be read."""
    try:
        stats = os.statvfs(_SHM)
    except OSError:
        return 0, 0
    return stats.f_bavail * stats.f_frsize, stats.f_blocks * stats.f_frsize


def _room() -> str:
    free, total = _space()
    if not total:
        return "a size that cannot be read"
    return f"{free / 2**20:.0f} MB free of {total / 2**20:.0f} MB"


_FIX = ("give the machine's shared memory more room: in Docker `--shm-size=8g` (or `--ipc=host`), in "
        "Kubernetes an emptyDir with medium Memory mounted at /dev/shm, elsewhere remount it "
        "(`mount -o remount,size=8G /dev/shm`)")


def full_error(nbytes: int, what: str) -> RuntimeError:
    """The error for ``what`` that needed ``nbytes`` of shared memory and found no room."""
    return RuntimeError(f"shared memory is full: {what} needs {nbytes / 2**20:.1f} MB of it and /dev/shm has "
                        f"{_room()}; {_FIX}")


def warn_by_value(nbytes: int, what: str) -> None:
    """Say once per process that copies go by value because shared memory is full."""
    global _warned
    if _warned:
        return
    _warned = True
    warnings.warn(f"shared memory is full (/dev/shm has {_room()}): {what} of {nbytes / 2**20:.1f} MB travels by value, "
                  f"through the pipe, and so will later ones that find no room (slower, still correct); "
                  f"to keep them in shared memory, {_FIX}", RuntimeWarning, stacklevel=2)
