"""The same-host lane: calls between processes of one host over a Unix socket that sleeps.

Why: TensorPipe's shared-memory transport polls its rings, so every idle process that
has it spins, and the idle processes of a host share a core's worth of spinning between
them (2 idle ranks: 100% of a core each on this 2-core box). With TensorPipe on TCP only
an idle process sleeps, but a small call then crosses the loopback through more threads
(about 530 us against 300 us). The lane carries the calls between the processes of one
host instead: its threads sleep in ``recv`` until bytes come, so an idle process costs
nothing, and a small call takes fewer hops than either TensorPipe transport.

    caller (this process)                             callee (a process of this host)
    call(pid, fn, args, timeout)
      Conn to pid, made once: connect ──────────────► Server: accept (same uid only), HELLO
      frame REQ(id, pickle((fn, args)))  ────────────► the connection's reader runs it
                                                        itself (no thread woken; lane_crew):
      a sync call reads its own answer                 fn(*args); an async_execution fn
        (no thread wakes it); the Conn's                 answers when its future completes
        watcher completes an async call's ◄─────────── frame OK(id, pickle(value)) | ERR(id, text)
        torch Future (lane_conn)
      _Expiry thread: an async call's deadline

What the lane does not carry raises :class:`NotForLane` before anything is sent, and the
caller sends that call through torch RPC as before: a peer with no lane (none started,
or another network namespace), a call inside a distributed autograd context (torch RPC
records its gradients' way back), a CUDA tensor, a tensor with autograd history, one larger than
``TENSOR_LIMIT`` (TensorPipe's cma channel moves it with one copy; the shared-memory hook
turns larger ones into small placeholders before they get here), an RRef, anything its
pickler refuses. A call once sent is never sent again: a connection that breaks fails its
pending calls at once, with an "eof" error (the peer died or stopped).

Addresses are abstract Unix sockets named by pid and process start time, so a caller
finds a peer's lane from its pid alone (as ``/proc`` sees it) and a reused pid names a
new address. Abstract sockets live in a network namespace: a peer in another one is
simply not found, and its calls go through torch RPC.
"""

from __future__ import annotations

import heapq
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .lane_conn import Conn, LaneTimeout, Pending
from .lane_future import LaneFuture, completing
from .lane_server import Server, serving
from .lane_wire import HELLO, TENSOR_LIMIT, NotForLane, address, read_frame, request_bytes

__all__ = ["NotForLane", "Lane", "LaneFuture", "TENSOR_LIMIT", "start", "stop", "current", "completing", "serving"]


_CONNECT_S = 2.0  # seconds at most to connect and read a peer's hello (less when the call has less)
_MAX_CONNS = 256  # outgoing connections kept; calls to further peers go through torch RPC


