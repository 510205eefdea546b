"""settle: the caller's CUDA stream waits for the copies that brought it CUDA tensors.

What a process receives on a GPU (the copies out of a slab of CUDA IPC, a staged tensor's
copy to its GPU) is queued on the stream current in the thread that unpickles the
message: a lane caller, the lane's watcher or one of torch's RPC threads, on the default stream, as every
thread starts. A caller working under ``torch.cuda.stream(s)`` reads the result on ``s``,
which does not wait for the default stream (torch makes its streams non-blocking), so it
could read a tensor whose copy has not run yet::

    unpickling thread (any)               noted(i): cuda:i joins the devices received on
    caller's thread, handed a result      settle(): for each such device whose current
                                          stream here is not its default stream,
                                          current.wait_stream(default)   (on the GPU; the
                                          CPU does not wait), and each CUDA tensor
                                          of the result: record_stream(current)

Why on delivery and not at the copy: the copying thread cannot know the caller's stream.
torch's own RPC futures order the waiting thread's current streams after a result's the
same way. The cost: nothing in a process that never received a CUDA tensor (one test of
an empty set); one stream comparison per device otherwise, and an event and a walk of the
result (``_shm._walk``: where a call's tensors are found) where the caller works on another
stream.
"""

from __future__ import annotations

import functools
import os
from typing import Any, Dict, Set, TypeVar

import torch

from ..._shm._walk import walk

__all__ = ["noted", "settle", "settled", "devices"]

T = TypeVar("T")

# Device indexes this process received CUDA tensors on. Only grows, bounded by the GPUs.
_devices: Set[int] = set()


def _after_fork_in_child() -> None:
    # A forked child cannot use CUDA: its settle() must not ask for the parent's streams
    # ("Cannot re-initialize CUDA in forked subprocess"); what it receives later notes again.
    _devices.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def noted(index: int) -> None:
    """(Unpickling thread) tensors were copied to ``cuda:index`` on this thread's stream."""
    if index not in _devices:
        _devices.add(index)  # (one set operation: atomic under the GIL)


def devices() -> Set[int]:
    """The device indexes noted so far (a copy)."""
    return set(_devices)


def settle(value: Any = None) -> None:
    """Order this thread's current stream of every device received on after the default
    one; where that is another stream, mark the CUDA tensors in ``value`` as used on it.

    Called where a result reaches the caller's thread; a no-op unless this process
    received CUDA tensors and the caller works on a stream of its own. ``value``: the
    result (None: nothing to mark). Why the mark (``record_stream``): received tensors are
    allocated on the default stream; freed while the caller's stream still reads them, their
    memory would go at once to the next allocation there (the next message's copies out),
    which could overwrite it under the caller's kernels. torch's RPC futures record their
    results' tensors on the waiting thread's streams for the same reason.
    """
    if not _devices:
        return
    side: Dict[int, Any] = {}
    for index in tuple(_devices):
        device = torch.device("cuda", index)
        current = torch.cuda.current_stream(device)
        default = torch.cuda.default_stream(device)
        if current != default:
            current.wait_stream(default)
            side[index] = current
    if side and value is not None:
        walk(value, functools.partial(_record, side))


def _record(side: Dict[int, Any], tensor: torch.Tensor) -> torch.Tensor:
    """(Walk leaf) ``tensor``, marked as used on its device's side stream, if it has one."""
    if tensor.is_cuda:
        stream = side.get(tensor.device.index)
        if stream is not None:
            tensor.record_stream(stream)
    return tensor


def settled(value: T) -> T:
    """``value``, after :func:`settle` of it (for a return statement)."""
    settle(value)
    return value
