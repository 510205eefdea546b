"""The receiver's side: peers' segments and shared storages, mapped once and reused.

Mapping 64 MB costs a few milliseconds even for memory that exists already (page tables
are filled in), unmapping about one more; both would sit on every transfer. Mappings are
therefore cached per ``(owner pid, inode)`` and a received tensor is a fresh view of the
cached mapping::

    descriptor ──► cache hit? ──no──► open /proc/<pid>/fd/<fd>, check the inode,
                      │               mmap(MAP_POPULATE), close the fd, cache it
                      ▼
                 numpy view (a finalizer on it frees a lent segment) ──► torch tensor

The cache holds at most ``limit`` bytes of mappings; new mappings forget entries whose
owner died or retired the segment, then the least recently used. A forgotten mapping
lives on while tensors view it (the numpy view holds it).

Why the look for released entries is not made at every new mapping: it asks /proc about
every entry (a stat and a liveness check), so a worker handed thousands of shared tensors
paid for all it held at each new one (a cold trial: 1,200 tensors mapped, a batch of 100
more took 3.7 s, 71 s for 3,000). It runs once as many new mappings came as the cache
held at the last look (16 at least): a constant cost per mapping, and a released one is
let go at most that many mappings late (the byte limit bounds what it keeps meanwhile).
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
import weakref
from collections import OrderedDict, deque
from typing import Any, Deque, Dict, Optional, Tuple

import numpy as np
import torch

from . import _recycled, _segments
from ._peer_fd import open_peer_fd, retry_within
from .._pids import own_identity, pid_alive
from ._segments import FREE, HEADER, RETIRED, cache

__all__ = ["Mapping", "attach", "lent_view", "lent_array", "foreign_origin", "mapped_any", "forget_all", "set_limit",
           "limit", "bury"]

Key = Tuple[int, int]


class Mapping:
    """A peer's lent segment (``map``) or shared storage (``storage``), mapped here."""

    __slots__ = ("map", "storage", "size", "lent", "address", "origin")

    def __init__(self, mapped: Optional[mmap.mmap], storage: Optional[torch.UntypedStorage], size: int,
                 origin: Tuple[int, int, int, int]) -> None:
        self.map = mapped
        self.storage = storage
        self.size = size
        self.lent = mapped is not None
        if mapped is not None:
            self.address = np.frombuffer(mapped, dtype=np.uint8, count=1).ctypes.data
        elif storage is not None:
            self.address = storage.data_ptr()
        else:
            raise ValueError("a Mapping holds a lent segment's map or a shared storage; got neither")
        self.origin = origin  # (pid, fd, inode, size): how to name it to a third process

    def lent_map(self) -> mmap.mmap:
        """The lent segment's map.

        Raises:
            RuntimeError: this is a shared storage, not a lent segment.
        """
        if self.map is None:
            raise RuntimeError(f"mapping {self.origin} is a shared storage, not a lent segment")
        return self.map

    def shared_storage(self) -> torch.UntypedStorage:
        """The shared storage.

        Raises:
            RuntimeError: this is a lent segment, not a shared storage.
        """
        if self.storage is None:
            raise RuntimeError(f"mapping {self.origin} is a lent segment, not a shared storage")
        return self.storage

    def retired(self) -> bool:
        return self.map is not None and int(np.frombuffer(self.map, dtype=np.int64, count=1)[0]) == RETIRED


_lock = threading.Lock()
_maps: "OrderedDict[Key, Mapping]" = OrderedDict()
_by_address: Dict[int, Mapping] = {}
_held = 0
_shared = 0  # mappings of shared storages (not lent segments) in _by_address
_limit = 1 << 30
_LOOK_MIN = 16
_since_look = 0  # new mappings since the last look for released entries (see the doc)
_look_after = _LOOK_MIN  # ... and how many make the next one (the cache's size at the last look)


def set_limit(limit: int) -> None:
    """Bytes of peers' memory this process keeps mapped between transfers."""
    global _limit
    _limit = limit


def limit() -> int:
    """Bytes of peers' memory this process keeps mapped between transfers (``set_limit``)."""
    return _limit


