"""One export slab of the CUDA IPC path: a long-lived ``uint8`` CUDA buffer exported once
through torch's ``_share_cuda_``, with the IPC event that follows each message's copies
into it (``cuda_ipc_area`` lends slabs; ``cuda_ipc_ops`` copies into and out of them).

Why a slab is made once and kept: an export wraps the memory in one more counted
context, and opening its handle costs a receiver milliseconds; kept, a slab is opened once
by each receiver and lent again and again.
"""

from __future__ import annotations

import time
from typing import Any, Dict, Optional, Tuple

import torch

__all__ = ["GRAIN", "SETTLE_WAIT_S", "Slab", "slab_capacity", "segment_bytes"]

GRAIN = 2 << 20  # lent slabs hold whole powers of two from 2 MiB (they recycle well); pinned ones 2 MiB steps
# Seconds ``Slab.settle_writes`` waits at most by default for copies queued into a slab
# (milliseconds, unless the device is stuck or far behind: then the slab's memory is kept).
SETTLE_WAIT_S = 30.0


def slab_capacity(nbytes: int) -> int:
    """The capacity, in bytes, of a slab for ``nbytes``: a power of two, at least 2 MiB."""
    capacity = GRAIN
    while capacity < nbytes:
        capacity <<= 1
    return capacity


def segment_bytes(base: int, index: int, fallback: int) -> int:
    """Bytes a receiver maps when it opens a handle of the allocator segment that starts at
    address ``base`` of ``cuda:index``: the whole segment (torch exports a block through its
    segment's handle, and the driver maps a handle's whole allocation), which the caching
    allocator may make far larger than the block (a 2 MiB slab in a 20 MiB segment, or in a
    large one freed earlier). ``fallback`` (the slab's own bytes) where torch does not say:
    an expandable segment, or a snapshot that fails."""
    try:
        for segment in _segments():
            if segment.get("device") == index and segment.get("address") == base:
                return fallback if segment.get("is_expandable") else max(int(segment["total_size"]), fallback)
    except Exception:  # (a snapshot is torch's diagnostics: nothing of the path may fail with it)
        pass
    return fallback


def _segments() -> Any:
    try:
        # No trace entries: with a user's memory history on, converting them costs up to
        # seconds, under the export area's lock (an older torch lacks the keyword; some
        # builds of its first releases refused the pool id it packs with it: pytorch#174044).
        return torch.cuda.memory_snapshot(include_traces=False)
    except Exception:
        return torch.cuda.memory_snapshot()


class Slab:
    """One exported CUDA buffer of the area; ``views``: tensors over it by layout, made
    once (``cuda_ipc_ops.view``: a message's Python work is a few torch calls, not a dozen);
    ``ready``: an interprocess event recorded after each message's copies into it (its
    handle ``ready_handle`` goes with the message; None and b"" where this torch or
    driver has no IPC events: the sender synchronises before sending instead); ``mapped``:
    the bytes a receiver's opening maps (``segment_bytes``), what receivers' caches count."""

    __slots__ = ("slot", "ident", "index", "storage", "capacity", "handle", "offset", "counter", "views",
                 "ready", "ready_handle", "unsent", "mapped")

    def __init__(self, slot: int, ident: int, index: int, capacity: int) -> None:
        self.slot = slot
        self.ident = ident
        self.index = index
        self.capacity = capacity
        self.storage = torch.empty(capacity, dtype=torch.uint8, device=torch.device("cuda", index)).untyped_storage()
        # Torch internal, absent from its stubs. Called once per slab: each call wraps the
        # storage's memory in one more reference-counted context.
        shared = self.storage._share_cuda_()
        self.handle: bytes = shared[1]
        self.offset: int = shared[3]
        self.counter: Tuple[bytes, int] = (shared[4], shared[5])
        # Once per slab (a snapshot lists every segment of the process: milliseconds at most)
        self.mapped = segment_bytes(self.storage.data_ptr() - self.offset, index, capacity)
        self.views: Dict[Any, torch.Tensor] = {}
        self.ready: Optional[torch.cuda.Event] = None
        self.ready_handle = b""
        self.unsent = False  # ended by this side after copies into it: the next writer waits for them
        try:
            with torch.cuda.device(index):  # (an event not yet recorded takes the current device)
                event = torch.cuda.Event(interprocess=True)
                self.ready_handle = event.ipc_handle()
            self.ready = event
        except Exception:  # no IPC events here (ready stays None): the sender synchronises instead
            pass

    def settle_writes(self, timeout: float = SETTLE_WAIT_S) -> bool:
        """Wait, ``timeout`` seconds at most, until every copy queued into this slab has
        run (one retired while a message that ended early may still be writing it).
        Returns whether they ran: False, they may still be queued (behind a stuck
        collective, say), and the caller must keep the memory.

        Its ``ready`` follows the last message's copies (recorded after them; where they
        failed, the device was synchronised there: ``cuda_ipc``), as the next writer's
        ``after_writes`` relies on too. So this waits for those copies alone, not for
        the whole device (a learner's queued step), under the area's lock; polled, so
        that a device that never gets there stalls the area's lock ``timeout`` at most.
        Without IPC events, the whole device (unbounded: torch has no timed wait for it)."""
        ready = self.ready
        if ready is None:
            torch.cuda.synchronize(torch.device("cuda", self.index))
            return True
        deadline = time.monotonic() + timeout
        pause = 20e-6
        with torch.cuda.device(self.index):  # (a thread on no device yet would make a context on cuda:0)
            while not ready.query():
                if time.monotonic() >= deadline:
                    return False
                time.sleep(pause)
                pause = min(2 * pause, 0.002)
        return True

    def settled(self) -> bool:
        """Whether the copies queued into this slab have all run, without waiting (see
        ``settle_writes``); True where it has no IPC event (it was synchronised then)."""
        ready = self.ready
        if ready is None:
            return True
        with torch.cuda.device(self.index):
            return bool(ready.query())
