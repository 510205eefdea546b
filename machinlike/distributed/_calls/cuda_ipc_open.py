"""The receiver's cache of the CUDA IPC path: peers' slabs opened here, and their control pages.

Opening a handle costs milliseconds, so an opened slab is kept, keyed by ``(owner pid,
handle, offset)``, bounded by ``limit`` bytes mapped (least recently used goes first). A
handle maps its owner's whole allocator segment, which may be far larger than the slab
(``cuda_ipc_slab.segment_bytes``) and hold several slabs: torch opens equal handle bytes
once, so a segment counts once, while any opening of it is kept::

    open (pid, handle, offset) ─► maps[(pid, handle)] = [segment bytes, openings + 1]
                                  held += segment bytes   (its first opening only)
    drop (evicted, dead, retired) ─► openings - 1 ─► 0: held -= segment bytes

Before each new opening it forgets slabs whose owner died (as its pidfd tells: a pid the
kernel gave to a new process keeps nothing open) or retired them (so that a
retired slab's handle is closed before new memory behind the same handle bytes is
opened), and so does a member's departure. An opening holds no reference count of
torch's (``NO_COUNTER``): the owner decides when a slab is gone (it retires it), and a
receiver that is SIGKILLed leaves no count behind that would pin the owner's memory
forever. The sender's half, and what the control page holds: ``cuda_ipc_area``.

Each sender whose control page is mapped here is also watched through a pidfd: a receiver
asks whether the sender still runs at every message (``alive``; a message's copies "done"
from a process SIGKILLed with them queued must not be believed), and a pidfd answers in
about a microsecond where /proc takes 8 to 26. It is closed with the control page.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import select
import threading
import traceback
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

from ..._shm._peer_fd import open_peer_fd
from ..._cuda_streams import own_stream
from ..._pids import pid_alive
from .cuda_ipc_area import PAGE_BYTES, ROWS, WORDS

__all__ = ["Key", "Opened", "Opener", "OpenCache", "NO_COUNTER", "NO_EVENT", "CLOSE_WAIT_S", "forget_frames"]

NO_COUNTER = b"/machinlike-cuda-ipc-no-counter"  # a torch ref-counter file that never exists
NO_EVENT = bytes(64)  # CUDA_IPC_HANDLE_SIZE; torch's own event is unused: the slab has its own

Key = Tuple[int, bytes, int]

# Seconds a thread about to open a peer's slab waits at most for the handles other threads
# are closing (a close waits for its device: milliseconds, unless the device is stuck).
CLOSE_WAIT_S = 30.0


class Opened:
    """A peer's slab opened here, on ``cuda:index``; ``views``: tensors over it by layout (as
    ``Slab.views``); ``ready``: the slab's event, opened at the first message that names it
    (None until then; each message's copies out get an event of their own:
    ``cuda_ipc_ops.copies_done``)."""

    __slots__ = ("storage", "words", "slot", "ident", "views", "ready", "index")

    def __init__(self, storage: Any, words: np.ndarray, slot: int, ident: int, index: int = 0) -> None:
        self.storage = storage
        self.words = words
        self.slot = slot
        self.ident = ident
        self.views: Dict[Any, torch.Tensor] = {}
        self.ready: Any = None
        self.index = index

    def retired(self) -> bool:
        return int(self.words[self.slot, 2]) != self.ident

    def __del__(self) -> None:
        # Where the last reference goes (the cache's eviction, a receiving thread, the
        # releaser), the storage goes with this slab's device current: torch's deleter of
        # an opened storage synchronises its device's current stream without choosing the
        # device, so from a thread working on another GPU (or on none yet: cuda:0) it
        # would wait on the wrong one, and could make a context on cuda:0 (half a GiB).
        # And that current stream is an idle one of our own: the deleter waits with the GIL
        # held (and, from the cache, under its lock), and on the default stream it would
        # wait out whatever this process queued there (a learner's step: every thread
        # stalled). Nothing of ours needs the wait: every copy out of an opening ended
        # before its last reference went (the releaser holds it until then).
        if not getattr(self.storage, "is_cuda", False):  # (the CPU tests' storages; or gone)
            return
        storage, views = self.storage, self.views
        self.storage = self.views = None  # type: ignore[assignment]
        if torch.cuda._is_in_bad_fork():
            # A forked child (its parent's openings came along): torch's deleter would make
            # CUDA calls that fail here, inside a destructor that may not throw (the child
            # aborts, at its exit at the latest). The memory is the parent's and this child
            # cannot use CUDA at all: the storage is kept for good, never freed.
            _keep_forever((storage, views))
            return
        try:
            with torch.cuda.device(self.index), torch.cuda.stream(_idle_stream(self.index)):
                del views, storage
        except Exception:  # (interpreter shutdown: torch.cuda half torn down; freed as before)
            pass


def forget_frames(error: Optional[BaseException]) -> None:
    """Clear the locals of the finished frames that ``error``'s traceback, and its causes',
    keep (a receive that failed): none of them then holds an opening or a view of one (it
    would keep a peer's slab open past its lease, and free it later from whatever thread
    drops the error). The traceback still names every file and line. None: nothing."""
    seen = 0
    while error is not None and seen < 16:  # (a cause chain: bounded, as a loop of causes could be)
        traceback.clear_frames(error.__traceback__)  # (frames still running are left as they are)
        error, seen = error.__cause__, seen + 1


def _keep_forever(kept: object) -> None:
    """One more reference to ``kept`` that is never given back: not even the interpreter's
    exit frees it (a module's list would be cleared then, and the deleter run)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))


_idle: Dict[int, Any] = {}  # by device index: a stream nothing is ever queued on


def _idle_stream(index: int) -> Any:
    """A stream of ``cuda:index`` that holds no work (made once; a race makes two, harmlessly)."""
    stream = _idle.get(index)
    if stream is None:
        stream = _idle[index] = own_stream(index)  # (not a pooled one: a user's side stream may be that)
    return stream


Opener = Callable[[], Any]


class OpenCache:
    """Peers' slabs opened here, and their control pages (see the module docstring).

    Openings are let go out of ``_lock`` (closing a handle waits for its device, for
    milliseconds, while every receiving thread takes that lock), so a thread about to open
    a slab first waits until the closes other threads began have run: the slab may have
    taken a closing one's place behind the same handle bytes::

        thread B: pop a gone opening (closing += 1) ─► unlock ─► close it ─► closing -= 1
        thread A: pop its own gone ones ─► unlock ─► close them ─► wait closing == 0 ─► open

    Args:
        limit: Bytes of peers' segments kept mapped between transfers (each counted once).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._closed = threading.Condition(self._lock)  # notified when ``_closing`` falls
        self._closing = 0  # openings popped and not yet let go (by any thread)
        self._opened: "OrderedDict[Key, Opened]" = OrderedDict()
        self._controls: Dict[Tuple[int, int], Tuple[mmap.mmap, np.ndarray]] = {}
        # A pidfd per control page, by the same (pid, inode) key: a pid reused by a new
        # sender has a new area, so it never inherits a dead one's pidfd.
        self._pidfds: Dict[Tuple[int, int], int] = {}
        # (A lock of their own: ``alive`` is asked at every message.) Order: ``_lock``, then this.
        self._pid_lock = threading.Lock()
        self._held = 0  # bytes mapped: each segment in ``_maps`` once
        self._maps: Dict[Tuple[int, bytes], List[int]] = {}  # (pid, handle) ─► [bytes, openings]
        self.stats: Dict[str, int] = {"opened": 0, "evicted": 0, "dropped_dead_or_retired": 0}

    def held_bytes(self) -> int:
        return self._held

    def __len__(self) -> int:
        return len(self._opened)

    def control(self, pid: int, fd: int, inode: int) -> np.ndarray:
        """The control page of process ``pid`` (mapped once).

        Raises:
            RuntimeError: the sender is gone or closed its area (named).
        """
        key = (pid, inode)
        with self._lock:
            found = self._controls.get(key)
            if found is not None:
                return found[1]
        handle = open_peer_fd(pid, fd, inode, "the CUDA export area")
        try:
            mapped = mmap.mmap(handle, PAGE_BYTES, flags=mmap.MAP_SHARED)
        finally:
            os.close(handle)
        words = np.frombuffer(mapped, dtype=np.int64).reshape(ROWS, WORDS)
        with self._lock:
            self._controls.setdefault(key, (mapped, words))
            with self._pid_lock:
                if key not in self._pidfds:
                    try:
                        self._pidfds[key] = os.pidfd_open(pid)
                    except (AttributeError, OSError):  # (gone already, or Linux before 5.3: /proc asked)
                        pass
            return self._controls[key][1]

    def alive(self, pid: int, inode: int) -> bool:
        """Whether the sender of area ``inode``, process ``pid``, still runs (not a zombie
        either): from its pidfd, which turns readable when it exits; /proc where there is none."""
        with self._pid_lock:  # (held: _drop_gone may close the pidfd meanwhile)
            fd = self._pidfds.get((pid, inode))
            if fd is not None:
                return not _readable(fd)
        return pid_alive(pid)

    def open(self, key: Key, capacity: int, words: np.ndarray, slot: int, ident: int, opener: Opener,
             index: int = 0, mapped: Optional[int] = None) -> Opened:
        """The opened slab ``key`` on ``cuda:index`` (``opener()`` opens its storage when not
        cached); ``mapped``: the bytes its handle maps here (its owner's segment); None: ``capacity``.

        Raises:
            RuntimeError: handles other threads were closing were not closed within
                ``CLOSE_WAIT_S`` (the device is stuck); nothing was opened.
        """
        with self._lock:
            found = self._opened.get(key)
            if found is not None and found.ident == ident and not found.retired():
                self._opened.move_to_end(key)
                return found
            # First: a retired slab's handle must be closed before a slab that took its
            # place is opened (torch finds an open handle by its bytes, and the memory
            # behind equal bytes may be new). ``found`` too: a reference of this frame
            # would keep it open through ``opener()``.
            found = None
            gone = self._drop_gone()
        self._let_go(gone)
        with self._lock:
            if not self._closed.wait_for(lambda: self._closing == 0, CLOSE_WAIT_S):
                raise RuntimeError(
                    f"the CUDA memory of peers this process let go was not closed within {CLOSE_WAIT_S:.0f} s "
                    f"(its device is stuck or far behind); process {key[0]}'s slab was not opened"
                )
        opened = Opened(opener(), words, slot, ident, index)
        with self._lock:
            if key in self._opened:
                gone.append(self._drop(key))
            self._opened[key] = opened
            self._count(key, capacity if mapped is None else mapped)
            self.stats["opened"] += 1
            while self._held > self.limit and len(self._opened) > 1:
                gone.append(self._drop(next(iter(self._opened))))
                self.stats["evicted"] += 1
        self._let_go(gone)
        return opened

    def _drop_gone(self) -> List[Opened]:
        gone = []
        with self._pid_lock:
            exited = {k for k, fd in self._pidfds.items() if _readable(fd)}  # (its pid may run another process)
        # An opening goes with its sender's exit as its pidfd tells it, not only as /proc
        # tells of its bare pid: a pid the kernel gave to a new process would keep a dead
        # sender's GPU memory open here until evicted.
        dead_pages = [self._controls[k][1] for k in exited if k in self._controls]
        for key, opened in list(self._opened.items()):
            if opened.retired() or any(opened.words is page for page in dead_pages) or not pid_alive(key[0]):
                gone.append(self._drop(key))
                self.stats["dropped_dead_or_retired"] += 1
        live = {opened_key[0] for opened_key in self._opened}
        # A live sender's earlier area (its World stopped and started again) goes too once
        # no opening reads its page: else each restart would leave a page and a pidfd here.
        newest = {k[0]: k for k in self._controls}  # (a dict keeps the order pages came in)
        read = {id(opened.words) for opened in self._opened.values()}
        for control in [k for k in self._controls
                        if k in exited or (k[0] not in live and not pid_alive(k[0]))
                        or (newest[k[0]] != k and id(self._controls[k][1]) not in read)]:
            del self._controls[control]
        self._close_pidfds([k for k in self._pidfds if k not in self._controls])
        return gone

    def _close_pidfds(self, keys: List[Tuple[int, int]]) -> None:
        with self._pid_lock:
            for key in keys:
                os.close(self._pidfds.pop(key))

    def _drop(self, key: Key) -> Opened:
        """Forget opening ``key`` (under ``_lock``); the caller lets it go with ``_let_go``
        once out of the lock: dropping the last storage of a handle closes it (torch's IPC
        handle cache), which waits for its device and may take milliseconds."""
        opened = self._opened.pop(key)
        segment = (key[0], key[1])
        count = self._maps[segment]
        count[1] -= 1
        if count[1] == 0:
            del self._maps[segment]
            self._held -= count[0]
        self._closing += 1
        return opened

    def _count(self, key: Key, mapped: int) -> None:
        """Count opening ``key`` (under ``_lock``): its segment's bytes where it is the first."""
        count = self._maps.setdefault((key[0], key[1]), [0, 0])
        count[1] += 1
        if mapped > count[0]:  # (the first, or a slab that knows its segment better)
            self._held += mapped - count[0]
            count[0] = mapped

    def _let_go(self, gone: List[Opened]) -> None:
        """Drop ``gone`` (popped by ``_drop`` or counted in ``_closing``), out of ``_lock``."""
        if not gone:
            return
        count = len(gone)
        try:
            gone.clear()
        finally:
            with self._lock:
                self._closing -= count
                self._closed.notify_all()

    def forget_dead(self) -> int:
        """Drop what dead or retired owners left here; returns how many openings went."""
        with self._lock:
            gone = self._drop_gone()
        count = len(gone)
        self._let_go(gone)
        return count

    def forget_all(self) -> None:
        """Drop every opening and control page (World stop)."""
        with self._lock:
            gone = list(self._opened.values())
            self._closing += len(gone)
            self._opened.clear()
            self._controls.clear()
            self._close_pidfds(list(self._pidfds))
            self._maps.clear()
            self._held = 0
        self._let_go(gone)


def _readable(fd: int) -> bool:
    # poll, not select: select refuses descriptors from 1024 up (a large process has them)
    watch = select.poll()
    watch.register(fd, select.POLLIN)
    return bool(watch.poll(0))
