"""The share policy (``copy_tensor=False``) of :mod:`machinlike.pickle`::

    Tensor, Parameter ──> torch's reduce_tensor ──┬─ CUDA: IPC handle (torch; a device copy of a
                                                  │  tensor received through IPC: reduce_tensor_share)
                                                  └─ CPU: TypedStorage ─> torch's reduce_typed_storage
                                                                             │
    UntypedStorage (CPU) <───────────────────────────────────────────────────┘
        ├─ already shared by file descriptor ─> DupFd + fd rebuild (torch's fd path)
        └─ otherwise ─> named shared memory (torch's file_system path), multi-load

Why named shared memory even when the process's sharing strategy is "file_descriptor":
a payload made with torch's fd path names a descriptor that a background thread of the
sender hands out *once*, while the sender lives. Named shared memory can be opened by any
number of loads, in any process, even after the sender has exited. The choice is made per
storage inside our reducers, so ``torch.multiprocessing.set_sharing_strategy`` is never
touched.

A storage that is already fd-backed (``share_memory_()`` under torch's default strategy,
or a tensor received through torch's own queues) moves to named shared memory (what
``_share_filename_cpu_`` does: a copy, then the storage points at it) only when no other
process can be using it: never sent or received through a reducer, and mapped by no
other process (``/proc/<pid>/maps``). Its payload then outlives the sender like any named
one (machin's case: a child shares a tensor, sends it and exits). Otherwise it keeps its
backing: moving it would silently cut it off from the processes that already share it.
Its payload carries a descriptor that one load takes; loading it again works in a process that already maps the storage (the sender, or a process that loaded
it before) and fails with a clear error elsewhere.

Reference counting of named shared memory: torch keeps the segment alive while it is
mapped, plus one "in transit" reference that each pickling adds and a load releases.
Loading the same payload again in the same process releases nothing (a per-process set
of payload tokens tells first loads from repeats). Across processes, the in-transit
reference goes with a claim file the pickling creates (an empty file under /dev/shm): the
one load that unlinks it releases the reference, every other load only maps. ``unlink``
succeeds for exactly one caller, so the count stays exact however many processes load
one payload; without it the segment's name could go away while the sender still holds
the tensor, and the sender could not share it again. A payload never loaded keeps its
segment (as torch's own) and its claim file until torch's manager exits.
"""

from __future__ import annotations

import os
import pickle
from typing import Any, Optional, Tuple

import numpy as np
import torch
import multiprocessing.reduction
from torch.multiprocessing import reductions as _torch_red

from . import cuda_counters, shm_space
from .arrays import LARGE_ARRAY_BYTES, reduce_array_named
from .claims import first_load as _first_load, make_claim as _make_claim, take_claim as _take_claim
from .table import DispatchTable, policy_table
from .undo import note_undo as _note_undo

__all__ = ["manager_primer", "reduce_tensor_share", "share_reducers"]


# Named shared memory needs torch's shared-memory manager, a helper process that each
# process starts on its first named share (about 0.3 s: it loads libtorch) unless it is
# already connected to one, which loading a storage someone else shared does.
_uses_manager = False


_primer: Optional[torch.UntypedStorage] = None


def manager_primer(start: bool = False) -> Optional[torch.UntypedStorage]:
    """A one-byte named-shared storage, if this process is connected to a manager.

    A child that loads it connects to the same manager, so its own named shares reuse
    that one instead of starting another.

    Args:
        start: Start this process's manager if it has none (a pool that will share
            tensors pays that once here instead of once per worker).

    Returns:
        The primer, or None when this process has no manager and ``start`` is False.
    """
    global _primer, _uses_manager
    if not (_uses_manager or start):
        return None
    _uses_manager = True
    if _primer is None:
        primer = torch.UntypedStorage(1)
        primer._share_filename_cpu_()
        _primer = primer
    return _primer


