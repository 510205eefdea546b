"""A process pool's tensor policy: how tasks, results and contexts become bytes.

Built on :class:`machinlike.pickle.Pickler` (C pickler, dill for lambdas and closures)
with a dispatch table per policy::

    policy                       CPU tensor                         CUDA tensor
    copy (is_copy_tensor=True)   < 1 MiB: data in the pickle, or    data in the pickle
                                 packed with the payload's others
                                 of 4 KiB+ into one lent segment
                                 when they add up to 1 MiB
                                 >= 1 MiB: one copy into a recycled
                                 segment lent to the receiver
    share_method="cpu"           shared memory (moved there once),  data in the pickle
                                 mapped once per receiver
    share_method="cuda"          as in copy                         CUDA IPC handle (a tensor
                                                                    received through IPC and
                                                                    sent on: a device copy;
                                                                    a result: copied on
                                                                    arrival, _cuda_shares)

A numpy array of at least 1 MiB (without Python objects in it) travels as a copy through
a lent segment under every policy, or through fresh named shared memory when several
workers load it (a map's function) or no segment is free (numpy memory cannot be moved
into shared memory in place, so there is nothing to share by reference); a pickled one
went through the pipe at 0.4 GB/s.

Copy mode still shares *a copy*: a large tensor is copied once, into a pre-faulted
segment of the sender's (``machinlike._shm``) that nobody else uses until the receiver's
tensor dies; the receiver maps each segment once and keeps the mapping. The receiver
therefore owns a private copy (its in-place edits never reach the sender), and the data
is copied once, into memory that is already faulted in. A payload loaded by several
workers (a map's function) cannot borrow a segment: it copies into fresh named shared
memory instead, as does a tensor that finds no segment under the cache's bound.

Share mode passes CPU storages by ``/proc/<pid>/fd`` reference: a worker maps a storage
once and reuses the mapping every time the same tensor comes again (no map, unmap or
page fault on the way). A storage already shared by name keeps torch's path.

:meth:`Codec.dumps_tracked` also returns the storages the payload refers to by name, so
that a payload loaded by several workers (a map's function) can keep them alive in the
pool until every worker has loaded it: a named segment is unlinked as soon as nobody
holds it, and torch counts one pickling as one load. It returns the CUDA IPC references
a payload hands out too (``_cuda_shares.CudaCounter``): the pool gives back those that
nobody loaded or whose receiver died.
"""

from __future__ import annotations

import pickle
import threading
from typing import Any, Dict, FrozenSet, List, Optional, Tuple, Union

import numpy as np
import torch
from torch.multiprocessing import reductions as _torch_red

from .. import _reductions, _shm
from .._reductions.undo import note_undo
from ..pickle import Pickler
from . import _cuda_shares

__all__ = ["Codec", "LARGE_TENSOR_BYTES"]

#: From this size on, copy mode moves a CPU tensor through one fresh shared-memory copy.
LARGE_TENSOR_BYTES = 1 << 20

_tracking = threading.local()


def _track(storage: Union[torch.UntypedStorage, torch.Tensor, np.ndarray, _cuda_shares.CudaCounter]) -> None:
    kept = getattr(_tracking, "kept", None)
    if kept is not None:
        kept.append(storage)


def _track_lease(payload: Any) -> None:
    kept = getattr(_tracking, "kept", None)
    if kept is not None:
        kept.append(payload)  # a payload never delivered is loaded here, which frees the lease


def _share_storage(storage: torch.UntypedStorage) -> Tuple[Any, ...]:
    _track(storage)
    return _reductions._reduce_storage_share(storage)


class _NamedStorage:
    """Pickles a storage by name whatever the table says about storages (copy mode
    maps bare storages to "copy")."""

    __slots__ = ("storage",)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.storage = storage

    def __reduce__(self) -> Tuple[Any, ...]:
        return _share_storage(self.storage)


def _copy_through_shared_memory(tensor: torch.Tensor) -> Tuple[Any, ...]:
    data = tensor.detach()
    storage = torch.UntypedStorage._new_using_filename_cpu(data.numel() * data.element_size())
    copy = torch.empty(0, dtype=data.dtype).set_(storage, 0, data.shape)  # type: ignore[call-overload]  # stride optional
    copy.copy_(data)
    return (
        _rebuild_from_storage,
        (type(tensor), _NamedStorage(storage), data.dtype, tuple(data.shape), tensor.requires_grad),
    )


