"""One item of a pipe read within a deadline, and resumed at the next read when it did not end.

::

    read_item(fd, deadline, item)
      [4-byte length (-1: an 8-byte one follows)][bytes ...]    multiprocessing.connection's frame
        poll until the deadline before each read ─► None: the deadline came first; what
                                                     arrived stays in ``item``
        the next read_item(fd, ..., item) goes on where it stopped ─► the whole item

Why: ``Connection.recv_bytes`` reads an item to its end with no bound, so a writer killed
or stopped (SIGSTOP) in the middle of a large ``put`` held a reader's ``get(timeout=1)``
for good (cold trial 26). Abandoning a half-read item would tear the pipe for every later
reader; keeping it and resuming does not. The caller keeps the pipe's read lock while an
item is partly read (no other reader may start in its middle).
"""

from __future__ import annotations

import math
import os
import select
import struct
import time
from typing import Optional

__all__ = ["PartialItem", "read_item"]

_CHUNK = 1 << 24  # bytes asked of one read (the pipe gives at most what it holds)


class PartialItem:
    """What one process read of an item that has not ended yet (nothing: ``pending`` False)."""

    __slots__ = ("head", "body", "filled")

    def __init__(self) -> None:
        self.head = bytearray()
        self.body: Optional[bytearray] = None
        self.filled = 0

    @property
    def pending(self) -> bool:
        return bool(self.head)

    def describe(self) -> str:
        if self.body is None:
            return f"{len(self.head)} bytes of its length"
        return f"{self.filled:,} of {len(self.body):,} bytes"

    def reset(self) -> None:
        self.head, self.body, self.filled = bytearray(), None, 0


def _readable(fd: int, deadline: Optional[float]) -> bool:
    if deadline is None:
        return True  # (a blocking read waits itself)
    left = deadline - time.monotonic()
    poller = select.poll()  # (not select(): a descriptor past 1023 is fine)
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(max(0, math.ceil(left * 1000))))


def read_item(fd: int, deadline: Optional[float], item: PartialItem) -> Optional[bytearray]:
    """The next item of the pipe ``fd``, or None when ``deadline`` (``time.monotonic()``;
    None: none) came before it ended (what arrived stays in ``item`` for the next call).

    Raises:
        EOFError: every writing end closed (in the middle of an item too: ``item`` is reset).
    """
    while True:
        body = item.body
        if body is None:
            head = item.head
            if len(head) == 4 and head[:4] != b"\xff\xff\xff\xff":
                item.body = bytearray(struct.unpack("!i", bytes(head))[0])
                continue
            if len(head) == 12:
                item.body = bytearray(struct.unpack("!Q", bytes(head[4:]))[0])
                continue
            need = (4 if len(head) < 4 else 12) - len(head)
        elif item.filled == len(body):
            item.reset()
            return body
        else:
            need = len(body) - item.filled
        if not _readable(fd, deadline):
            return None
        if body is None:
            chunk = os.read(fd, need)
            got = len(chunk)
            item.head += chunk
        else:
            got = os.readv(fd, [memoryview(body)[item.filled:item.filled + min(need, _CHUNK)]])
            item.filled += got
        if got == 0:
            item.reset()
            raise EOFError("every writing end of the pipe was closed")
