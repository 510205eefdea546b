"""What the gradient server's reducers pass around, and the sum they compute.

Owns no state: :class:`Item` (one queued unit: gradients, how many pushes, their
versions, their origin), :func:`reduce_items` (the sum every reducer computes, in the
gradients' accumulation dtype) and two helpers for the futures reducers hand out::

    client push ──► Item(grads, 1, [version], origin)
    reduce_items([Item, ...]) ──► Item(sum, total count, all versions, origins added)
      (secondary: forwarded to the primary; primary: ManagedModel.apply)

Every gradient dict of a batch adds into the first one (all queued tensors belong to the
reducer: received through RPC, or cloned by a local client), in the gradient's dtype,
float16/bfloat16 in float32; a sparse (COO) gradient, as ``nn.Embedding(sparse=True)``
makes, stays sparse through the sums (coalesced). A secondary forwards ``(sum, count, versions)``; the
primary sums those, and for "mean" divides by the total count once (in ``_grad.primary``).

Why apart from ``_grad.reducer``: the reducers' state machine (queues, thread, flushes) and
the maths of a batch change for different reasons; ``_grad.primary`` and the accessor
use these without the state machine.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ...exception import copy_to_raise
from .._finite import accumulation_dtype

__all__ = ["Grads", "Item", "accumulation_dtype", "reduce_items", "takes_sparse", "wait_future", "completed"]

Grads = Dict[str, torch.Tensor]


@dataclass(frozen=True)
class Item:
    """One queued unit: a gradient dict (or partial sum), how many pushes it holds, the
    parameter versions those pushes were computed on (-1: unknown), and, in an elastic
    world, how many pushes of each (source, client) it holds (see ``_churn``; None: not
    counted)."""

    grads: Grads
    count: int
    versions: List[int]
    origin: Optional[Dict[Tuple[str, str], int]] = None


def reduce_items(items: Sequence[Item], device: torch.device) -> Item:
    """Sum the gradient dicts of ``items`` into one (consuming their tensors).

    A name missing from a dict contributes zero (a client pushed ``none_as_zero``).
    """
    total: Grads = {}
    count = 0
    versions: List[int] = []
    origin: Optional[Dict[Tuple[str, str], int]] = None
    for item in items:
        if item.origin is not None:
            origin = {} if origin is None else origin
            for key, n in item.origin.items():
                origin[key] = origin.get(key, 0) + n
        for name, grad in item.grads.items():
            grad = grad.to(device)
            held = total.get(name)
            if held is None:
                wanted = accumulation_dtype(grad.dtype)
                total[name] = grad if grad.dtype == wanted else grad.to(wanted)
            elif held.layout == torch.strided or grad.layout != torch.strided:
                held.add_(grad)  # dense + dense or sparse, sparse + sparse
            else:  # torch adds a dense tensor into a sparse one only out of place
                total[name] = grad.to(held.dtype).add_(held)
        count += item.count
        versions.extend(item.versions)
    for name, grad in total.items():
        if grad.layout == torch.sparse_coo:  # duplicate rows summed: what travels on stays small
            total[name] = grad.coalesce()
    return Item(total, count, versions, origin)


def takes_sparse(optimizer: Any) -> bool:
    """Whether ``optimizer`` steps on sparse gradients as they are: torch's ``SparseAdam``,
    and its ``SGD`` and ``Adagrad`` without weight decay (with it, they raise on one).

    Any other optimizer gets a sparse gradient made dense: right for every optimizer, at
    the cost of a dense gradient (``Adam``, ``RMSprop`` and others raise on a sparse one,
    and on the primary's thread that would stop the server).
    """
    kind = type(optimizer)
    if kind is torch.optim.SparseAdam:
        return True
    if kind is torch.optim.SGD or kind is torch.optim.Adagrad:
        return all(not group.get("weight_decay") for group in optimizer.param_groups)
    return False


def wait_future(fut: torch.futures.Future, timeout: float, what: str) -> Any:
    """``fut.wait()`` bounded by ``timeout`` seconds (torch's own wait has no timeout); its
    error raised as a copy (one error may fail many futures: see ``copy_to_raise``)."""
    done = threading.Event()
    fut.add_done_callback(lambda _: done.set())
    if not done.wait(timeout):
        raise TimeoutError(f"{what} did not complete within {timeout:g} s")
    try:
        return fut.wait()
    except BaseException as kept:
        error = copy_to_raise(kept)
    raise error


def completed(value: Any = None, error: Optional[BaseException] = None) -> torch.futures.Future:
    """A future already completed with ``value``, or failed with ``error`` when given."""
    fut: torch.futures.Future = torch.futures.Future()
    if error is None:
        fut.set_result(value)
    else:
        fut.set_exception(error)
    return fut