def _rebuild_from_storage(
    cls: type, storage: torch.UntypedStorage, dtype: torch.dtype, shape: Tuple[int, ...], requires_grad: bool
) -> torch.Tensor:
    tensor = torch.empty(0, dtype=dtype).set_(storage, 0, shape)  # type: ignore[call-overload]  # stride optional
    if cls is torch.nn.Parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def _lend(tensor: torch.Tensor) -> Optional[Tuple[Any, ...]]:
    if getattr(_tracking, "multi_load", False) or not _shm.shm_eligible(tensor):
        return None
    reduced = _shm.reduce_copy(tensor)
    if reduced is not None:
        _track(tensor)  # a payload never delivered is loaded here, which frees the lease
    return reduced


def _reduce_array(array: np.ndarray) -> Any:
    if array.nbytes < LARGE_TENSOR_BYTES or array.dtype.hasobject:
        return array.__reduce_ex__(pickle.HIGHEST_PROTOCOL)
    if getattr(_tracking, "multi_load", False):  # (a map's function: every worker loads it)
        return _array_through_shared_memory(array)
    reduced = _shm.reduce_array(array)
    if reduced is None:
        return _array_through_shared_memory(array)
    _track(array)  # a payload never delivered is loaded here, which frees the lease
    return reduced


def _array_through_shared_memory(array: np.ndarray) -> Tuple[Any, ...]:
    """``array`` copied into fresh named shared memory, as a large tensor of a payload that
    several workers load (a closure over it) is: pickled, it went through each pipe."""
    return _reductions.reduce_array_named(array, _share_storage)


def _share_cpu(tensor: torch.Tensor) -> Tuple[Any, ...]:
    if _shm.shm_eligible(tensor) and tensor.untyped_storage().nbytes():
        reduced = _shm.share_and_reduce(tensor)
        if reduced is not None:
            _track(tensor.untyped_storage())
            return reduced
    return _torch_red.reduce_tensor(tensor)


def _make_table(share_cpu: bool, share_cuda: bool) -> _reductions.DispatchTable:
    copy_tensor = _reductions._reduce_tensor_copy
    large = LARGE_TENSOR_BYTES

    def reduce_tensor(tensor: torch.Tensor) -> Tuple[Any, ...]:
        kind = tensor.device.type
        if kind == "cpu":
            if share_cpu:
                return _share_cpu(tensor)
            if _reductions._is_plain_strided(tensor) and tensor.nbytes >= large:  # (sparse: no nbytes)
                parts = _reductions.expanded(tensor)
                if parts is not None:  # its distinct elements travel (this table again), expanded on arrival
                    return _reductions.expand_back, parts
                return _lend(tensor) or _copy_through_shared_memory(tensor)
            return copy_tensor(tensor)
        if kind == "cuda" and share_cuda:
            # A tensor the worker was given and returns goes back as a device copy
            # (CUDA cannot re-export imported memory; see reduce_tensor_share).
            reduced = _reductions.reduce_tensor_share(tensor)
            counters = _cuda_shares.counters_of(reduced)  # (a sparse or nested one's parts too)
            if counters:  # who gives them back if nobody loads them: see _cuda_shares
                for counter in counters:
                    _track(counter)
                note_undo(lambda: _cuda_shares.release_unheld(counters, delivered=False))
            return reduced
        return copy_tensor(tensor)

    table = _reductions.copy_reducers()
    for cls in [torch.Tensor, torch.nn.Parameter, *torch._tensor_classes]:
        table[cls] = reduce_tensor
    table[torch.UntypedStorage] = _share_storage if share_cpu else _reductions._reduce_storage_copy
    table[np.ndarray] = _reduce_array
    return table


_tables: Dict[Tuple[bool, bool], _reductions.DispatchTable] = {}
_tables_lock = threading.Lock()


def _table(share_cpu: bool, share_cuda: bool) -> _reductions.DispatchTable:
    key = (share_cpu, share_cuda)
    with _tables_lock:
        table = _tables.get(key)
        if table is None:
            table = _tables[key] = _make_table(share_cpu, share_cuda)
        return table


class _Sink:
    __slots__ = ("data",)

    def __init__(self) -> None:
        self.data = b""

    def write(self, data: bytes) -> int:
        self.data = data
        return len(data)


