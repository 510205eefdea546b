"""CUDA streams made outside torch's stream pool, for the background chores of this package.

Why: ``torch.cuda.Stream()`` deals out, in turn, one of a pool of 32 streams per device,
so a stream made for a chore (copying out of a peer's memory, freeing an opening of it)
may be the very stream a user's side stream got, with the user's work queued on it: a
wait for the chore would wait that work out too. The driver makes one nobody else is
handed, non-blocking as torch's pooled ones are. Not the runtime's ``cudaStreamCreate``
(which torch binds): its streams are blocking, so a wait on one waits for whatever the
legacy default stream holds (a learner's step), the very wait a chore's stream avoids.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

__all__ = ["own_stream"]

_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING


def own_stream(index: int) -> Any:
    """A new non-blocking stream of ``cuda:index`` that torch hands nobody else (an
    ``ExternalStream``; never destroyed: make one per chore and keep it). A pooled one
    where the driver cannot be reached."""
    with torch.cuda.device(index):
        try:
            torch.cuda.current_stream().query()  # (a runtime call: the device's context is this thread's)
            made = ctypes.c_void_p()
            if ctypes.CDLL("libcuda.so.1").cuStreamCreate(ctypes.byref(made), ctypes.c_uint(_NON_BLOCKING)) == 0 \
                    and made.value:
                return torch.cuda.ExternalStream(made.value, device=torch.device("cuda", index))
        except Exception:  # (no driver library by that name, or no context)
            pass
        return torch.cuda.Stream(device=index)
