"""The CUDA operations of the IPC path (``cuda_ipc``), by name, in one place.

Everything else of the path (offsets, views, leases, control pages, pickling, waits and
releases) is plain Python over these few calls; the CPU tests run all of it over CPU
memory by replacing them (``tests/test_cuda_ipc.py``). Each is looked up on this module
at call time (``ops.device(...)``) for that reason.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from .cuda_ipc_slab import Slab
from .cuda_ipc_open import NO_COUNTER, NO_EVENT, Opened
from .cuda_ipc_release import Done

__all__ = ["device", "synchronize", "mark_ready", "copied_here", "after_writes", "open_event", "copies_done", "cuda_ready",
           "current_index", "open_shared", "view", "VIEWS_KEPT"]


def device(index: int) -> torch.device:
    return torch.device("cuda", index)


def synchronize(device: torch.device) -> None:
    torch.cuda.current_stream(device).synchronize()


def mark_ready(slab: Slab) -> None:
    """(Sender) record the slab's event after the copies queued into it."""
    ready = slab.ready  # (read once: a World's stop may retire the slab meanwhile, and None it)
    if ready is not None:
        ready.record(torch.cuda.current_stream(device(slab.index)))


def copied_here(tensors: List[torch.Tensor], index: int) -> None:
    """(Sender) tell torch's allocator that ``tensors`` are read by copies queued on this
    thread's current stream of ``cuda:index`` (``record_stream``), as torch's RPC does for
    what it sends: a tensor made on another stream and freed by the caller once the call
    returned would otherwise go to that stream's next tensor before the copies ran, and the
    receiver get that one's bytes. (Nothing for a tensor made on this stream, or not by
    the allocator: torch skips those.)"""
    cuda = [tensor for tensor in tensors if tensor.is_cuda]
    if cuda:
        stream = torch.cuda.current_stream(device(index))
        for tensor in cuda:
            tensor.record_stream(stream)


def after_writes(slab: Slab) -> None:
    """(Sender) order this thread's stream after the last copies into the slab (those of a
    message that never left, maybe queued on another thread's stream)."""
    ready = slab.ready  # (read once, as in ``mark_ready``)
    if ready is None:  # (no IPC event, or retired: the whole device)
        torch.cuda.synchronize(device(slab.index))
    else:
        torch.cuda.current_stream(device(slab.index)).wait_event(ready)


class _OnDevice:
    """An event whose waits run with its device current: a CUDA call from a thread that never
    chose a device would otherwise make a context on cuda:0 (half a GiB of GPU memory)."""

    __slots__ = ("event", "index")

    def __init__(self, event: Any, index: int) -> None:
        self.event = event
        self.index = index

    def query(self) -> bool:
        with torch.cuda.device(self.index):
            return bool(self.event.query())

    def synchronize(self) -> None:
        with torch.cuda.device(self.index):
            self.event.synchronize()


def open_event(index: int, handle: bytes) -> Any:
    """(Receiver) a sender's slab event, opened here (once per opening)."""
    event = torch.cuda.Event.from_ipc_handle(device(index), handle)
    return event if index == 0 else _OnDevice(event, index)  # (a thread's device is cuda:0 until it sets one)


def copies_done(opened: Opened, index: int) -> Done:
    """(Receiver) an event recorded after this message's copies out, queued on ``cuda:index``.

    One a message, not one an opening: a pinned slab is read by several messages at once,
    from several threads and streams, and each lease may end only after its own copies.
    """
    done = torch.cuda.Event(blocking=True)  # (its waiter, the releaser, sleeps: no core spun)
    done.record(torch.cuda.current_stream(device(index)))
    # The releaser holds the opening until the copies ran: evicted meanwhile by another
    # thread's opening, its last reference would close the handle under them (torch's
    # deleter of an opened storage closes it before it waits for any stream).
    return _Holding(done if index == 0 else _OnDevice(done, index), opened)


class _Holding:
    """A :class:`Done` that keeps what the copies read from alive until it is waited on."""

    __slots__ = ("done", "opened")

    def __init__(self, done: Any, opened: Opened) -> None:
        self.done = done
        self.opened = opened

    def synchronize(self) -> None:
        self.done.synchronize()


def cuda_ready() -> bool:
    return torch.cuda.is_initialized()


def current_index() -> int:
    """A device this process works on, for the probe: the thread's current device when this
    process made a context there, else the first device that has one (a thread other than
    the one that chose the device starts on cuda:0)."""
    current = torch.cuda.current_device()
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)  # torch internal
    if has_context is None or has_context(current):
        return current
    return next((i for i in range(torch.cuda.device_count()) if has_context(i)), current)


def context_mask() -> int:
    """The devices this process made a context on, as bits (``1 << index``): where a probe
    may run without making one (a context costs hundreds of MiB of its GPU); every visible
    device where this torch cannot tell."""
    count = torch.cuda.device_count()
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)  # torch internal
    if has_context is None:
        return (1 << count) - 1
    return sum(1 << i for i in range(count) if has_context(i))


def open_shared(index: int, handle: bytes, capacity: int, offset: int) -> Any:
    # torch internal: opens (or finds open) the allocation behind ``handle``; no
    # reference count (NO_COUNTER) and none of torch's events (the slab has its own: Slab.ready)
    return torch.UntypedStorage._new_shared_cuda(index, handle, capacity, offset, NO_COUNTER, 0, NO_EVENT, False)


VIEWS_KEPT = 32  # layouts kept per slab; more start the slab's set afresh


def view(views: Dict[Any, torch.Tensor], storage: Any, index: int, start: int, dtype: torch.dtype,
          shape: Tuple[int, ...], strides: Optional[Tuple[int, ...]] = None) -> torch.Tensor:
    """A ``dtype`` tensor of ``shape`` over ``storage`` from byte ``start``, contiguous or
    with ``strides`` (a dense layout: ``strides.kept_strides``): made once per slab and
    layout (``views``), so a message in a known layout costs one torch call per tensor."""
    key = (start, dtype, shape, strides)
    view = views.get(key)
    if view is None:
        if len(views) >= VIEWS_KEPT:
            views.clear()
        nbytes = torch.Size(shape).numel() * dtype.itemsize  # (a dense layout spans as many)
        # Never an inference tensor (one made under inference_mode could not be written
        # into outside it); writing into a normal one is allowed in either mode.
        with torch.inference_mode(False):
            raw = torch.empty(0, dtype=torch.uint8, device=device(index)).set_(storage)
            flat = raw[start:start + nbytes].view(dtype)
            view = flat.view(shape) if strides is None else flat.as_strided(shape, strides)
        views[key] = view
    return view


