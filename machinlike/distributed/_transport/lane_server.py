"""The same-host lane's callee side: this process's listening socket and its calls' runners.

    _Server: accept (same uid only) ─► per connection: HELLO, then a reader thread
        REQ frame ─► _Workers (at most ``threads`` at once): fn(*args) ─► OK | ERR frame
        an ``async_execution`` fn: the frame goes when its future completes

Why threads that block: an idle lane must cost nothing, so every thread here sleeps in
``accept``, ``recv`` or a queue until there is work. Replies leave through a socket object
with a bound (``_REPLY_S``): a caller that stopped reading loses its connection instead of
holding a runner forever.
"""

from __future__ import annotations

import functools
import os
import queue
import socket
import struct
import threading
import time
from typing import Any, Callable, List, Optional, Tuple, Union

import torch

from .lane_wire import ERR, HELLO, IDLE_WAKE_S, OK, REQ, Body, address, load_body, read_frame, reply_bytes, send_frame

__all__ = ["Server"]


_REPLY_S = 60.0  # seconds a reply may take to leave before its connection is given up


class _Workers:
    """Up to ``most`` daemon threads running jobs; a thread starts only when none is free."""

    def __init__(self, most: int) -> None:
        self._most = most
        self._jobs: "queue.SimpleQueue[Optional[Callable[[], None]]]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._threads = 0
        self._idle = 0
        self._queued = 0

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._queued += 1
            grow = self._queued > self._idle and self._threads < self._most
            if grow:
                self._threads += 1
        self._jobs.put(job)
        if grow:
            threading.Thread(target=self._run, name="machinlike-lane-worker", daemon=True).start()

    def _run(self) -> None:
        while True:
            with self._lock:
                self._idle += 1
            job = self._jobs.get()
            with self._lock:
                self._idle -= 1
                self._queued -= 1
            if job is None:
                return
            job()
            job = None  # (its arguments are not kept while the next job is awaited)

    def stop(self) -> None:
        """Let every thread end once the jobs queued before this are done."""
        with self._lock:
            count = self._threads
            self._queued += count
        for _ in range(count):
            self._jobs.put(None)


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
        self._workers = _Workers(threads)
        self._lock = threading.Lock()
        self._conns: List[socket.socket] = []
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
            with self._lock:
                if self._closing:
                    conn.close()
                    return
                self._conns.append(conn)
            threading.Thread(target=self._serve, args=(conn,), name="machinlike-lane-serve", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        # One descriptor: its timeout is only the reader's poll bound; a reply that cannot
        # leave within _REPLY_S (the caller stopped reading) gives the connection up.
        conn.settimeout(IDLE_WAKE_S)
        send_lock = threading.Lock()
        try:
            with send_lock:
                send_frame(conn, HELLO, os.getpid(), b"", time.monotonic() + _REPLY_S)
            while True:
                frame = read_frame(conn)
                if frame is None or frame[0] != REQ:
                    return
                with self._lock:
                    refused = self._closing
                    if not refused:
                        self._running += 1
                if refused:
                    self._answer(conn, send_lock, frame[1], ERR, b"the callee's lane was shut down (its World stopped)")
                    continue
                self._workers.submit(functools.partial(self._run, conn, send_lock, frame[1], frame[2]))
                frame = None  # (its bytes are not kept while the next frame is awaited)
        except OSError:
            return
        finally:
            with self._lock:
                if conn in self._conns:
                    self._conns.remove(conn)
            conn.close()  # (a reply still being made then fails to send: its caller has EOF)

    def _run(self, conn: socket.socket, send_lock: threading.Lock, cid: int, data: Body) -> None:
        try:
            fn, args = load_body(data)
            if getattr(fn, "_wrapped_async_rpc_function", None) is not None:
                fut = fn(*args)
                fut.add_done_callback(lambda done: self._settle(conn, send_lock, cid, done))
                return
            value = fn(*args)
        except BaseException as err:  # the entry points catch the user's errors; this is ours
            self._finish(conn, send_lock, cid, ERR, f"{type(err).__name__}: {err}".encode())
            return
        payload, kind = _payload(value)
        # A reply that failed to pickle releases its lent segments as it dies: before its
        # caller hears of it, which may at once ask what is lent here.
        del value, fn, args
        self._finish(conn, send_lock, cid, kind, payload)

    def _settle(self, conn: socket.socket, send_lock: threading.Lock, cid: int, fut: torch.futures.Future) -> None:
        try:
            value = fut.value()
        except BaseException as err:
            self._finish(conn, send_lock, cid, ERR, f"{type(err).__name__}: {err}".encode())
            return
        payload, kind = _payload(value)
        del value
        self._finish(conn, send_lock, cid, kind, payload)

    def _finish(self, conn: socket.socket, send_lock: threading.Lock, cid: int, kind: int,
                payload: Union[bytes, Body]) -> None:
        try:
            self._answer(conn, send_lock, cid, kind, payload)
        finally:
            with self._lock:
                self._running -= 1
                if self._running == 0:
                    self._idle.notify_all()

    @staticmethod
    def _answer(conn: socket.socket, send_lock: threading.Lock, cid: int, kind: int,
                payload: Union[bytes, Body]) -> None:
        try:
            with send_lock:
                send_frame(conn, kind, cid, payload, time.monotonic() + _REPLY_S)
        except OSError:
            # The caller is gone (its side failed the call already), or stopped reading:
            # part of a frame may be out, so the connection goes.
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self, drain: float) -> None:
        """Refuse new calls, let running ones answer for up to ``drain`` seconds, then close."""
        with self._lock:
            self._closing = True
            deadline = time.monotonic() + drain
            while self._running and time.monotonic() < deadline:
                self._idle.wait(max(0.0, deadline - time.monotonic()))
            conns = list(self._conns)
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._sock.close()
        for conn in conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)  # its reader sees EOF and closes it
            except OSError:
                pass
        self._workers.stop()
        self._thread.join(5.0)

    def forget(self) -> None:
        """In a forked child: drop the parent's sockets without touching its threads."""
        for sock in [self._sock] + self._conns:
            try:
                sock.close()
            except OSError:
                pass


