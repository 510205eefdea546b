"""One connection from this process to a peer's lane: its calls, and who reads their answers.

Why a caller reads its own answer: when a thread of the connection read every answer and
woke the waiting caller, each call paid a wake-up between threads (28 us of a 180 us
round trip on the 2-core box, 110-130 us on a GPU host's VM: BENCHMARKS.md, session 44).
The caller is awake and waiting anyway, so it reads the socket itself whenever no other
thread does; the connection's own thread sleeps through the answers it need not read::

    a sync call (caller's thread)                 the watcher (one thread per connection)
      send REQ                                      sleeps in poll on the peer's hang-up and
      take the read role if free, else wait:        its wake-up descriptor, not on answers
        another holder may read our answer
      read frames until our answer came:            takes the role itself while answers are
        another sync call's: set in its Pending       due that no caller waits for (async
          (its owner unpickles it, in its thread)     calls, calls given up): completes the
        an async call's, a late one: handed to        futures (their callbacks run here), drops
          the watcher (callbacks never run in a       late answers (their lent segments go
          caller's thread)                            back)
      let the role go (wake the watcher if due)     the peer hung up: reads to the end, closes
      unpickle our answer

A frame may be read in pieces by several holders in turn (``FrameReader`` keeps what came),
so a caller whose deadline passes in the middle of a frame lets go and the next holder goes
on. The watcher is the descriptor's last user: it closes it once the connection closed and
nobody holds the role.
"""

from __future__ import annotations

import os
import select
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

from .lane_frames import FrameReader
from .lane_future import LaneFuture
from .lane_wire import IDLE_WAKE_S, OK, REQ, Body, NotForLane, drop_late, load_body, send_frame

__all__ = ["Pending", "Conn", "LaneTimeout"]


_HUNG_UP = select.POLLRDHUP | select.POLLHUP | select.POLLERR | select.POLLNVAL


class LaneTimeout(RuntimeError):
    """A sync call's answer did not come by its deadline (the call was given up)."""


class Pending:
    """One sent call: a sync call's answer (its frame, or its error) or an async call's future."""

    __slots__ = ("fut", "deadline", "answer", "error")

    def __init__(self, fut: Optional[LaneFuture], deadline: float) -> None:
        self.fut = fut
        self.deadline = deadline  # time.monotonic()
        self.answer: Optional[Tuple[int, Body]] = None  # (kind, body) of a sync call's answer, once read
        self.error: Optional[BaseException] = None

    @property
    def done(self) -> bool:
        return self.answer is not None or self.error is not None

    def complete(self, value: Any, error: Optional[BaseException]) -> None:
        """Complete an async call's future (once; a later call does nothing)."""
        fut = self.fut
        if fut is not None:
            # Answered: the expiry heap keeps this entry until its deadline, not the future
            # (nor what it holds: an RpcFuture's retry holds the call's arguments).
            self.fut = None
            fut.complete(value, error)


