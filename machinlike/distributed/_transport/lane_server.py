"""The same-host lane's callee side: this process's listening socket and its calls' runners.

    Server: accept (same uid only) ─► a _Link: HELLO, then one thread of the Crew reads it
      REQ frame ─► fn(*args), mostly in the thread that read it (see ``lane_crew``)
        ─► OK | ERR frame (an ``async_execution`` fn: the frame goes when its future completes)

Why threads that block: an idle lane must cost nothing, so every thread here sleeps in
``accept``, ``poll``, ``epoll`` or a queue until there is work. Replies leave through a
socket object with a bound (``_REPLY_S``): a caller that stopped reading loses its
connection instead of holding a runner forever.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
import threading
import time
from typing import Any, Dict, Tuple, Union

import torch

from .lane_crew import Crew, Spare
from .lane_frames import FrameReader
from .lane_wire import ERR, HELLO, IDLE_WAKE_S, OK, REQ, Body, address, load_body, reply_bytes, send_frame

__all__ = ["Server", "serving"]


_REPLY_S = 60.0  # seconds a reply may take to leave before its connection is given up


_serving = threading.local()  # .lane: this thread runs a call the lane carried


def serving() -> bool:
    """Whether this thread runs a call the lane carried. Its reply goes back through the
    lane, whose caller loads a late one and drops it, so what it lends comes back without
    being abandoned (``_shm._segments.lending_until``)."""
    return getattr(_serving, "lane", False)


class _Link:
    """One accepted connection: its socket, its frames (read by one thread at a time: the
    one ``reading``), the lock its replies take turns on."""

    __slots__ = ("sock", "fd", "frames", "send_lock", "lock", "reading", "closed", "busy")

    def __init__(self, sock: socket.socket) -> None:
        # Non-blocking: the reader polls, and a reply that cannot leave within _REPLY_S
        # (the caller stopped reading) gives the connection up.
        sock.settimeout(0.0)
        self.sock = sock
        self.fd = sock.fileno()
        self.frames = FrameReader(sock)
        self.send_lock = threading.Lock()
        self.lock = threading.Lock()  # reading, closed, and the spare's watch of fd
        self.reading = True  # a thread reads it (False: its reader runs a call, the spare watches)
        self.closed = False
        self.busy = 0  # its calls read and not answered yet


def _payload(value: Any) -> Tuple[Union[bytes, Body], int]:
    """The reply frame's body and kind for ``value``: OK, or ERR saying it did not pickle."""
    try:
        return reply_bytes(value), OK
    except Exception as err:
        return f"the reply could not be pickled: {type(err).__name__}: {err}".encode(), ERR


