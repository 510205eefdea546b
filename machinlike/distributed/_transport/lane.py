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
      _Conn to pid, made once: connect ──────────────► Server: accept (same uid only), HELLO
      frame REQ(id, pickle((fn, args)))  ────────────► its reader thread per connection
                                                        hands the frame to _Workers:
      _Conn's reader thread: id ─► _Pending             fn(*args); an async_execution fn
        wakes the caller, or completes the               answers when its future completes
        torch Future of an async call   ◄───────────── frame OK(id, pickle(value)) | ERR(id, text)
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

from .lane_future import LaneFuture, completing
from .lane_server import Server
from .lane_wire import (
    HELLO, IDLE_WAKE_S, OK, REQ, TENSOR_LIMIT, Body, NotForLane, address, drop_late, load_body, read_frame,
    request_bytes, send_frame,
)

__all__ = ["NotForLane", "Lane", "LaneFuture", "TENSOR_LIMIT", "start", "stop", "current", "completing"]


_CONNECT_S = 2.0  # seconds at most to connect and read a peer's hello (less when the call has less)
_MAX_CONNS = 256  # outgoing connections kept; calls to further peers go through torch RPC


class _Pending:
    """One sent call: a waiting caller's event, or an async call's torch Future."""

    __slots__ = ("event", "fut", "value", "error", "deadline")

    def __init__(self, fut: Optional[LaneFuture], deadline: float) -> None:
        self.event = None if fut is not None else threading.Event()
        self.fut = fut
        self.value: Any = None
        self.error: Optional[BaseException] = None
        self.deadline = deadline

    def complete(self, value: Any, error: Optional[BaseException]) -> None:
        fut = self.fut
        if fut is not None:
            # Answered: the expiry heap keeps this entry until its deadline, not the future
            # (nor what it holds: an RpcFuture's retry holds the call's arguments).
            self.fut = None
            fut.complete(value, error)
            return
        self.value, self.error = value, error
        self.event.set()  # type: ignore[union-attr]  # (a sync call's)


