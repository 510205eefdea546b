"""The threads of this process's lane server (``lane_server``): a crew that reads and runs
calls, and a spare that watches the connections whose reader is running a call.

    a connection's reader reads a REQ frame:
      none of its calls unanswered, nothing more read ahead, a run slot free
        ─► runs it itself, the Spare watching its connection meanwhile ─► takes the
           reading back ─► reads on (no thread woken for the call)
        a request that comes meanwhile ─► the Spare wakes ─► Crew.start: another thread
           reads the connection (and runs what it reads, the same way)
      else ─► Crew.submit: a crew thread runs it (once a slot is free: the next thread
        whose call ends runs it); the reader reads on

Why the reader runs the call: when a reader handed each call to a worker thread, the call
waited for that worker to wake (10-27 us on the 2-core box, 45 us on a GPU host's VM:
BENCHMARKS.md, session 44). Handing the reading on to another thread instead costs the
same wake-up, and that thread's start then competes with the call for the GIL (a 1 KB
echo took 12-15 us longer on the 2-core box: session 46). So nobody is woken: the spare
sleeps in ``epoll`` on the connections whose reader is busy, and wakes only when a request
comes before that reader is back. A call that waits for a later one on its own
connection is still served: the later one wakes the spare.

Why one spare and not a reader each: a connection's next request comes, nearly always,
after its reader is back (the caller waits for the answer); an ``epoll_ctl`` to watch and
another to stop cost a microsecond each, a wake-up tens.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import select
import threading
from typing import Callable, Deque, Optional

__all__ = ["Crew", "Spare", "Job"]

Job = Callable[[], None]

log = logging.getLogger(__name__)

_WATCHED = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT
_UNWATCHED = select.EPOLLONESHOT  # (registered, reporting nothing: a hang-up may fire once)


class Crew:
    """The lane's threads: one reads each connection, up to ``most`` run calls, the rest
    idle until they are handed work (at most ``most`` idle threads are kept)."""

    def __init__(self, most: int) -> None:
        self._most = most
        self._lock = threading.Lock()
        self._jobs: "queue.SimpleQueue[Optional[Job]]" = queue.SimpleQueue()
        self._idle = 0  # threads waiting in _jobs, none promised a job yet
        self._slots = 0  # calls running
        self._waiting: Deque[Job] = collections.deque()  # calls read while every slot was taken
        self._stopped = False

    def start(self, job: Job) -> None:
        """Run ``job`` on an idle thread, or a new one: never queued behind other work."""
        with self._lock:
            idle = self._idle > 0
            if idle:
                self._idle -= 1  # (that thread is promised this job: each put meets a waiting get)
        if idle:
            self._jobs.put(job)
        else:
            threading.Thread(target=self._thread, args=(job,), name="machinlike-lane-serve", daemon=True).start()

    def slot(self, call: Job) -> bool:
        """Take a run slot for ``call``: True, run it now (``run``); False, every slot is
        taken, and it waits its turn."""
        with self._lock:
            if self._slots < self._most:
                self._slots += 1
                return True
            self._waiting.append(call)
            return False

    def take_slot(self) -> bool:
        """Take a run slot if one is free (then ``run_one``)."""
        with self._lock:
            if self._slots < self._most:
                self._slots += 1
                return True
            return False

    def submit(self, call: Job) -> None:
        """Run ``call`` on another thread once a slot is free."""
        if self.slot(call):
            self.start(lambda: self.run(call))

    def run(self, call: Job) -> None:
        """Holding a slot: run ``call``, then the calls waiting their turn; then let the slot go."""
        job: Optional[Job] = call
        while job is not None:
            job()
            job = None  # (its arguments are not kept while the next is taken)
            with self._lock:
                if self._waiting:
                    job = self._waiting.popleft()
                else:
                    self._slots -= 1

    def run_one(self, call: Job) -> None:
        """Holding a slot: run ``call``; then hand the slot to the next call waiting its
        turn, on another thread (this one is a connection's reader), or let it go."""
        try:
            call()
        finally:
            with self._lock:
                job = self._waiting.popleft() if self._waiting else None
                if job is None:
                    self._slots -= 1
            if job is not None:
                self.start(lambda: self.run(job))

    def _thread(self, job: Optional[Job]) -> None:
        while job is not None:
            job()
            job = None
            with self._lock:
                if self._stopped or self._idle >= self._most:
                    return
                self._idle += 1
            job = self._jobs.get()

    def stop(self) -> None:
        """Let idle threads end, and the others once their work is done."""
        with self._lock:
            self._stopped = True
            count, self._idle = self._idle, 0
        for _ in range(count):
            self._jobs.put(None)


class Spare:
    """One thread asleep in ``epoll`` on the connections whose reader is running a call:
    ``ready(fd)`` when a request (or a hang-up) comes on one that is watched."""

    def __init__(self, ready: Callable[[int], None]) -> None:
        self._ready = ready
        self._epoll = select.epoll()
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._epoll.register(self._wake, select.EPOLLIN)
        self._guard = threading.Lock()  # the epoll descriptor: never changed once it is closed
        self._closed = False
        threading.Thread(target=self._run, name="machinlike-lane-spare", daemon=True).start()

    def _ctl(self, change: Callable[[int, int], None], fd: int, events: int) -> None:
        with self._guard:
            if not self._closed:
                change(fd, events)

    def add(self, fd: int) -> None:
        """Know connection ``fd`` (not watched yet)."""
        self._ctl(self._epoll.register, fd, _UNWATCHED)

    def watch(self, fd: int) -> None:
        """Its reader runs a call: a request that comes now wakes the spare (once)."""
        self._ctl(self._epoll.modify, fd, _WATCHED)

    def unwatch(self, fd: int) -> None:
        """Its reader is back (or another reads it)."""
        self._ctl(self._epoll.modify, fd, _UNWATCHED)

    def remove(self, fd: int) -> None:
        """Forget ``fd`` (before it is closed: its number may be reused)."""
        with self._guard:
            if not self._closed:
                self._epoll.unregister(fd)

    def _run(self) -> None:
        while True:
            for fd, _ in self._epoll.poll():
                if fd == self._wake:
                    with self._guard:
                        self._closed = True
                        self._epoll.close()
                        os.close(self._wake)
                    return
                try:
                    self._ready(fd)
                except Exception:  # (a thread that cannot start: the reader still comes back after its call)
                    log.exception("the lane's spare could not hand a connection on")

    def stop(self) -> None:
        """Let the thread end (it closes the descriptors; a connection still read after
        this is simply not watched)."""
        os.eventfd_write(self._wake, 1)

    def forget(self) -> None:
        """In a forked child: drop the parent's descriptors without touching its thread."""
        for close in (self._epoll.close, lambda: os.close(self._wake)):
            try:
                close()
            except OSError:
                pass