def _open(pid: int, fd: int, inode: int, size: int, lent: bool) -> Tuple[Optional[mmap.mmap], Any]:
    handle = open_peer_fd(pid, fd, inode, "the shared memory")
    try:
        if lent:
            return mmap.mmap(handle, size, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE), None
        # A shared storage becomes a torch storage of its own (is_shared(), picklable by
        # torch like any other). Its pages are faulted in by the first use, which is the
        # receiver's computation, not the transfer; the cached mapping keeps them.
        # Torch internal, absent from its stubs.
        return None, torch.UntypedStorage._new_shared_fd_cpu(handle, size)  # type: ignore[attr-defined]
    finally:
        os.close(handle)


def attach(pid: int, fd: int, inode: int, size: int, lent: bool) -> Mapping:
    """The cached mapping of ``pid``'s memory ``inode`` (``size`` bytes), made if needed.

    Raises:
        RuntimeError: the owner is gone or released the memory (named).
    """
    global _held, _shared
    key = (pid, inode)
    with _lock:
        found = _maps.get(key)
        if found is not None and found.size >= size and not found.retired():
            _maps.move_to_end(key)
            return found
    mapping = Mapping(*_open(pid, fd, inode, size, lent), size, (pid, fd, inode, size))
    with _lock:
        old = _maps.pop(key, None)
        if old is not None:
            _forget(old)
        _maps[key] = mapping
        _by_address[mapping.address] = mapping
        _shared += not mapping.lent
        _held += size
        _trim()
    return mapping


def _forget(mapping: Mapping) -> None:
    global _held, _shared
    _held -= mapping.size
    if _by_address.get(mapping.address) is mapping:
        del _by_address[mapping.address]
        _shared -= not mapping.lent
    bury(mapping.storage if mapping.storage is not None else mapping)


# Unmapping hundreds of MB takes milliseconds, and torch does it holding the GIL. A thread
# drops the last reference to what the caches let go, so that no transfer waits for it;
# it ends when nothing is left to drop and the next burial starts another.
_graves: Deque[Any] = deque()
_graves_lock = threading.Lock()  # not _lock: burials happen while the caches hold it
_reaping = False
_MADV_DONTNEED = 4


def bury(item: Any) -> None:
    """Drop ``item`` (a mapping or a storage) on the reaper thread."""
    global _reaping
    with _graves_lock:
        _graves.append(item)
        if _reaping:
            return
        _reaping = True
    threading.Thread(target=_reap, name="machinlike-shm-reaper", daemon=True).start()


def _reap() -> None:
    global _reaping
    libc = ctypes.CDLL(None, use_errno=True)
    while True:
        with _graves_lock:
            if not _graves:
                _reaping = False
                return
            item = _graves.popleft()
        if isinstance(item, torch.UntypedStorage) and item.is_shared() \
                and _recycled.use_count(item) == 1:
            # Nothing else uses it: drop its page tables first through ctypes (which lets
            # the GIL go), leaving torch's unmap little to do. The pages belong to the
            # shared file, so no other process loses data.
            libc.madvise(ctypes.c_void_p(item.data_ptr()), ctypes.c_size_t(item.nbytes()), _MADV_DONTNEED)
        del item  # a Python mmap unmaps without the GIL by itself


def _released(mapping: Mapping) -> bool:
    # A lent segment its owner retired, or memory its owner freed or died with (its
    # descriptor is closed or names other memory now: so too when the owner's pid went to
    # a new process, which its bare pid's liveness would not tell): only this cache would
    # keep the memory alive.
    if mapping.lent and mapping.retired():
        return True
    pid, fd, inode, _ = mapping.origin
    try:
        return os.stat(f"/proc/{pid}/fd/{fd}").st_ino != inode
    except OSError:
        return True


def _trim() -> None:
    global _since_look, _look_after
    _since_look += 1
    if _since_look >= _look_after:
        _since_look = 0
        _look_after = max(_LOOK_MIN, len(_maps))  # (the size now: a growing cache looks at 16, 32, 64...)
        alive: Dict[int, bool] = {}  # (one look per owner, not per entry)
        for key, mapping in list(_maps.items()):
            owner = key[0]
            if owner not in alive:
                alive[owner] = pid_alive(owner)
            if not alive[owner] or _released(mapping):
                _forget(_maps.pop(key))
    while _held > _limit and len(_maps) > 1:
        _, mapping = _maps.popitem(last=False)
        _forget(mapping)