class Conn:
    """One connection to a peer's lane: sends calls; their callers and its watcher read the
    answers (see the module doc)."""

    def __init__(self, pid: int, sock: socket.socket, gone: Callable[["Conn"], None]) -> None:
        self.pid = pid
        self._sock = sock
        sock.settimeout(0.0)  # non-blocking: readers and senders each poll on their own deadlines
        self._gone = gone
        self._lock = threading.Lock()  # the pending calls and the state
        self._cv = threading.Condition(self._lock)  # an answer came, the read role was let go
        self._waiters = 0  # threads waiting on it (a notify with none costs a microsecond)
        self._send_lock = threading.Lock()  # one frame at a time
        self._pending: Dict[int, Pending] = {}
        self._next = 0
        self.closed: Optional[str] = None
        self.late = 0  # answers that came after their call had timed out
        self._frames = FrameReader(sock)
        self._reading = False  # a thread holds the read role: it alone takes bytes from the socket
        self._due = 0  # frames to come that no waiting caller reads for itself (async calls, given-up calls)
        self._handed: List[Tuple[Optional[Pending], int, Body]] = []  # such frames a caller read
        self._hung_up = False  # the watcher saw the peer hang up: it reads to the end
        self._asleep = False  # the watcher sleeps in poll (its wake-up descriptor wakes it)
        # The watcher's own choice: it also wakes for answers while idle (async answers came
        # last), or not (a caller read its own last: no answer of a sync call wakes it).
        self._answers = False
        self._wake = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        threading.Thread(target=self._watch, name=f"machinlike-lane-{pid}", daemon=True).start()

    # ------------------------------------------------------------------ sending
    def send(self, payload: Body, pending: Pending) -> int:
        """Send one call; its id. Raises NotForLane when the connection is closed (nothing sent)."""
        with self._lock:
            if self.closed is not None:
                raise NotForLane(f"the lane to process {self.pid} closed")
            self._next += 1
            cid = self._next
            self._pending[cid] = pending  # before sending: the answer may come at once
            if pending.fut is not None:
                self._due += 1
                self._wake_locked()
        left = pending.deadline - time.monotonic()
        if not self._send_lock.acquire(timeout=max(0.0, left)):
            self._unsend(cid)
            raise RuntimeError(f"the call to process {self.pid} timed out waiting to be sent")
        try:
            send_frame(self._sock, REQ, cid, payload, pending.deadline)
        except OSError as err:
            # Part of a frame may be out: the stream is no longer framed, so the
            # connection goes, and with it every call pending on it.
            self._unsend(cid)
            self._end(f"send failed: {err}")
            # The two causes must read apart: translate_error names a timeout by its words,
            # and a peer that died (EPIPE, ECONNRESET) by "eof" (a PeerLostError).
            if isinstance(err, socket.timeout):
                raise RuntimeError(f"the call to process {self.pid} timed out while being sent") from err
            raise RuntimeError(f"the lane to process {self.pid} closed while sending a call: eof ({err})") from err
        finally:
            self._send_lock.release()
        return cid

    def _unsend(self, cid: int) -> None:
        """Forget call ``cid``, which was not (wholly) sent: no answer is due for it."""
        with self._lock:
            pending = self._pending.pop(cid, None)
            if pending is not None and pending.fut is not None:
                self._due -= 1

    # ---------------------------------------------------------------- answers
    def wait(self, cid: int, pending: Pending) -> Any:
        """Sync call ``cid``'s value, by ``pending.deadline``; this thread reads the socket
        itself while no other thread does.

        Raises:
            LaneTimeout: no answer by the deadline (the call is given up; a later answer
                is dropped).
            RuntimeError: the callee failed the call, or the connection closed under it.
        """
        while True:
            with self._lock:
                while not pending.done:
                    left = pending.deadline - time.monotonic()
                    if left <= 0:
                        if self._pending.pop(cid, None) is not None:
                            self._due += 1  # its answer may still come: the watcher drops it
                            self._wake_locked()
                        if not pending.done:
                            raise LaneTimeout(f"the call to process {self.pid} timed out")
                        break
                    if not self._reading:
                        self._reading = True
                        break
                    self._wait_locked(left)
                if pending.done:
                    break
            try:
                self._read_for(pending)
                self._deliver_ahead(watcher=False)
            finally:
                with self._lock:
                    self._reading = False
                    if self._due or self._handed:
                        self._wake_locked(always=bool(self._handed))
                    self._notify_locked()
        if pending.error is not None:
            raise pending.error
        value, error = self._value(*pending.answer)  # type: ignore[misc]
        if error is not None:
            raise error
        return value

    def _read_for(self, pending: Pending) -> None:
        """Holding the read role: deliver frames until ``pending`` is answered or out of time."""
        while not pending.done:
            left = pending.deadline - time.monotonic()
            if left <= 0:
                return
            try:
                frame = self._frames.read(left)
            except (EOFError, OSError) as err:
                self._end("eof" if isinstance(err, EOFError) else f"eof ({err})")
                return
            if frame is None:
                return
            self._deliver(frame, watcher=False)

    def _deliver_ahead(self, watcher: bool) -> None:
        """Before the read role is let go: deliver every whole frame read ahead (nobody
        polls for bytes that already left the socket)."""
        while self.closed is None:
            frame = self._frames.take()
            if frame is None:
                return
            self._deliver(frame, watcher)

    def _deliver(self, frame: Tuple[int, int, Body], watcher: bool) -> None:
        kind, cid, body = frame
        with self._lock:
            pending = self._pending.pop(cid, None)
            if pending is not None and pending.fut is None:
                pending.answer = (kind, body)
                self._notify_locked()
                return
            if self._due:
                self._due -= 1
            if pending is None:
                self.late += 1
            if not watcher:
                self._handed.append((pending, kind, body))
                self._wake_locked(always=True)
                return
        self._settle(pending, kind, body)

    def _settle(self, pending: Optional[Pending], kind: int, body: Body) -> None:
        """In the watcher: complete an async call's future, or drop a late answer."""
        if pending is None:
            if kind == OK:
                drop_late(body)
            return
        pending.complete(*self._value(kind, body))

    def _value(self, kind: int, body: Body) -> Tuple[Any, Optional[BaseException]]:
        if kind != OK:
            return None, RuntimeError(f"process {self.pid} failed the call: {bytes(body.data).decode()}")
        try:
            return load_body(body), None
        except Exception as err:
            return None, RuntimeError(f"the reply from process {self.pid} could not be unpickled: "
                                      f"{type(err).__name__}: {err}")

    def expire(self, cid: int, pending: Pending) -> None:
        """Fail async call ``cid`` at its deadline (its answer, if it comes, is dropped)."""
        with self._lock:
            if self._pending.get(cid) is not pending:
                return
            del self._pending[cid]
        pending.complete(None, RuntimeError(f"the call to process {self.pid} timed out"))

    def _wait_locked(self, timeout: Optional[float]) -> None:
        self._waiters += 1
        try:
            self._cv.wait(timeout)
        finally:
            self._waiters -= 1

    def _notify_locked(self) -> None:
        if self._waiters:
            self._cv.notify_all()

    # --------------------------------------------------------------- the watcher
    def _wake_locked(self, always: bool = False) -> None:
        """Wake the watcher if it sleeps: for answers due only when it sleeps through answers
        (an answer wakes it otherwise); ``always`` for frames handed to it, and closing."""
        if self._asleep and (always or not self._answers):
            self._asleep = False
            os.eventfd_write(self._wake, 1)

    def _watch(self) -> None:
        fd = self._sock.fileno()
        poller = select.poll()
        poller.register(self._wake, select.POLLIN)
        poller.register(fd, select.POLLRDHUP)
        polled = select.POLLRDHUP
        try:
            while True:
                with self._lock:
                    while self._hung_up and self._reading and self.closed is None:
                        self._wait_locked(None)  # a caller reads: it meets the end itself, or lets go
                    handed, self._handed = self._handed, []
                    if self.closed is not None and not handed:
                        return
                    read = (self._due > 0 or self._hung_up) and not self._reading and self.closed is None
                    self._reading = self._reading or read
                    answers = self._answers and not read
                    self._asleep = not read and self.closed is None
                for entry in handed:
                    self._settle(*entry)
                handed = entry = None  # type: ignore[assignment]  # (what they hold is not kept meanwhile)
                if read:
                    self._read_while_due(first=False)
                    with self._lock:
                        self._answers = True  # async answers came: wait for the next ones too
                    continue
                if self.closed is not None:
                    continue
                mask = select.POLLIN | select.POLLRDHUP if answers else select.POLLRDHUP
                if mask != polled:
                    poller.register(fd, mask)
                    polled = mask
                events = dict(poller.poll(IDLE_WAKE_S * 1000))
                if events.get(self._wake):
                    try:
                        os.eventfd_read(self._wake)
                    except BlockingIOError:
                        pass
                got = events.get(fd, 0)
                if got & _HUNG_UP:
                    with self._lock:
                        self._hung_up = True
                elif got:
                    with self._lock:
                        take = not self._reading
                        self._reading = True
                        # A caller reads its own answers: sleep through them from now on; and
                        # so when none is due to this thread (a sync call's, its caller late).
                        self._answers = take and self._due > 0
                        # (frames a caller handed over before it let go: settled before any
                        # read, which may wait for the next frame)
                        handed, self._handed = (self._handed, []) if take else ([], self._handed)
                    for entry in handed:
                        self._settle(*entry)
                    handed = entry = None  # type: ignore[assignment]
                    if take:  # an answer whose caller does not read (yet): read it here
                        self._read_while_due(first=True)
        except BaseException as err:  # (a bug here must not leave calls waiting out their timeouts)
            self._end(f"the lane's watcher failed: {type(err).__name__}: {err}")
            raise
        finally:
            with self._lock:
                while self._reading:
                    self._wait_locked(None)
            # No thread uses the descriptor now: no send starts once the connection is
            # closed, and one under way fails at once on the shut-down socket; closing
            # waits for it (the send lock), so a descriptor is never closed under a write.
            with self._send_lock:
                self._sock.close()
            os.close(self._wake)

    def _read_while_due(self, first: bool) -> None:
        """The watcher, holding the read role: deliver frames while answers are due that no
        caller waits for (a sync caller meanwhile gets its answer from here, as it waits),
        or to the end once the peer hung up; ``first``: a frame is there (poll said so),
        unless a caller read it meanwhile (then this reads nothing). Closing shuts the
        socket: the read ends."""
        try:
            while (first or self._due or self._hung_up) and self.closed is None:
                frame = self._frames.read(0.0 if first else IDLE_WAKE_S)
                if frame is None and first:
                    break  # a caller read it, or it is not whole yet (the next poll wakes for the rest)
                if frame is not None:
                    self._deliver(frame, watcher=True)
                first = False
                frame = None
            self._deliver_ahead(watcher=True)
        except (EOFError, OSError) as err:
            self._end("eof" if isinstance(err, EOFError) else f"eof ({err})")
        finally:
            with self._lock:
                self._reading = False
                self._notify_locked()

    # ---------------------------------------------------------------- closing
    def _end(self, why: str) -> None:
        with self._lock:
            failed = self._close_locked(why)
        self._fail(failed)

    def _close_locked(self, why: str) -> List[Pending]:
        """Mark the connection closed and fail its pending calls: sync ones here (under the
        lock), async ones returned, for ``_fail`` once the lock is let go."""
        if self.closed is None:
            self.closed = why
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._wake_locked(always=True)
        failed, self._pending = self._pending, {}
        self._gone(self)
        error = self._closed_error()
        for pending in failed.values():
            if pending.fut is None:
                pending.error = error
        self._notify_locked()
        return [p for p in failed.values() if p.fut is not None]

    def _closed_error(self) -> RuntimeError:
        return RuntimeError(f"the lane to process {self.pid} closed under the call: {self.closed} "
                            f"(the process died or its World stopped)")

    def _fail(self, failed: List[Pending]) -> None:
        # Outside the lock: an async call's future runs its callbacks here, and one may
        # call through this connection again.
        for pending in failed:
            pending.complete(None, self._closed_error())

    def close(self, why: str) -> None:
        """Close: every pending call fails; the watcher closes the descriptor."""
        self._end(why)

    def forget(self) -> None:
        """In a forked child: drop the parent's descriptors without touching its threads."""
        for close in (self._sock.close, lambda: os.close(self._wake)):
            try:
                close()
            except OSError:
                pass
