"""Frames on a pool worker's private pipes: a fixed header, then an opaque payload.

Header (little endian, 26 bytes): payload length (u64), kind (u8), flag (u8), channel
sequence number (i64), extra (i64). Each worker has one task pipe (pool -> worker) and
one result pipe (worker -> pool), so a frame never interleaves with another writer's and
readers may pull many frames per system call.

Task pipe: ``TASK_CALL`` (payload: ``(func, args, kwds)``), ``TASK_MAP`` (payload: a
chunk of items; flag: star-call; extra: id of an installed function), ``INSTALL``
(extra: function id; payload: the function), ``DROP`` (extra: function id), ``STOP``.
Only task frames carry a sequence number (their position in the channel).

Result pipe: ``READY`` (initializer done), ``INIT_FAILED`` (payload: the error), and
per task, by its sequence number: ``DONE`` (the result or the chunk's list),
``FAILED`` (the exception), ``PARTIAL`` (per-item results and errors of a chunk),
``EXITING`` (the task called ``sys.exit``; the worker exits next).
"""

from __future__ import annotations

import os
import struct
from collections import deque
from itertools import islice
from typing import Any, Deque, List, Optional, Tuple, Union

__all__ = [
    "HEADER",
    "FrameReader",
    "OutBuffer",
    "write_frame",
    "TASK_CALL",
    "TASK_MAP",
    "INSTALL",
    "DROP",
    "STOP",
    "READY",
    "INIT_FAILED",
    "DONE",
    "FAILED",
    "PARTIAL",
    "EXITING",
]

HEADER = struct.Struct("<QBBqq")
_HEADER_SIZE = HEADER.size

TASK_CALL, TASK_MAP, INSTALL, DROP, STOP = 1, 2, 3, 4, 5
READY, INIT_FAILED, DONE, FAILED, PARTIAL, EXITING = 10, 11, 12, 13, 14, 15

Frame = Tuple[int, int, int, int, Any]  # kind, flag, seq, extra, payload

_READ_SIZE = 1 << 18
# A payload at least this large is read straight into a buffer of its own size instead
# of growing the shared one (no quadratic copying, no second copy when slicing it out).
_LARGE = 1 << 20
# Below this, header and payload are joined and written with one write().
_JOIN_BELOW = 1 << 16
_IOV_BATCH = 512


class FrameReader:
    """Turns the bytes of one pipe into frames, on blocking or non-blocking descriptors."""

    __slots__ = ("_fd", "_buf", "_large", "_large_head", "_filled", "_ready", "eof")

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._buf = bytearray()
        self._large: Optional[bytearray] = None
        self._large_head: Tuple[int, int, int, int] = (0, 0, 0, 0)
        self._filled = 0
        self._ready: Deque[Frame] = deque()
        self.eof = False

    def read_available(self) -> List[Frame]:
        """Read what a non-blocking descriptor has now; return the complete frames.

        Sets :attr:`eof` when the writing side is closed (a torn last frame is dropped).
        """
        while not self.eof:
            try:
                got = self._read_once()
            except BlockingIOError:
                break
            except OSError:  # the descriptor was closed under us: nothing more to come
                self.eof = True
                break
            if got == 0:
                self.eof = True
                break
            self._parse()
            if got < _READ_SIZE and self._large is None:
                break  # drained (a full read means more may be waiting)
        frames = list(self._ready)
        self._ready.clear()
        return frames

    def next_frame(self) -> Optional[Frame]:
        """Block until the next frame of a blocking descriptor; None at end of stream."""
        ready = self._ready
        while not ready:
            if self._read_once() == 0:
                self.eof = True
                return None
            self._parse()
        return ready.popleft()

    def _read_once(self) -> int:
        large = self._large
        if large is not None:
            with memoryview(large) as view:
                got = os.readv(self._fd, [view[self._filled:]])
            self._filled += got
            return got
        data = os.read(self._fd, _READ_SIZE)
        self._buf += data
        return len(data)

    def _parse(self) -> None:
        ready = self._ready
        large = self._large
        if large is not None:
            if self._filled < len(large):
                return
            ready.append((*self._large_head, large))
            self._large = None
        buf = self._buf
        size = len(buf)
        pos = 0
        with memoryview(buf) as view:
            while size - pos >= _HEADER_SIZE:
                length, kind, flag, seq, extra = HEADER.unpack_from(buf, pos)
                body = pos + _HEADER_SIZE
                end = body + length
                if end <= size:
                    ready.append((kind, flag, seq, extra, bytes(view[body:end])))
                    pos = end
                    continue
                if length >= _LARGE:
                    large = bytearray(length)
                    have = size - body
                    large[:have] = view[body:size]
                    self._large, self._large_head, self._filled = large, (kind, flag, seq, extra), have
                    pos = size
                break
        if pos:
            del buf[:pos]


def write_frame(fd: int, kind: int, flag: int, seq: int, extra: int, payload: Union[bytes, bytearray] = b"") -> None:
    """Write one frame to a blocking descriptor, completely.

    Raises:
        OSError: the pipe is broken (the reader is gone).
    """
    header = HEADER.pack(len(payload), kind, flag, seq, extra)
    if len(payload) < _JOIN_BELOW:
        data = memoryview(header + payload)
        while data:
            data = data[os.write(fd, data):]
        return
    parts: List[Any] = [header, memoryview(payload)]
    while parts:
        written = os.writev(fd, parts)
        while written:
            first = parts[0]
            if len(first) <= written:
                written -= len(first)
                parts.pop(0)
            else:
                parts[0] = memoryview(first)[written:]
                written = 0


class OutBuffer:
    """Frames waiting to go down a non-blocking pipe, written in batches with writev()."""

    __slots__ = ("_parts",)

    def __init__(self) -> None:
        self._parts: Deque[Any] = deque()

    def __bool__(self) -> bool:
        return bool(self._parts)

    def push(self, kind: int, flag: int, seq: int, extra: int, payload: Union[bytes, bytearray] = b"") -> None:
        header = HEADER.pack(len(payload), kind, flag, seq, extra)
        if len(payload) < 512:
            self._parts.append(header + payload)  # one iovec instead of two
        else:
            self._parts.append(header)
            self._parts.append(payload)

    def flush(self, fd: int) -> bool:
        """Write as much as the pipe takes now.

        Returns:
            True when everything was written, False when the pipe is full.

        Raises:
            OSError: the pipe is broken (the worker is gone).
        """
        parts = self._parts
        while parts:
            try:
                written = os.writev(fd, list(islice(parts, _IOV_BATCH)))
            except BlockingIOError:
                return False
            while written:
                first = parts[0]
                if len(first) <= written:
                    written -= len(first)
                    parts.popleft()
                else:
                    parts[0] = memoryview(first)[written:]
                    written = 0
        return True

    def clear(self) -> None:
        self._parts.clear()