def forget_all() -> None:
    """Drop every cached mapping (tensors still viewing one keep it), at once."""
    global _held, _shared, _since_look, _look_after
    with _lock:
        _maps.clear()
        _by_address.clear()
        _held = _shared = _since_look = 0
        _look_after = _LOOK_MIN


def mapped_any() -> bool:
    """Whether a peer's shared storage is mapped here: what :func:`foreign_origin` can name
    (a cheap test first; lent segments do not count)."""
    return _shared > 0


def foreign_origin(address: int) -> Optional[Tuple[int, int, int, int]]:
    """``(pid, fd, inode, size)`` of a by-reference mapping starting at ``address``."""
    mapping = _by_address.get(address)
    return None if mapping is None or mapping.lent else mapping.origin


def _free(header: np.ndarray) -> None:
    header[0] = FREE


def lent_view(pid: int, fd: int, inode: int, capacity: int, nbytes: int, claim: int = 0) -> torch.Tensor:
    """A uint8 tensor over a lent segment's data; the segment is freed when it dies
    (``claim``: as for :func:`lent_array`)."""
    return torch.from_numpy(lent_array(pid, fd, inode, capacity, nbytes, claim))


def lent_array(pid: int, fd: int, inode: int, capacity: int, nbytes: int, claim: int = 0) -> np.ndarray:
    """A uint8 array over a lent segment's data; the segment is freed when it and every
    view of it died.

    ``claim``: the lease id of a lease its owner may abandon (a reply's, ``_segments``),
    taken under the claim; 0: taken plainly.

    Raises:
        TimeoutError: the owner abandoned that lease (its reply was loaded too late).
        RuntimeError: the owner is gone or closed the segment.
    """
    if pid == os.getpid():
        seg = cache().find(inode)
        if seg is None:
            raise RuntimeError(f"this process's shared-memory segment {inode} was closed before its payload was loaded")
        mapped = seg.map
    else:
        mapped = attach(pid, fd, inode, HEADER + capacity, lent=True).lent_map()
    header = np.frombuffer(mapped, dtype=np.int64, count=2)
    if claim:
        _take_claimed(pid, fd, inode, header, claim)
    else:
        header[1] = own_identity()  # (pid and start time: a pid reused after this process died is not it)
    data = np.frombuffer(mapped, dtype=np.uint8, count=nbytes, offset=HEADER)
    weakref.finalize(data, _free, header)
    return data


_CLAIM_WAIT_S = 1.0  # the owner holds the claim for two reads and a write: a wait this long means it is stopped


def _take_claimed(pid: int, fd: int, inode: int, header: np.ndarray, lease: int) -> None:
    """Name this process the taker of ``lease`` under the claim its owner abandons by
    (``flock`` through a descriptor of our own: a distinct open description, see
    ``_segments``).

    Raises:
        TimeoutError: the owner abandoned the lease, or held the claim past ``_CLAIM_WAIT_S``.
    """
    handle = open_peer_fd(pid, fd, inode, "the shared memory")
    try:
        if not retry_within(lambda: _flock(handle), _CLAIM_WAIT_S):
            raise TimeoutError(f"process {pid} held the claim on its shared-memory segment {inode} for "
                               f"{_CLAIM_WAIT_S} s (stopped?): the reply through it cannot be loaded")
        if int(header[0]) != lease:
            raise TimeoutError(
                f"a reply was loaded more than {_segments.ABANDON_AFTER_S} s after its call's deadline, and its "
                f"sender (process {pid}) had taken back the shared memory it lent for it: the call is lost. A "
                f"process that loads its replies that late is stalled (its RPC threads wait for the GIL)")
        header[1] = own_identity()
    finally:
        os.close(handle)  # (unlocks)


def _flock(handle: int) -> bool:
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _after_fork_in_child() -> None:
    global _lock, _graves_lock, _held, _reaping
    _lock, _graves_lock = threading.Lock(), threading.Lock()
    _graves.clear()
    _reaping = False
    _maps.clear()
    _by_address.clear()
    _held = 0


os.register_at_fork(after_in_child=_after_fork_in_child)
