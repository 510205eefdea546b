"""The CUDA IPC references a process pool hands out (``share_method="cuda"``), and who gives
each one back (torch's counters: ``machinlike._reductions.cuda_counters``).

::

    a task nobody loaded (backlog, terminate(), a failed map) ─> given back at its discard,
                                                                  or once every worker ended
    what reached a worker (its tasks, its start-up, installs)  ─> given back when it ends
    an install no task of its function ran on                  ─> given back at the drop

Why per install for a map's function: torch's counter stands for one receiver, but the
function's payload is loaded by every worker it runs on, and each of their frees would
take one off (the first one already freed the memory under the others). So a function
holding CUDA tensors is pickled again for each worker it is installed on (the first
pickle goes to the first).

Why results are copied on arrival: a worker's result names the worker's memory, which
goes when the worker exits (``maxtasksperchild``, a kill), under a caller still holding
it. The pool copies it device to device when it loads the result, so the caller owns what
it got (as from any other same-host CUDA transfer here), and the worker's memory is given
back at once.
"""

from __future__ import annotations

import contextlib
import io
import pickle
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch.multiprocessing import reductions as _torch_red

from .._cuda_streams import own_stream
from .._reductions import cuda_counters
from .._reductions.cuda_counters import CudaCounter, counter_of, counters_in, counters_of, read_counter, release_unheld

__all__ = [
    "CudaCounter", "counter_of", "counters_of", "counters_in", "read_counter", "release_unheld", "loads_owned",
    "loads_without_cuda", "pickled_counters",
]

_REBUILD = ("torch.multiprocessing.reductions", "rebuild_cuda_tensor")
_REBUILD_NAME = _REBUILD[1].encode()


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
    views). Each opened memory is let go once its copy has run (waited for here), which
    gives the sender's reference back.

    Why a stream of its own (``own_stream``: not one of torch's pool, which a user's side
    stream may share): that wait, and torch's free of an opened memory, are for the
    *current* stream. On the default stream a result would wait for everything this process had
    queued there (a learner's step). The copy is marked as used by the default stream,
    where a caller's work goes unless it says otherwise, so that the allocator does not
    give its memory to the next copy while the caller's kernels may still read it.
    """
    if _REBUILD_NAME not in data:  # (no CUDA tensor in it: pickle's own speed)
        return pickle.loads(data)
    copies: Dict[Tuple[bytes, int], torch.UntypedStorage] = {}
    return _Unpickler(data, lambda *args: _owned(copies, args)).load()


_copy_streams: Dict[int, Any] = {}  # device index -> this process's copy stream (one a device)


def _copy_context(device: int) -> Any:
    """``device`` and its copy stream made current (nothing without CUDA: a test's stand-in)."""
    if not torch.cuda.is_available():
        return contextlib.nullcontext()
    stream = _copy_streams.get(device)
    if stream is None:
        stream = _copy_streams.setdefault(device, own_stream(device))  # (not a pooled one: see own_stream)
    stack = contextlib.ExitStack()
    stack.enter_context(torch.cuda.device(device))
    stack.enter_context(torch.cuda.stream(stream))
    return stack


def _copy_done(device: int) -> None:
    if torch.cuda.is_available():  # (nothing without CUDA: a test's stand-in)
        torch.cuda.current_stream(device).synchronize()


def _owned(copies: Dict[Tuple[bytes, int], torch.UntypedStorage], args: Tuple[Any, ...]) -> torch.Tensor:
    tensor_cls, size, stride, offset, _storage_cls, dtype, device, handle, nbytes, offset_bytes, requires_grad = args[:11]
    if handle is None or not nbytes:
        return _torch_red.rebuild_cuda_tensor(*args)
    key = (handle, offset_bytes)
    storage = copies.get(key)
    if storage is None:
        with _copy_context(device):
            source = _torch_red.rebuild_cuda_tensor(*args)  # (waits for the sender's writes on this stream)
            storage = copies[key] = source.untyped_storage().clone()
            # The copy ends before the opened memory goes: torch's free closes the handle
            # first and synchronises after, and frees nothing at all where this process
            # had that memory open already (torch's own cache), where the caller would
            # otherwise read a copy still running on this stream.
            _copy_done(device)
            del source  # its free: the reference given back
    elif isinstance(args[11], bytes) and args[11]:
        # One more reduction of a storage already copied: the sender counted it as one
        # more receiver (torch's own rebuild gives these back on its cache hit too).
        cuda_counters.give_back(CudaCounter(args[11], int(args[12])))
    typed = torch.storage.TypedStorage(wrap_storage=storage, dtype=dtype, _internal=True)
    tensor = torch._utils._rebuild_tensor(typed, offset, size, stride)
    if tensor.is_cuda:
        tensor.record_stream(torch.cuda.default_stream(tensor.device))
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
