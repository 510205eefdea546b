"""CUDA tensors through RpcGroup calls without device maps: staged through pinned CPU memory.

torch's TensorPipe agent refuses a CUDA tensor unless a device map for that pair of
processes was fixed when both agents started; an elastic world cannot know its members'
devices then, and hand-written maps are easy to get wrong. So machinlike stages instead:
the sender copies each CUDA tensor of a call's arguments (or a service's result) into
pinned CPU memory and sends it, tagged with its device index, as a CPU tensor; the
receiver puts it back::

    sender (CUDA initialised here)                receiver
    outgoing / reply: one walk over the call's    unpickling: staging._land(host, index, ...)
    containers and dataclass-like objects           this process initialised CUDA and
      cuda:i tensor ─► pinned copy ─► _Staged ───►    sees cuda:i?  yes ─► on cuda:i
      CPU tensor ─► same-host placeholder (when                     no  ─► stays on the CPU
                    the peer shares this host)
    (a process that never initialised CUDA holds no CUDA tensor: it skips all of this)

Why the receiver's own CUDA state decides: a CPU actor on a GPU machine must not get a
CUDA context (hundreds of MB of GPU memory) because a learner sent it a tensor. Why
staging and not torch's device maps: maps are fixed per agent at its start and need every
peer's devices then; staging works for any pair at any time, at the price of two copies
(device to host, host to device). Between processes of one host that use the same GPUs,
``cuda_ipc`` replaces staging (``staging`` stays the fallback) (the walk hands it those tensors: ``encode``'s ``ipc``).

Limits, stated in the docs: tensors are found where the same-host path finds them
(lists, tuples, dicts, namedtuples, objects pickled by their ``__dict__``: see
``_shm._walk``), not inside objects that pickle their own way; views of one CUDA storage arrive
as separate tensors; ``requires_grad`` is kept, autograd history (distributed autograd)
is not.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from ..._shm import Pack, walk
from ..._shm import guard as _shm_guard
from ..._shm._segments import Segment
from ..._shm import encode_array as _shm_encode_array
from ..._shm import encode_tensor as _shm_encode_tensor
from . import cuda_ipc as _cuda_ipc
from .staging import lands_on, stage_tensor

__all__ = ["active", "encode", "outgoing", "walk", "stage_tensor", "lands_on"]


# active() -> bool: whether this process may hold CUDA tensors (it initialised CUDA).
# Every CUDA tensor, made here or received through CUDA IPC, initialises CUDA first, so a
# CPU-only process answers False and its calls skip staging altogether. torch's own
# function itself, not a wrapper: every call and reply asks it (tens of ns).
active = torch.cuda.is_initialized


def encode(obj: Any, shm_threshold: int, ipc: Optional[Tuple[int, int]] = None, receiver: int = 0) -> Any:
    """``obj`` with its CUDA tensors through CUDA IPC (``ipc`` given) or staged and, when
    ``shm_threshold`` > 0, its large CPU tensors as same-host placeholders: all in one walk.

    Args:
        shm_threshold: Bytes from which a CPU tensor goes through shared memory; 0: the
            peer is not on this host (CPU tensors stay as they are).
        ipc: ``(device key, pid)`` of a receiver that takes CUDA tensors through IPC
            (``_cuda_ipc``); None: they are staged.
        receiver: The receiver's identity word (``machinlike._pids``): segments it has not
            taken come back when it dies (``_shm.guard``); 0: unknown.

    Returns:
        ``obj`` itself when nothing was replaced. The copies are complete. Wrapped as
        ``_shm.encode`` wraps it when segments were lent.
    """
    out, lent, leases = _encode(obj, shm_threshold, ipc)
    return _shm_guard((out,), lent, leases, receiver)[0]


def _encode(obj: Any, shm_threshold: int, ipc: Optional[Tuple[int, int]]
            ) -> Tuple[Any, List[Segment], List[Callable[[], None]]]:
    """:func:`encode`'s object, unwrapped, the segments lent for it, and the ends of its
    CUDA IPC leases (for a message that is never pickled whole: ``_shm.guard``)."""
    pending: List[torch.device] = []
    batch: Optional[_cuda_ipc.Batch] = None
    refs: List[Any] = []
    pack = Pack(shm_threshold) if shm_threshold else None  # medium CPU tensors and arrays: one segment

    def leaf(tensor: torch.Tensor) -> Any:
        nonlocal batch
        if tensor.device.type == "cuda":
            if ipc is not None and _cuda_ipc.eligible(tensor):  # [cuda ipc hook]
                if batch is None:
                    batch = _cuda_ipc.Batch(ipc)
                ref = batch.add(tensor)
                refs.append(ref)
                return ref
            return stage_tensor(tensor, pending)
        if shm_threshold:
            return _shm_encode_tensor(tensor, shm_threshold, pack)
        return tensor

    out = walk(obj, leaf, None, (lambda array: _shm_encode_array(array, shm_threshold, pack)) if shm_threshold else None)
    if pack is not None:
        pack.commit()
    leases: List[Callable[[], None]] = []
    if batch is not None:  # one slab per device; a device without one stages (counted)
        leases = [_cuda_ipc.unsent_release(lease) for lease in batch.commit(refs, stage_tensor, pending)]
    try:
        for device in pending:  # the copies were queued on each device's current stream
            torch.cuda.current_stream(device).synchronize()
    except BaseException:  # (a CUDA error) the message never leaves: its leases end here
        for end in leases:
            end()
        raise
    return out, ([] if pack is None else pack.lent), leases


def outgoing(call: Tuple[Any, Any, Any], shm_threshold: int, ipc: Optional[Tuple[int, int]] = None,
             receiver: int = 0, due: Optional[float] = None) -> Tuple[Any, ...]:
    """``(what, args, kwargs, reply terms)``: ``_samehost.outgoing`` for a process that
    initialised CUDA. The terms ask the callee to reply through shared memory from
    ``shm_threshold`` bytes and, with ``ipc``, CUDA tensors through IPC (``_cuda_ipc.terms``),
    lending nothing once ``due`` (the call's deadline, ``time.monotonic()``; None: none)
    passed. ``receiver``: as for :func:`encode`."""
    what, args, kwargs = call
    leases: List[Callable[[], None]] = []
    if args or kwargs:  # one walk: one slab per device, one copy of a tensor found twice
        both, lent, leases = _encode((args, kwargs), shm_threshold, ipc)
        args, kwargs = _shm_guard(both, lent, leases, receiver)
    if ipc is not None and not leases:
        # A call that sends no CUDA tensor through IPC (a pull, a request for actions) asks
        # for the callee's: the leases this process holds of its slabs end first, so that
        # its reply finds the last one FREE. Not a call that sends some: the callee reads
        # them only after this process's copies out, which its slab's event follows, ran.
        _cuda_ipc.before_call(ipc[1])
    return (what, args, kwargs, _cuda_ipc.terms(shm_threshold, ipc, due))
