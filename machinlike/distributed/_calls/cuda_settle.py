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
                                          CPU does not wait)

Why on delivery and not at the copy: the copying thread cannot know the caller's stream.
torch's own RPC futures order the waiting thread's current streams after a result's the
same way. The cost: nothing in a process that never received a CUDA tensor (one test of
an empty set); one stream comparison per device otherwise, and an event where the caller
works on another stream.
"""

from __future__ import annotations

from typing import Set, TypeVar

import torch

__all__ = ["noted", "settle", "settled", "devices"]

T = TypeVar("T")

# Device indexes this process received CUDA tensors on. Only grows, bounded by the GPUs.
_devices: Set[int] = set()


def noted(index: int) -> None:
    """(Unpickling thread) tensors were copied to ``cuda:index`` on this thread's stream."""
    if index not in _devices:
        _devices.add(index)  # (one set operation: atomic under the GIL)


def devices() -> Set[int]:
    """The device indexes noted so far (a copy)."""
    return set(_devices)


def settle() -> None:
    """Order this thread's current stream of every device received on after the default one.

    Called where a result reaches the caller's thread; a no-op unless this process
    received CUDA tensors and the caller works on a stream of its own.
    """
    if not _devices:
        return
    for index in tuple(_devices):
        device = torch.device("cuda", index)
        current = torch.cuda.current_stream(device)
        default = torch.cuda.default_stream(device)
        if current != default:
            current.wait_stream(default)


def settled(value: T) -> T:
    """``value``, after :func:`settle` (for a return statement)."""
    settle()
    return value
