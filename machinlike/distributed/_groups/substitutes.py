"""Collectives a backend lacks, or is slower at, built from ones it has.

Why: gloo's set of collectives grew release by release (``alltoall`` came to gloo in
torch 2.12, ``reduce_scatter`` in 2.8), and a CollectiveGroup offers every collective on
every backend it runs on. The backend is asked first, unless it is known to be slower at
the op (gloo's alltoall: see ``collective._SLOWER``); its refusal (raised before anything
is sent, the same on every member, so every member falls back alike) is remembered by the
caller, and the op is then made of others::

    all_to_all      ─► one isend + one irecv per peer, on a reserved tag
    reduce_scatter  ─► one all_reduce of every piece, laid end to end; each member keeps
                       its own piece of the result (size() times the data of a native
                       reduce_scatter on the wire: the price of running at all)

Each returns a handle whose ``wait()`` finishes the op, as torch's work handles do.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["ALL_TO_ALL_TAG", "lacks", "real", "wait_works", "PairwiseAllToAll", "ReduceScatterByAllReduce"]

# The point-to-point tag of the pairwise all_to_all (a value user code is unlikely to
# pick), so that its pieces never match a user's receive.
ALL_TO_ALL_TAG = 5000000


def lacks(exc: BaseException, op: str) -> bool:
    """Whether ``exc`` is a backend saying it has no ``op`` (torch's c10d words it as
    "Backend gloo does not support alltoall", older gloo as "ProcessGroupGloo does not
    support reduce_scatter"; some builds say "unsupported"). ``op``: the name without
    underscores, as the backends spell it (``"alltoall"``, ``"reducescatter"``)."""
    text = str(exc).lower()
    return op in text.replace("_", "") and ("not support" in text or "unsupported" in text)


def wait_works(works: Sequence[Any], timeout: Optional[timedelta]) -> None:
    """``wait()`` on each of torch's ``works`` in turn, all within ``timeout`` (None: each
    within the group's own), so that this package's handles take ``wait(timeout=)`` as
    torch's do (they refused it with TypeError; cold trial 27).

    Raises:
        RuntimeError: as torch's ``Work.wait``: a work failed, or the timeout passed.
    """
    if timeout is None:
        for work in works:
            if work is not None:  # (torch 2.14's stubs type a Work as Optional)
                work.wait()
        return
    deadline = time.monotonic() + timeout.total_seconds()
    for work in works:
        if work is not None:
            # (a zero timedelta would be torch's "no timeout given": one millisecond is the least left)
            work.wait(timedelta(seconds=max(0.001, deadline - time.monotonic())))


def real(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or its real view when it is complex (as torch's own collectives send it)."""
    return torch.view_as_real(tensor) if tensor.is_complex() else tensor


class PairwiseAllToAll:
    """all_to_all as one send and one receive per peer; ``wait()`` completes it.

    Pieces for this member itself are copied locally. Where the backend is gloo, which
    sends CPU tensors only on some builds, CUDA pieces travel as CPU copies and are
    copied into the outputs in ``wait()``. Every tensor is contiguous (the caller's
    ``DenseStage`` stands in for those that are not).
    """

    def __init__(self, outputs: List[torch.Tensor], inputs: List[torch.Tensor], group: Any,
                 ranks: List[int], my_rank: int) -> None:
        stage = dist.get_backend(group) == "gloo"
        self._copy_back: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (output, CPU buffer) filled by receives
        self._works: List[Any] = []
        for peer, out, inp in zip(ranks, outputs, inputs):
            if peer == my_rank:
                out.copy_(inp)
                continue
            send = inp.cpu() if stage and inp.device.type != "cpu" else inp
            recv = out  # (contiguous, as the caller's DenseStage hands it)
            if stage and out.device.type != "cpu":
                recv = torch.empty(out.shape, dtype=out.dtype)
                self._copy_back.append((out, recv))
            self._works.append(dist.isend(real(send), peer, group=group, tag=ALL_TO_ALL_TAG))
            self._works.append(dist.irecv(real(recv), peer, group=group, tag=ALL_TO_ALL_TAG))
        self._done = False

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Block until every piece was sent and received, within ``timeout`` (None: the group's)."""
        wait_works(self._works, timeout)
        if not self._done:
            for out, buffer in self._copy_back:
                out.copy_(buffer)
            self._done = True
        return True

    def is_completed(self) -> bool:
        # Staged pieces reach their outputs in wait(), so only then is it complete.
        return self._done or (not self._copy_back and all(work.is_completed() for work in self._works))


class ReduceScatterByAllReduce:
    """reduce_scatter as one all_reduce of the pieces laid end to end; ``wait()`` copies
    this member's reduced piece into ``output``.

    ``inputs``: one piece per member in rank order, each of ``output``'s dtype and number
    of elements (the caller checked); ``index``: this member's place in that order.
    """

    def __init__(self, output: torch.Tensor, inputs: List[torch.Tensor], op: Any, group: Any, index: int) -> None:
        # (a new tensor: all_reduce writes its result over its input, the caller's pieces stay)
        self._flat = torch.cat([piece.reshape(-1) for piece in inputs])
        self._output, self._index = output, index
        self._work = dist.all_reduce(real(self._flat), op=op, group=group, async_op=True)
        self._done = False

    def wait(self, timeout: Optional[timedelta] = None) -> bool:
        """Block until the reduction is done, within ``timeout`` (None: the group's), then
        fill ``output``."""
        wait_works([self._work], timeout)
        if not self._done:
            count = self._output.numel()
            piece = self._flat[self._index * count:(self._index + 1) * count]
            self._output.copy_(piece.view(self._output.shape))
            self._done = True
        return True

    def is_completed(self) -> bool:
        # The piece reaches the output in wait(), so only then is it complete.
        return self._done
