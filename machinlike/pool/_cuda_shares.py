"""The CUDA IPC references a process pool hands out (``share_method="cuda"``), and who gives
each one back.

torch's CUDA IPC keeps a shared tensor's memory in the sending process until a reference
counter in shared memory drops to zero (torch's note "CUDA IPC Refcounting implementation
explained")::

    pool (sender)                                     worker (receiver)
    reduce: new counter = 1 ──── payload names it ──> load: opens the memory
    memory held while the counter is above 0          its tensor freed: counter -= 1
                    <──── torch.cuda.ipc_collect() frees what reads 0

Only a receiver's free gives the reference back, so memory leaks in the sender for good
when nobody ever loads the payload (a task discarded by ``terminate()`` or a failed map)
and when its receiver dies holding it (SIGKILL, or an exit that skipped its deleters).
The pool knows when neither can happen any more, and gives back what is still counted::

    never delivered (backlog, refused)   ─┐
    delivered to a worker that has ended ─┴─> counter still above 0? -1, then ipc_collect

Reading the counter first keeps that exact: a receiver that did free it already is not
counted twice (a count below zero would keep the memory for good). The pool reads only
after every process that could still free it has ended, so nothing races the read.

Why per install for a map's function: torch's counter stands for one receiver, but the
function's payload is loaded by every worker it runs on, and each of their frees would
take one off (the first one already freed the memory under the others). So a function
holding CUDA tensors is pickled again for each worker (one counter each).

Why results are copied on arrival: a worker's result names the worker's memory, which
goes when the worker exits (``maxtasksperchild``, a kill), under a caller still holding
it. The pool copies it device to device when it loads the result, so the caller owns what
it got (as from any other same-host CUDA transfer here), and the worker's memory is given
back at once.

The counter's layout (an ``int64`` array after the 64-byte header of torch's reference
counted shared memory) is torch's, not a promise: the first counter this process reads
must say 1 (what a fresh share sets), or the pool never releases one (``disabled()``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import struct
import threading
from typing import Any, Callable, Dict, Iterable, List, NamedTuple, Optional, Tuple

import torch
from torch.multiprocessing import reductions as _torch_red

__all__ = [
    "CudaCounter", "counter_of", "counters_in", "read_counter", "release_unheld", "disabled",
    "stats", "loads_owned", "loads_without_cuda", "pickled_counters",
]

log = logging.getLogger(__name__)

# torch's RefcountedMapAllocator keeps a header (the mappers' count) this long before the
# data, and CUDA IPC counters are the data's int64s.
_HEADER = 64
_SHM_DIR = "/dev/shm"
# A counter above this is not a count of receivers: the layout is not the one assumed.
_SANE = 1 << 20
_REBUILD = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
_REBUILD_NAME = _REBUILD[1].encode()


class CudaCounter(NamedTuple):
    """One CUDA IPC reference of a payload: torch's counter file and slot."""

    handle: bytes
    offset: int


def counter_of(reduced: Tuple[Any, ...]) -> Optional[CudaCounter]:
    """The counter a CUDA tensor's reduction (``(rebuild_cuda_tensor, args)``) names; None
    for an empty tensor (nothing shared) or another reduction."""
    func, args = reduced[0], reduced[1]
    if func is not _torch_red.rebuild_cuda_tensor or args[7] is None or not args[8]:
        return None
    handle, offset = args[11], args[12]
    if not isinstance(handle, bytes) or not handle:
        return None
    counter = CudaCounter(handle, int(offset))
    _verify_layout(counter)
    return counter


def counters_in(kept: Iterable[Any]) -> Tuple[CudaCounter, ...]:
    """The CUDA counters among what a pickling tracked."""
    return tuple(k for k in kept if isinstance(k, CudaCounter))


def read_counter(counter: CudaCounter) -> Optional[int]:
    """The counter's value; None when its file is gone (its sender let go of it)."""
    name = counter.handle.decode("ascii", "replace").lstrip("/")
    try:
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, 8, _HEADER + 8 * counter.offset)
    finally:
        os.close(fd)
    if len(raw) != 8:
        return None
    return struct.unpack("=q", raw)[0]


