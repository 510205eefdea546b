"""PidWatch: the liveness thread's sleep, cut short when a watched process of this host ends.

Owns one pidfd per watched member that runs on this host, a wake pipe, and the poll set.

    Monitor._run
      pids.watch(watched records)     pidfd_open(pid) for each one on this host
      pids.sleep(tick)  ───────────►  poll(pidfds + wake pipe, tick)
        returns at the tick, at once when a watched process exits (its pidfd turns
        readable), or when ``closing`` is set (the pipe); the tick that follows finds
        the process dead in /proc and declares it

Why: a SIGKILLed process on this host was seen at its watcher's next tick (up to 0.5 s),
and named to the others a tick after that. The kernel tells a pidfd's holder the moment
the process exits, so the watcher now declares at once, whatever the tick.
A pidfd that fired is closed and not opened again for that member (it stays readable:
polling it again would spin while the loss is being declared). Where ``pidfd_open`` is
missing (Linux before 5.3, other systems) this sleeps the tick, as before.
"""

from __future__ import annotations

import os
import select
import threading
from typing import Dict, Iterable, Optional, Set

from .._store import MemberRecord
from .processes import is_here, pid_in

__all__ = ["PidWatch", "WakingEvent"]


class PidWatch:
    """Sleeps until a tick passes or a watched process of this host exits.

    Attributes:
        woken: Sleeps cut short by a watched process's exit.
    """

    def __init__(self) -> None:
        self._fds: Dict[str, int] = {}  # identity -> pidfd (bounded by the watched members)
        self._fired: Set[str] = set()  # identities whose pidfd fired (not watched again)
        self._poll: Optional["select.poll"] = None
        self._wake_r: Optional[int] = None
        self._wake_w: Optional[int] = None
        self._lock = threading.Lock()  # wake() comes from other threads; the rest from one
        self.woken = 0

    def watch(self, records: Iterable[MemberRecord]) -> None:
        """Watch these members' processes (those on this host); stop watching the others."""
        if not hasattr(os, "pidfd_open"):
            return
        wanted = {r.identity for r in records if is_here(r.identity)}
        for identity in [i for i in self._fds if i not in wanted]:
            self._drop(identity)
        self._fired &= wanted
        for identity in wanted - self._fired - self._fds.keys():
            try:
                fd = os.pidfd_open(pid_in(identity))  # (a later process with its pid: the tick's /proc check tells)
            except (OSError, ValueError):
                continue  # gone already (the tick's /proc check sees it) or not allowed
            self._ensure_poll().register(fd, select.POLLIN)
            self._fds[identity] = fd

    def sleep(self, timeout: float, closing: threading.Event) -> bool:
        """Sleep up to ``timeout`` seconds; returns whether ``closing`` is set.

        Ends early when a watched process exits or :meth:`wake` is called.
        """
        if not self._fds:
            return closing.wait(timeout)
        if closing.is_set():
            return True
        assert self._poll is not None  # (registered with the first pidfd)
        for fd, _ in self._poll.poll(max(0, int(timeout * 1000))):
            if fd == self._wake_r:
                try:
                    os.read(fd, 64)
                except OSError:
                    pass
                continue
            identity = next((i for i, f in self._fds.items() if f == fd), None)
            if identity is not None:
                self.woken += 1
                self._fired.add(identity)
                self._drop(identity)
        return closing.is_set()

    def wake(self) -> None:
        """End a sleep under way (any thread; ``closing`` was just set)."""
        with self._lock:
            if self._wake_w is not None:
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass  # full (a wake is pending anyway) or closed

    def close(self) -> None:
        """Close every descriptor (the thread that sleeps has ended)."""
        for identity in list(self._fds):
            self._drop(identity)
        with self._lock:
            for fd in (self._wake_r, self._wake_w):
                if fd is not None:
                    os.close(fd)
            self._wake_r = self._wake_w = None
            self._poll = None

    def _ensure_poll(self) -> "select.poll":
        if self._poll is None:
            with self._lock:
                self._wake_r, self._wake_w = os.pipe()
                os.set_blocking(self._wake_r, False)
                os.set_blocking(self._wake_w, False)
                self._poll = select.poll()
                self._poll.register(self._wake_r, select.POLLIN)
        return self._poll

    def _drop(self, identity: str) -> None:
        fd = self._fds.pop(identity)
        if self._poll is not None:
            self._poll.unregister(fd)
        os.close(fd)


class WakingEvent(threading.Event):
    """A ``threading.Event`` whose ``set`` also ends a :class:`PidWatch` sleep.

    Why a subclass: the member's ``closing`` event is set from several places (leave,
    close, a test's teardown); each must end the liveness thread's poll at once, as it
    ended the ``Event.wait`` that the poll replaced.
    """

    def __init__(self, pids: PidWatch) -> None:
        super().__init__()
        self._pids = pids

    def set(self) -> None:
        super().set()
        self._pids.wake()