def _is_fd_backed(storage: torch.UntypedStorage) -> bool:
    if not storage.is_shared():
        return False
    try:
        storage._get_shared_fd()  # type: ignore[attr-defined]  # torch internal, absent from its stubs
    except RuntimeError:
        return False
    return True


def _movable(storage: torch.UntypedStorage) -> bool:
    """Whether an fd-backed storage may move to named shared memory without cutting
    anybody off, i.e. no other process can use it.

    It must never have been sent or received through torch's or our reducers (each
    records the storage in torch's shared cache), and no other process may map it (a
    child forked after ``share_memory_()`` does): checked in ``/proc/<pid>/maps`` of
    every process we may read. Without ``/proc`` nothing is moved.
    """
    try:
        # Torch internal, absent from its stubs.
        dev, inode = _torch_red.fd_id(storage._get_shared_fd())  # type: ignore[attr-defined]
    except (RuntimeError, OSError):
        return False
    if (dev, inode) in _torch_red.shared_cache or not os.path.isdir("/proc/self"):
        return False
    needle, me = f" {inode} ", str(os.getpid())
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or entry.name == me:
            continue
        try:
            with open(f"/proc/{entry.name}/maps", encoding="ascii", errors="replace") as maps:
                if any(needle in line and "/dev/shm/" in line for line in maps):
                    return False
        except OSError:  # gone meanwhile, or another user's (who cannot map our memory)
            continue
    return True


_SHARING = "sharing a tensor's memory (a queue's default: SimpleQueue(copy_tensor=True) sends copies instead)"


def _reduce_storage_share(storage: torch.UntypedStorage) -> Tuple[Any, ...]:
    if storage.device.type != "cpu":
        raise RuntimeError(
            f"cannot share a {storage.device.type} storage by itself; pickle a tensor on it instead"
        )
    if storage.nbytes() == 0:
        return (_torch_red.rebuild_storage_empty, (torch.UntypedStorage,))
    if _is_fd_backed(storage) and not _movable(storage):  # in use elsewhere: keep the fd
        fd, size = storage._share_fd_cpu_()
        handle = multiprocessing.reduction.DupFd(fd)
        key = _torch_red.fd_id(fd)
        _torch_red.shared_cache[key] = _torch_red.StorageWeakRef(storage)
        if hasattr(handle, "_id"):  # a resource_sharer registration: fetch it back on undo
            _note_undo(lambda: os.close(handle.detach()))
        return (_rebuild_storage_fd, (handle, size, key, os.urandom(12)))
    global _uses_manager
    if not storage.is_shared():
        shm_space.require_room(storage.nbytes(), _SHARING)
    try:
        manager, handle, size = storage._share_filename_cpu_()
    except RuntimeError as err:
        if shm_space.is_full(err, storage.nbytes()):
            raise shm_space.full_error(storage.nbytes(), _SHARING) from err
        raise
    _uses_manager = True
    token = os.urandom(12)
    claim = _make_claim(token, handle)
    storage._shared_incref()
    _note_undo(storage._shared_decref)
    if claim is not None:
        _note_undo(lambda: _take_claim(claim))
    _torch_red.shared_cache[handle] = _torch_red.StorageWeakRef(storage)
    return (_rebuild_storage_named, (manager, handle, size, token, claim))


def _rebuild_storage_named(
    manager: bytes, handle: bytes, size: int, token: bytes, claim: Optional[str] = None
) -> torch.UntypedStorage:
    global _uses_manager
    _uses_manager = True  # (from here on) loading connects this process to the sender's manager
    if _first_load(token) and (claim is None or _take_claim(claim)):
        # torch's own rebuild: opens (or finds in its cache) and releases the transit ref
        try:
            return _torch_red.rebuild_storage_filename(torch.UntypedStorage, manager, handle, size)
        except RuntimeError as exc:
            raise _released_error(handle) from exc
    storage = _torch_red.storage_from_cache(torch.UntypedStorage, handle)
    if storage is None:
        try:
            storage = torch.UntypedStorage._new_shared_filename_cpu(manager, handle, size)
        except RuntimeError as exc:
            raise _released_error(handle) from exc
        _torch_red.shared_cache[handle] = _torch_red.StorageWeakRef(storage)
    return storage