class _Expiry:
    """Fails async calls at their deadlines: one thread, asleep while nothing is pending."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: List[Tuple[float, int, int, Conn, Pending]] = []
        self._seq = 0
        self._stopped = False
        self._thread: Optional[threading.Thread] = None

    def add(self, conn: Conn, cid: int, pending: Pending) -> None:
        if pending.fut is None or pending.fut.done():
            return  # answered while it was being sent: nothing to expire
        with self._cond:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="machinlike-lane-expiry", daemon=True)
                self._thread.start()
            self._seq += 1
            heapq.heappush(self._heap, (pending.deadline, self._seq, cid, conn, pending))
            if len(self._heap) > 4096 and len(self._heap) > 2 * self._live():
                # Answered calls leave their entries until their deadline: shed them now
                # and then, so the heap stays of the order of the calls in flight.
                self._heap = [e for e in self._heap if e[4].fut is not None and not e[4].fut.done()]
                heapq.heapify(self._heap)
            # (the shedding may have emptied the heap: an answer can come at any moment)
            if self._heap and self._heap[0][4] is pending:
                self._cond.notify()

    def _live(self) -> int:
        return sum(1 for e in self._heap if e[4].fut is not None and not e[4].fut.done())

    def _run(self) -> None:
        while True:
            with self._cond:
                if self._stopped:
                    return
                if not self._heap:
                    self._cond.wait()
                    continue
                left = self._heap[0][0] - time.monotonic()
                if left > 0:
                    self._cond.wait(left)
                    continue
                _, _, cid, conn, pending = heapq.heappop(self._heap)
            if pending.fut is not None and not pending.fut.done():
                conn.expire(cid, pending)  # (outside the lock: the future's callbacks run here)

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._heap = []
            self._cond.notify()


class Lane:
    """This process's lane: its server, and its connections to peers' lanes.

    Args:
        threads: Most calls from peers run at once (more wait their turn).
    """

    def __init__(self, threads: int) -> None:
        self._server = Server(threads)
        self._lock = threading.Lock()
        self._conns: Dict[int, Conn] = {}
        self._absent: Dict[int, float] = {}  # pid -> when a connect was refused (retried after a while)
        self._expiry = _Expiry()
        self.calls = 0
        self.not_carried = 0

    # ------------------------------------------------------------------ connections
    def _conn(self, pid: int, deadline: float) -> Conn:
        conn = self._conns.get(pid)
        if conn is not None:
            return conn
        with self._lock:
            conn = self._conns.get(pid)
            if conn is not None:
                return conn
            refused = self._absent.get(pid)
            if refused is not None and time.monotonic() - refused < 10.0:
                raise NotForLane(f"process {pid} has no lane")
            if len(self._conns) >= _MAX_CONNS:
                raise NotForLane(f"{_MAX_CONNS} lanes are open already")
            conn = self._connect(pid, min(_CONNECT_S, deadline - time.monotonic()))
            self._conns[pid] = conn
            return conn

    def _connect(self, pid: int, within: float) -> Conn:
        where = address(pid)
        if where is None:
            raise NotForLane(f"process {pid} is not running here")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(max(0.001, within))
            sock.connect(where)
            frame = read_frame(sock, patient=False)
            if frame is None or frame[0] != HELLO or frame[1] != pid:
                raise ConnectionRefusedError("no hello")
        except (OSError, socket.timeout) as err:
            sock.close()
            if len(self._absent) > 4096:
                self._absent.clear()
            self._absent[pid] = time.monotonic()
            raise NotForLane(f"process {pid} has no lane ({err})") from err
        self._absent.pop(pid, None)
        return Conn(pid, sock, self._gone)

    def _gone(self, conn: Conn) -> None:
        # (called under conn's lock; takes no lock itself: one dict operation, atomic)
        if self._conns.get(conn.pid) is conn:
            self._conns.pop(conn.pid, None)

    # ------------------------------------------------------------------------ calls
    def call_sync(self, pid: int, fn: Callable[..., Any], args: Tuple[Any, ...], timeout: float) -> Any:
        """``fn(*args)`` run by process ``pid``; its value.

        Raises:
            NotForLane: nothing was sent; send it through torch RPC.
            RuntimeError: torch RPC's words for the same failures ("timed out", "eof"),
                so that the caller's translation names the member.
        """
        payload = request_bytes(fn, args)
        deadline = time.monotonic() + timeout
        conn = self._conn(pid, deadline)
        pending = Pending(None, deadline)
        cid = conn.send(payload, pending)
        self.calls += 1
        try:
            return conn.wait(cid, pending)
        except LaneTimeout:
            raise RuntimeError(f"the call to process {pid} timed out after {timeout:g} s") from None

    def call_async(self, pid: int, fn: Callable[..., Any], args: Tuple[Any, ...],
                   timeout: float, into: Optional[LaneFuture] = None) -> LaneFuture:
        """A torch Future of ``fn(*args)`` run by process ``pid`` (failed with a RuntimeError
        at ``timeout`` seconds, as torch RPC's are).

        Args:
            into: The future to complete (its ``complete``), made by the caller; None: a new
                one. Never completed when this raises.

        Raises:
            NotForLane: nothing was sent; send it through torch RPC.
        """
        payload = request_bytes(fn, args)
        deadline = time.monotonic() + timeout
        conn = self._conn(pid, deadline)
        fut = LaneFuture() if into is None else into
        pending = Pending(fut, deadline)
        cid = conn.send(payload, pending)
        self.calls += 1
        self._expiry.add(conn, cid, pending)
        return fut

    def stats(self) -> Dict[str, int]:
        """Calls sent, calls left to torch RPC, open connections, answers after their timeout."""
        conns = list(self._conns.values())
        return {"calls": self.calls, "not_carried": self.not_carried, "connections": len(conns),
                "late": sum(c.late for c in conns)}

    def abandon(self, pid: int, why: str) -> None:
        """Close the connection to process ``pid``, failing the calls pending on it ("closed
        under the call: <why>"): its member was declared lost while its process lives on
        (stopped by a signal, say), which closes no socket by itself."""
        conn = self._conns.get(pid)
        if conn is not None:
            conn.close(why)

    def close(self, drain: float) -> None:
        """Stop serving (running calls get up to ``drain`` seconds) and close every connection."""
        self._server.close(drain)
        with self._lock:
            conns = list(self._conns.values())
        for conn in conns:
            conn.close("this process's lane was shut down")
        self._expiry.stop()

    def forget(self) -> None:
        self._server.forget()
        for conn in list(self._conns.values()):
            conn.forget()


# ---------------------------------------------------------- the process's one lane
_lane: Optional[Lane] = None
_users = 0
_guard = threading.Lock()


def start(threads: int) -> Optional[Lane]:
    """This process's lane, started by its first user (each World); None when it cannot
    listen here (no ``/proc``, no abstract sockets): calls then take torch RPC."""
    global _lane, _users
    with _guard:
        if _lane is None:
            try:
                _lane = Lane(threads)
            except OSError:
                return None
        _users += 1
        return _lane


def stop(drain: float = 5.0) -> None:
    """One user is done; the last closes the lane (see ``Lane.close``)."""
    global _lane, _users
    with _guard:
        if _users == 0:
            return
        _users -= 1
        if _users or _lane is None:
            return
        lane, _lane = _lane, None
    lane.close(drain)


def current() -> Optional[Lane]:
    """The running lane, None when no World of this process started one."""
    return _lane


def _after_fork_in_child() -> None:
    global _lane, _users, _guard
    if _lane is not None:
        _lane.forget()  # (no thread of the parent's runs here: only its sockets came along)
    _lane, _users, _guard = None, 0, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