class _Conn:
    """One connection to a peer's lane: sends calls, and its reader thread answers them."""

    def __init__(self, pid: int, sock: socket.socket, gone: Callable[["_Conn"], None]) -> None:
        self.pid = pid
        self._sock = sock  # one descriptor: its reader polls, each send waits on its call's deadline
        sock.settimeout(IDLE_WAKE_S)
        self._gone = gone
        self._lock = threading.Lock()  # the pending calls and the state
        self._send_lock = threading.Lock()  # one frame at a time
        self._pending: Dict[int, _Pending] = {}
        self._next = 0
        self.closed: Optional[str] = None
        self.late = 0  # answers that came after their call had timed out
        threading.Thread(target=self._read, name=f"machinlike-lane-{pid}", daemon=True).start()

    def send(self, payload: Body, pending: _Pending) -> int:
        """Send one call; its id. Raises NotForLane when the connection is closed (nothing sent)."""
        with self._lock:
            if self.closed is not None:
                raise NotForLane(f"the lane to process {self.pid} closed")
            self._next += 1
            cid = self._next
            self._pending[cid] = pending  # before sending: the answer may come at once
        left = pending.deadline - time.monotonic()
        if not self._send_lock.acquire(timeout=max(0.0, left)):
            self.drop(cid)
            raise RuntimeError(f"the call to process {self.pid} timed out waiting to be sent")
        try:
            send_frame(self._sock, REQ, cid, payload, pending.deadline)
        except OSError as err:
            # Part of a frame may be out: the stream is no longer framed, so the
            # connection goes, and with it every call pending on it.
            with self._lock:
                self._pending.pop(cid, None)
                failed = self._close_locked(f"send failed: {err}")
            self._fail(failed)
            # The two causes must read apart: translate_error names a timeout by its words,
            # and a peer that died (EPIPE, ECONNRESET) by "eof" (a PeerLostError).
            if isinstance(err, socket.timeout):
                raise RuntimeError(f"the call to process {self.pid} timed out while being sent") from err
            raise RuntimeError(f"the lane to process {self.pid} closed while sending a call: eof ({err})") from err
        finally:
            self._send_lock.release()
        return cid

    def drop(self, cid: int) -> None:
        """Forget call ``cid`` (it timed out); an answer that comes later is counted as late."""
        with self._lock:
            self._pending.pop(cid, None)

    def _read(self) -> None:
        why = "eof"
        try:
            while True:
                frame = read_frame(self._sock)
                if frame is None:
                    break
                kind, cid, body = frame
                with self._lock:
                    pending = self._pending.pop(cid, None)
                    if pending is None:
                        self.late += 1
                if pending is None:
                    if kind == OK:
                        drop_late(body)
                    continue
                if kind == OK:
                    try:
                        value, error = load_body(body), None
                    except Exception as err:
                        value, error = None, RuntimeError(f"the reply from process {self.pid} could not be "
                                                          f"unpickled: {type(err).__name__}: {err}")
                else:
                    value, error = None, RuntimeError(f"process {self.pid} failed the call: {body.data.decode()}")
                pending.complete(value, error)
                # Not kept while the next frame is awaited: the caller may have dropped the
                # value already, and its tensors may hold a sender's lent segment.
                frame = body = value = pending = None  # type: ignore[assignment]
        except OSError as err:
            why = f"eof ({err})"
        with self._lock:
            failed = self._close_locked(why)
        self._fail(failed)
        # This thread is the descriptor's last user: no send starts once the connection is
        # closed, and one under way fails at once on the shut-down socket. Closing waits for
        # it (the send lock), so a descriptor is never closed under a write.
        with self._send_lock:
            self._sock.close()

    def _close_locked(self, why: str) -> List[_Pending]:
        """Mark the connection closed and take its pending calls (under the lock); the
        caller fails them once it let go of the lock (see ``_fail``)."""
        if self.closed is None:
            self.closed = why
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        failed, self._pending = self._pending, {}
        self._gone(self)
        return list(failed.values())

    def _fail(self, failed: List[_Pending]) -> None:
        # Outside the lock: an async call's future runs its callbacks here, and one may
        # call through this connection again.
        for pending in failed:
            pending.complete(None, RuntimeError(f"the lane to process {self.pid} closed under the call: "
                                                f"{self.closed} (the process died or its World stopped)"))

    def close(self, why: str) -> None:
        with self._lock:
            failed = self._close_locked(why)
        self._fail(failed)
        self._sock.close()

    def expire(self, cid: int, pending: _Pending) -> None:
        with self._lock:
            if self._pending.get(cid) is not pending:
                return
            del self._pending[cid]
        pending.complete(None, RuntimeError(f"the call to process {self.pid} timed out"))

    def forget(self) -> None:
        try:
            self._sock.close()
        except OSError:
            pass


class _Expiry:
    """Fails async calls at their deadlines: one thread, asleep while nothing is pending."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._heap: List[Tuple[float, int, int, _Conn, _Pending]] = []
        self._seq = 0
        self._stopped = False
        self._thread: Optional[threading.Thread] = None

    def add(self, conn: _Conn, cid: int, pending: _Pending) -> None:
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
        self._conns: Dict[int, _Conn] = {}
        self._absent: Dict[int, float] = {}  # pid -> when a connect was refused (retried after a while)
        self._expiry = _Expiry()
        self.calls = 0
        self.not_carried = 0

    # ------------------------------------------------------------------ connections
    def _conn(self, pid: int, deadline: float) -> _Conn:
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

    def _connect(self, pid: int, within: float) -> _Conn:
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
        return _Conn(pid, sock, self._gone)

    def _gone(self, conn: _Conn) -> None:
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
        pending = _Pending(None, deadline)
        cid = conn.send(payload, pending)
        self.calls += 1
        if not pending.event.wait(max(0.0, pending.deadline - time.monotonic())):  # type: ignore[union-attr]
            conn.drop(cid)
            if not pending.event.is_set():  # type: ignore[union-attr]
                raise RuntimeError(f"the call to process {pid} timed out after {timeout:g} s")
        if pending.error is not None:
            raise pending.error
        return pending.value

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
        pending = _Pending(fut, deadline)
        cid = conn.send(payload, pending)
        self.calls += 1
        self._expiry.add(conn, cid, pending)
        return fut

    def stats(self) -> Dict[str, int]:
        """Calls sent, calls left to torch RPC, open connections, answers after their timeout."""
        conns = list(self._conns.values())
        return {"calls": self.calls, "not_carried": self.not_carried, "connections": len(conns),
                "late": sum(c.late for c in conns)}

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