def _released_error(handle: bytes) -> RuntimeError:
    return RuntimeError(
        f"the shared memory {handle.decode(errors='replace')} of a shared tensor is gone: "
        f"every process that held the tensor released it before this load. Keep the tensor "
        f"alive in the sender until receivers have loaded it, or send it with copy_tensor=True"
    )


def _rebuild_storage_fd(handle: Any, size: int, key: Tuple[int, int], token: bytes) -> torch.UntypedStorage:
    if _first_load(token):
        try:
            fd = handle.detach()
        except (OSError, EOFError, KeyError, RuntimeError) as exc:
            # another process loaded this payload first and took the descriptor
            return _cached_fd_storage(key, exc)
        try:
            storage = _torch_red.storage_from_cache(torch.UntypedStorage, _torch_red.fd_id(fd))
            if storage is None:
                # Torch internal, absent from its stubs.
                storage = torch.UntypedStorage._new_shared_fd_cpu(fd, size)  # type: ignore[attr-defined]
                _torch_red.shared_cache[_torch_red.fd_id(fd)] = _torch_red.StorageWeakRef(storage)
            return storage
        finally:
            os.close(fd)
    return _cached_fd_storage(key, None)


def _cached_fd_storage(key: Tuple[int, int], cause: Optional[BaseException]) -> torch.UntypedStorage:
    # The descriptor was handed out already. A repeated load still works where this
    # process maps the storage; anywhere else the memory is out of reach.
    storage = _torch_red.storage_from_cache(torch.UntypedStorage, key)
    if storage is not None:
        return storage
    raise RuntimeError(
        "a tensor whose memory was shared by file descriptor (torch's default strategy, e.g. "
        "after share_memory_()) can be loaded from one payload only once per process that "
        "does not hold it already, and only while the sender is alive; pickle it again for "
        "each receiver"
    ) from cause


def reduce_tensor_share(tensor: torch.Tensor) -> Tuple[Any, ...]:
    """torch's sharing reduction (CUDA: an IPC handle); a CUDA tensor this process itself
    received through CUDA IPC goes as a device copy.

    Why the copy: CUDA cannot export memory a process imported, and torch refuses with
    "Attempted to send CUDA tensor received from another process" (a pool worker that
    returns the tensor it was given). The copy stays on the device (no trip through the
    host), and torch's IPC reference counting keeps it alive until the receiver let go.
    The check happens before torch does anything, so nothing is left to undo.
    """
    try:
        reduced = _torch_red.reduce_tensor(tensor)
    except RuntimeError as err:
        if tensor.device.type != "cuda" or "received from another process" not in str(err):
            raise
        copy = tensor.detach().clone()
        if isinstance(tensor, torch.nn.Parameter):
            copy = torch.nn.Parameter(copy, requires_grad=tensor.requires_grad)
        else:
            copy.requires_grad_(tensor.requires_grad)
        reduced = _torch_red.reduce_tensor(copy)
    if tensor.is_cuda:  # (a sparse or nested CUDA tensor's parts too)
        cuda_counters.note(reduced)  # (a collecting caller gives it back if nobody will)
    return reduced


def _reduce_array_share(array: np.ndarray) -> Any:
    if array.nbytes < LARGE_ARRAY_BYTES or array.dtype.hasobject:
        return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    return reduce_array_named(array, _reduce_storage_share)


def share_reducers() -> DispatchTable:
    """The share policy's table: torch's multiprocessing reducers, ours for CPU storages
    and large numpy arrays (copied once into named shared memory, see ``arrays``)."""
    table = policy_table(reduce_tensor_share, _reduce_storage_share)
    table[np.ndarray] = _reduce_array_share
    return table
