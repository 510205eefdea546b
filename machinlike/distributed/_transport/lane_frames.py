"""A connection's frames, read ahead in bursts and in pieces, by one reader after another
(see ``lane_conn`` and ``lane_server``).

Why read ahead: answers to pipelined calls (and requests of a busy caller) come several
to a burst; reading each frame part by part cost a system call per part (and, on a
socket with a timeout, a poll before each). A read asks for up to ``_CHUNK`` bytes, and
the small parts of every frame in them are taken from that buffer. A part still missing
``_DIRECT`` bytes or more (a tensor's buffer) is read straight into its own bytearray, as
before: large bytes are never copied twice.

Why in pieces: a sync caller reads its own answer, up to its deadline. A frame may be only
partly there when that deadline passes (a large answer, a peer that stalls); the caller
cannot take the bytes with it (the stream would lose its framing) nor wait on. So what
came of a frame stays here, and whoever reads next (another caller, or the connection's
watcher) goes on from there::

    | header | sizes | pickle | buffer 0 | buffer 1 | ...      (lane_wire's frame)
      part 0   part 1   part 2   parts 3.. (a part per buffer, each its own bytearray)

    socket ─► read-ahead buffer (_CHUNK) ─► small parts (copied out)
          └─────────────────────────────► a large part's rest (read into it directly)

A reader that lets go must first ``take`` every whole frame read ahead: nobody polls for
bytes that already left the socket.
"""

from __future__ import annotations

import select
import socket
import struct
import time
from typing import List, Optional, Tuple

from .lane_wire import Body

__all__ = ["FrameReader"]


_HEADER = struct.Struct("<IQBH")  # (lane_wire's frame header: payload bytes, call id, kind, buffers)
_SIZE = struct.Struct("<Q")
_CHUNK = 1 << 16  # bytes one read asks for
_DIRECT = 1 << 14  # a part missing this many bytes or more is read into itself, not through the buffer


class FrameReader:
    """A connection's frames, read ahead and in pieces: a reader that stops at its deadline
    leaves what came of a frame here, and the next reader goes on from there (one at a
    time)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock  # non-blocking (timeout 0)
        self._poll = select.poll()
        self._poll.register(sock.fileno(), select.POLLIN)  # (hang-ups and errors are always reported)
        self._buf = bytearray(_CHUNK)
        self._view = memoryview(self._buf)
        self._lo = 0  # the first byte read ahead and not yet taken
        self._hi = 0  # the end of the bytes read ahead
        self._restart()

    def _restart(self) -> None:
        self._parts: List[bytearray] = [bytearray(_HEADER.size)]  # what the frame is read into, in order
        self._at = 0  # the part being filled
        self._got = 0  # its bytes filled
        # 0: the header; 1: the buffers' sizes; 2: the pickle (no buffers); 3: the pickle and the buffers
        self._stage = 0
        self._head = (0, 0, 0)  # (call id, kind, pickle bytes)

    @property
    def ahead(self) -> bool:
        """Bytes were read ahead that no frame has taken yet."""
        return self._lo != self._hi

    def read(self, timeout: float) -> Optional[Tuple[int, int, Body]]:
        """``(kind, call id, body)`` of the next frame; None when it is not whole within
        ``timeout`` seconds (what came is kept for the next read).

        Raises:
            EOFError: the peer closed the connection (inside a frame too).
            OSError: the connection broke.
        """
        # A frame's first bytes are polled for (a failed read costs an exception: 2 us a
        # frame while answers trickle in); the rest is read as it comes, polled for only
        # when it has not come yet.
        if (self._at == 0 and self._got == 0 and self._lo == self._hi
                and not self._poll.poll(timeout * 1000)):
            return None
        return self._fill(time.monotonic() + timeout)

    def take(self) -> Optional[Tuple[int, int, Body]]:
        """The next frame if it was read ahead whole; None otherwise (no system call: what
        there is of it is kept)."""
        return self._fill(None) if self._lo != self._hi else None

    def _fill(self, deadline: Optional[float]) -> Optional[Tuple[int, int, Body]]:
        """Fill the frame's parts (from the socket until ``deadline``; None: only from what
        was read ahead); the frame once whole."""
        buf, view = self._buf, self._view
        while True:
            parts = self._parts
            while self._at < len(parts):
                part = parts[self._at]
                while self._got < len(part):
                    need = len(part) - self._got
                    have = self._hi - self._lo
                    if have:
                        n = have if have < need else need
                        part[self._got:self._got + n] = view[self._lo:self._lo + n]
                        self._got += n
                        self._lo += n
                        if self._lo == self._hi:
                            self._lo = self._hi = 0
                        continue
                    if deadline is None:
                        return None
                    try:
                        if need >= _DIRECT:
                            n = self._sock.recv_into(memoryview(part)[self._got:])
                            self._got += n
                        else:
                            n = self._sock.recv_into(buf)  # (nothing is ahead: the buffer is empty)
                            self._hi = n
                    except BlockingIOError:
                        left = deadline - time.monotonic()
                        if left <= 0 or not self._poll.poll(left * 1000):
                            return None
                        continue
                    if n == 0:
                        raise EOFError("the peer closed the connection")
                self._at += 1
                self._got = 0
            frame = self._advance()
            if frame is not None:
                return frame

    def _advance(self) -> Optional[Tuple[int, int, Body]]:
        """Every part read so far is whole: the next parts, or the frame once it is whole."""
        parts = self._parts
        if self._stage == 0:
            size, cid, kind, count = _HEADER.unpack(parts[0])
            self._head = (cid, kind, size)
            self._stage = 2 if not count else 1
            parts.append(bytearray(size if not count else _SIZE.size * count))
            return None
        if self._stage == 1:
            parts.append(bytearray(self._head[2]))
            parts += [bytearray(nbytes) for (nbytes,) in _SIZE.iter_unpack(parts[1])]
            self._stage = 3
            if len(parts) > 3:
                return None
        cid, kind, _ = self._head
        at = 1 if self._stage == 2 else 2  # the pickle's part: after the header, or after the sizes
        frame = kind, cid, Body(parts[at], [memoryview(b) for b in parts[at + 1:]])
        self._restart()
        return frame
