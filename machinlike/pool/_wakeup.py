"""The manager thread's wake-up pipe and the handshake that keeps it quiet.

::

    manager:  arm() ── poll([wake-up fd, ...]) ── disarm() ── drain() if the fd fired
    callers:  claim() (true once per sleep) ──> wake(): one byte into the pipe

A caller that changed something the manager must act on (new tasks it cannot write
itself, a state change, a replacement to start) wakes the manager, but only while it
sleeps and only once per sleep: ``claim()`` says whether this caller is the one to write.
So a burst of ``apply_async`` calls costs one write, not one per call (CPython's
``_ThreadWakeup`` writes on every submit).

``arm``, ``disarm`` and ``claim`` are called with the engine lock held (the manager
decides to sleep under it); ``wake``, ``drain`` and ``close`` take this object's own lock,
which only guards the descriptors against being written after they are closed.
"""

from __future__ import annotations

import os
import threading

__all__ = ["Wakeup"]


class Wakeup:
    """A non-blocking self-pipe plus the sleeping/woken handshake (see the module docstring)."""

    __slots__ = ("_read", "_write", "_lock", "_armed", "_woken")

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._read, False)
        os.set_blocking(self._write, False)
        self._lock = threading.Lock()  # the fds are closed once, never written after
        self._armed = False
        self._woken = False

    @property
    def fd(self) -> int:
        """The descriptor the manager polls for reading."""
        return self._read

    def arm(self) -> None:
        """The manager is about to sleep (engine lock held)."""
        self._armed = True

    def disarm(self) -> None:
        """The manager is awake again (engine lock held)."""
        self._armed = False
        self._woken = False

    def sleeping(self) -> bool:
        """Whether the manager sleeps and nobody has woken it yet (engine lock held)."""
        return self._armed and not self._woken

    def claim(self) -> bool:
        """Take the one wake-up of this sleep; True: the caller must call :meth:`wake`."""
        if not self._armed or self._woken:
            return False
        self._woken = True
        return True

    def wake(self) -> None:
        """Write one byte (outside the engine lock). A no-op once closed."""
        with self._lock:
            if self._write < 0:
                return  # the manager has finished
            try:
                os.write(self._write, b"\0")
            except OSError:  # full: a wake-up is pending anyway
                pass

    def drain(self) -> None:
        """Empty the pipe (manager thread)."""
        try:
            while os.read(self._read, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        """Close both ends; later wake-ups do nothing. Idempotent."""
        with self._lock:
            for fd in (self._read, self._write):
                if fd >= 0:
                    os.close(fd)
            self._read = self._write = -1