class _PolicyPickler(Pickler):
    """machinlike's pickler with a pool policy's table in place of the share table.

    Built in share mode (``copy_tensor=False``) so that a failed pickling pass rolls
    back the references it took on shared memory (machinlike.pickle's undo ledger).
    """

    def __init__(self, table: _reductions.DispatchTable, recurse: bool) -> None:
        self._share_table = table  # read by Pickler.__init__ for copy_tensor=False
        self._out = _Sink()
        super().__init__(self._out, recurse=recurse, copy_tensor=False)  # type: ignore[arg-type]  # has write()

    def to_bytes(self, obj: Any) -> bytes:
        self.dump(obj)
        data, self._out.data = self._out.data, b""
        return data


class Codec:
    """Pickles a pool's payloads under its tensor policy; travels to the workers.

    Args:
        copy: machin's ``is_copy_tensor``.
        share: Devices whose tensors are shared when ``copy`` is False (``"cpu"``,
            ``"cuda"``).
        recurse: machin's ``is_recursive`` (dill's ``recurse``).
    """

    __slots__ = ("copy", "share", "recurse", "_table")

    def __init__(self, copy: bool, share: FrozenSet[str], recurse: bool) -> None:
        self.copy = copy
        self.share = frozenset() if copy else frozenset(share)
        self.recurse = recurse
        self._table = _table("cpu" in self.share, "cuda" in self.share)

    @property
    def shares_cpu(self) -> bool:
        """Whether CPU tensors travel by reference (so the shared-memory manager is
        certainly needed)."""
        return "cpu" in self.share

    def dumps(self, obj: Any) -> bytes:
        """Pickle ``obj`` under the policy.

        Raises:
            pickle.PicklingError, TypeError: ``obj`` cannot be pickled.
        """
        picklers = getattr(_tracking, "picklers", None)
        if picklers is None:
            picklers = _tracking.picklers = {}
        pickler: Optional[_PolicyPickler] = picklers.get(self._key())
        if pickler is None or pickler._busy:
            pickler = _PolicyPickler(self._table, self.recurse)
            picklers.setdefault(self._key(), pickler)
        if not self.copy or getattr(_tracking, "multi_load", False):
            return pickler.to_bytes(obj)
        # Many medium tensors and arrays (a list of frames, a state dict): one lent segment
        # for them all, not their bytes through the pipe (see _shm._pack).
        obj, pack = _shm.pack_items(obj, LARGE_TENSOR_BYTES)
        try:
            data = pickler.to_bytes(obj)
        except BaseException:
            pack.release()  # (a worker then pickles a failed chunk item by item)
            raise
        if pack.leased:
            _track_lease(obj)
        return data

    def dumps_tracked(self, obj: Any, multi_load: bool = False) -> Tuple[bytes, List[Any]]:
        """Like :meth:`dumps`, plus what the payload names in shared memory (storages that
        must outlive every load of it, tensors whose lent segment a load frees).

        Args:
            obj: What to pickle.
            multi_load: The payload will be loaded by several workers (a map's function),
                so it may not borrow a segment that its first load frees.
        """
        outer = getattr(_tracking, "kept", None), getattr(_tracking, "multi_load", False)
        kept: List[Any] = []
        _tracking.kept, _tracking.multi_load = kept, multi_load
        try:
            return self.dumps(obj), kept
        finally:
            _tracking.kept, _tracking.multi_load = outer

    loads = staticmethod(pickle.loads)

    def loads_here(self, data: bytes) -> Any:
        """Load a payload in the process that made it (to release what it holds in shared
        memory): CUDA tensors come back as None (see ``_cuda_shares.loads_without_cuda``)."""
        if "cuda" in self.share:
            return _cuda_shares.loads_without_cuda(data)
        return pickle.loads(data)

    def loads_result(self, data: bytes) -> Any:
        """Load a worker's outcome: CUDA tensors shared by the worker arrive as device
        copies the caller owns (the worker's memory goes with it; see ``_cuda_shares``)."""
        if "cuda" in self.share:
            return _cuda_shares.loads_owned(data)
        return pickle.loads(data)

    def _key(self) -> Tuple[Any, ...]:
        return (id(self._table), self.recurse)

    def __reduce__(self) -> Tuple[Any, ...]:
        return (Codec, (self.copy, self.share, self.recurse))

    def __repr__(self) -> str:
        mode = "copy" if self.copy else "share " + "+".join(sorted(self.share))
        return f"Codec({mode}, recurse={self.recurse})"