class _State:
    """What this process learned and did: the layout check and the counts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.checked = False
        self.disabled = False
        self.counts: Dict[str, int] = {"released": 0, "already_freed": 0, "unreadable": 0}


_state = _State()


def _verify_layout(counter: CudaCounter) -> None:
    if _state.checked:
        return
    value = read_counter(counter)  # a fresh share: torch set it to 1
    with _state.lock:
        if _state.checked:
            return
        _state.checked = True
        if value != 1:
            _state.disabled = True
            log.warning(
                "CUDA IPC reference counters are not laid out as this machinlike expects (a fresh "
                "share reads %r, not 1): the pool cannot give back the GPU memory of tasks nobody "
                "loaded or of workers that died; upgrade machinlike for this torch %s",
                value, torch.__version__,
            )


def disabled() -> bool:
    """Whether the layout check failed (nothing is released then)."""
    return _state.disabled


def stats() -> Dict[str, int]:
    """Counts of this process: ``released`` (references given back for a receiver that
    never will), ``already_freed`` (its receiver had), ``unreadable`` (skipped: the
    counter read out of range or the layout check failed)."""
    with _state.lock:
        return dict(_state.counts)


def _torch_release(counter: CudaCounter) -> None:  # (looked up per call: tests stand in for it)
    # Torch internal (CUDA builds); what a receiver's free calls.
    torch.UntypedStorage._release_ipc_counter_cuda(counter.handle, counter.offset)


def release_unheld(
    counters: Iterable[CudaCounter], release: Optional[Callable[[CudaCounter], None]] = None,
) -> int:
    """Give back each reference still counted. Call it only once no process that loaded
    the payloads can free them any more (never delivered, or their receiver has ended).

    Args:
        counters: The references.
        release: What takes one off (None: torch's).

    Returns:
        How many were given back; then torch frees what nobody holds any more.
    """
    torch_release = release is None
    take_off = _torch_release if release is None else release
    released = 0
    for counter in counters:
        value = None if _state.disabled else read_counter(counter)
        if value is None or value == 0:
            _count("already_freed" if value == 0 else "unreadable")
            continue
        if not 0 < value < _SANE:
            _count("unreadable")
            continue
        try:
            take_off(counter)  # (one payload, one receiver: it reads 1)
        except RuntimeError:
            _count("unreadable")
            continue
        released += 1
        _count("released")
    if released and torch_release and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()  # free what reads 0 now, not at the next share
    return released


def _count(what: str) -> None:
    with _state.lock:
        _state.counts[what] += 1


class _Unpickler(pickle.Unpickler):
    """pickle's unpickler with torch's CUDA tensor rebuild swapped for ``rebuild``."""

    def __init__(self, data: bytes, rebuild: Callable[..., Any]) -> None:
        super().__init__(io.BytesIO(data))
        self._rebuild = rebuild

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == _REBUILD:
            return self._rebuild
        return super().find_class(module, name)


def loads_without_cuda(data: bytes) -> Any:
    """Load a payload in the process that made it, each CUDA tensor as None.

    Why: what it holds in CPU shared memory is given back by loading it, but CUDA refuses
    to open a process's own IPC handle (the references go back through
    :func:`release_unheld`).
    """
    return _Unpickler(data, _no_tensor).load()


def _no_tensor(*args: Any) -> None:
    return None


def loads_owned(data: bytes) -> Any:
    """Load a result, each CUDA tensor copied device to device out of the sender's memory.

    Tensors that shared a storage in the sender share one copy of it here (views stay
    views). The opened memory is let go before this returns, even when loading fails (its
    free waits for the copies, then gives the sender's reference back).
    """
    if _REBUILD_NAME not in data:  # (no CUDA tensor in it: pickle's own speed)
        return pickle.loads(data)
    copies: Dict[Tuple[bytes, int], torch.UntypedStorage] = {}
    opened: List[torch.Tensor] = []
    try:
        return _Unpickler(data, lambda *args: _owned(copies, opened, args)).load()
    finally:
        opened.clear()  # (the first free waits for every copy queued: one wait, not one each)


def _owned(
    copies: Dict[Tuple[bytes, int], torch.UntypedStorage], opened: List[torch.Tensor], args: Tuple[Any, ...],
) -> torch.Tensor:
    tensor_cls, size, stride, offset, _storage_cls, dtype, device, handle, nbytes, offset_bytes, requires_grad = args[:11]
    if handle is None or not nbytes:
        return _torch_red.rebuild_cuda_tensor(*args)
    key = (handle, offset_bytes)
    storage = copies.get(key)
    if storage is None:
        source = _torch_red.rebuild_cuda_tensor(*args)
        opened.append(source)
        with torch.cuda.device(source.device) if source.is_cuda else contextlib.nullcontext():
            storage = copies[key] = source.untyped_storage().clone()
    elif isinstance(args[11], bytes) and args[11]:
        # One more reduction of a storage already copied: the sender counted it as one
        # more receiver (torch's own rebuild gives these back on its cache hit too).
        _torch_release(CudaCounter(args[11], int(args[12])))
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    tensor = torch._utils._rebuild_tensor(typed, offset, size, stride)
    if tensor_cls is torch.nn.Parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    tensor.requires_grad = requires_grad
    return tensor


def pickled_counters(kept: List[Any]) -> Tuple[List[Any], Tuple[CudaCounter, ...]]:
    """``kept`` without its CUDA counters, and the counters."""
    counters = counters_in(kept)
    if not counters:
        return kept, ()
    return [k for k in kept if not isinstance(k, CudaCounter)], counters