class Server:
    """This process's listening end: accepts same-uid peers and serves their calls."""

    def __init__(self, threads: int) -> None:
        where = address(os.getpid())
        if where is None:
            raise OSError("/proc/self/stat is not readable")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(where)
        self._sock.listen(128)
        self._crew = Crew(threads)
        self._spare = Spare(self._woken)
        self._lock = threading.Lock()
        self._links: Dict[int, _Link] = {}
        self._closing = False
        self._running = 0  # calls being run
        self._idle = threading.Condition(self._lock)
        self._thread = threading.Thread(target=self._accept, name="machinlike-lane-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        uid = os.getuid()
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed (stop)
            cred = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            if struct.unpack("3i", cred)[1] != uid:
                conn.close()  # another user's process: it may not run code here
                continue
            link = _Link(conn)
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                self._links[link.fd] = link
            self._spare.add(link.fd)
            self._crew.start(functools.partial(self._greet, link))

    def _greet(self, link: _Link) -> None:
        try:
            with link.send_lock:
                send_frame(link.sock, HELLO, os.getpid(), b"", time.monotonic() + _REPLY_S)
        except OSError:
            self._drop(link)
            return
        self._serve(link)

    def _serve(self, link: _Link) -> None:
        """Holding ``link``'s reading: read its calls, and run each here when nothing else
        waits to be read (see ``lane_crew``); return once another thread reads it."""
        while True:
            try:
                frame = link.frames.read(IDLE_WAKE_S)
            except (EOFError, OSError):
                self._drop(link)
                return
            if frame is None:
                continue  # (an idle connection's hourly wake)
            if frame[0] != REQ:
                self._drop(link)
                return
            with self._lock:
                refused = self._closing
                if not refused:
                    self._running += 1
            if refused:
                self._answer(link, frame[1], ERR, b"the callee's lane was shut down (its World stopped)")
                frame = None
                continue
            with link.lock:
                link.busy += 1
                alone = link.busy == 1
            if not alone or link.frames.ahead or not self._crew.take_slot():
                # Calls overlap on this connection (async ones, a caller's several threads),
                # or every slot is taken: the call runs on a thread of the crew (once a slot
                # is free), and this one reads on, as they come.
                self._crew.submit(functools.partial(self._run, link, frame[1], frame[2]))
                frame = None  # (its bytes, perhaps lent segments, are not kept while the next is awaited)
                continue
            call = functools.partial(self._run, link, frame[1], frame[2])
            frame = None
            with link.lock:  # (only the reader drops a link: it is open)
                link.reading = False  # (first: a request the watch reports must find it unread)
                self._spare.watch(link.fd)
            self._crew.run_one(call)
            del call  # (its request is not kept while the next is awaited)
            with link.lock:
                if link.reading or link.closed:
                    return  # a request came meanwhile: another thread reads it now
                link.reading = True
                self._spare.unwatch(link.fd)

    def _woken(self, fd: int) -> None:
        """The spare: a request (or a hang-up) came while ``fd``'s reader runs a call."""
        link = self._links.get(fd)
        if link is None:
            return
        with link.lock:
            if link.reading or link.closed:
                return
            link.reading = True
        self._crew.start(functools.partial(self._serve, link))

    def _drop(self, link: _Link) -> None:
        """The reader is done with ``link``: close it (a reply still being made then fails to
        send; its caller has EOF)."""
        with self._lock:
            if self._links.get(link.fd) is link:
                del self._links[link.fd]
        with link.lock:
            link.closed = True
            self._spare.remove(link.fd)  # (before the descriptor's number can be reused)
        try:
            link.sock.shutdown(socket.SHUT_RDWR)  # (a reply under way fails at once...)
        except OSError:
            pass
        with link.send_lock:  # (...and the descriptor is never closed under a write)
            link.sock.close()

    def _run(self, link: _Link, cid: int, data: Body) -> None:
        try:
            fn, args = load_body(data)
            if getattr(fn, "_wrapped_async_rpc_function", None) is not None:
                fut = fn(*args)
                fut.add_done_callback(lambda done: self._settle(link, cid, done))
                return
            _serving.lane = True
            try:
                value = fn(*args)
            finally:
                _serving.lane = False
        except BaseException as err:  # the entry points catch the user's errors; this is ours
            self._finish(link, cid, ERR, f"{type(err).__name__}: {err}".encode())
            return
        payload, kind = _payload(value)
        # A reply that failed to pickle releases its lent segments as it dies: before its
        # caller hears of it, which may at once ask what is lent here.
        del value, fn, args
        self._finish(link, cid, kind, payload)

    def _settle(self, link: _Link, cid: int, fut: torch.futures.Future) -> None:
        try:
            value = fut.value()
        except BaseException as err:
            self._finish(link, cid, ERR, f"{type(err).__name__}: {err}".encode())
            return
        payload, kind = _payload(value)
        del value
        self._finish(link, cid, kind, payload)

    def _finish(self, link: _Link, cid: int, kind: int, payload: Union[bytes, Body]) -> None:
        # Answered before the reply leaves: the caller's next request, which may come the
        # moment it is out, finds none of its calls running (it runs in the thread that
        # reads it, even when the spare had to give it one).
        with link.lock:
            link.busy -= 1
        try:
            self._answer(link, cid, kind, payload)
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self._idle.notify_all()

    @staticmethod
    def _answer(link: _Link, cid: int, kind: int, payload: Union[bytes, Body]) -> None:
        try:
            with link.send_lock:
                send_frame(link.sock, kind, cid, payload, time.monotonic() + _REPLY_S)
        except OSError:
            # The caller is gone (its side failed the call already), or stopped reading:
            # part of a frame may be out, so the connection goes.
            try:
                link.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self, drain: float) -> None:
        """Refuse new calls, let running ones answer for up to ``drain`` seconds, then close."""
        with self._lock:
            self._closing = True
            deadline = time.monotonic() + drain
            while self._running and time.monotonic() < deadline:
                self._idle.wait(max(0.0, deadline - time.monotonic()))
            links = list(self._links.values())
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._sock.close()
        for link in links:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)  # its reader sees EOF and closes it
            except OSError:
                pass
        self._crew.stop()
        self._spare.stop()
        self._thread.join(5.0)

    def forget(self) -> None:
        """In a forked child: drop the parent's sockets without touching its threads."""
        for sock in [self._sock] + [link.sock for link in self._links.values()]:
            try:
                sock.close()
            except OSError:
                pass
        self._spare.forget()


