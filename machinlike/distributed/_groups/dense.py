"""Contiguous stand-ins for the tensors of one collective, and the copy back of its results.

Why: gloo reads and writes a tensor's memory as if it were contiguous. A transposed or
sliced tensor (``x.t()[0]``, ``grad[:, 0]``) given to ``torch.distributed.all_reduce`` was
reduced wrong without a word (on torch 2.13, two members: ``[2, 1, 1, 1]`` for
``[2, 2, 2, 2]``). An op here runs on contiguous copies instead::

    tensor it reads only     ──► t.contiguous()                        (no copy when it is)
    tensor it writes         ──► a contiguous buffer (holding t's values when it reads
                                 them too), copied into t once the op is done: at once,
                                 or in the work handle's wait()

Owns no state beyond one op's buffers.
"""

from __future__ import annotations

from typing import Any, List, Tuple

import torch

__all__ = ["DenseStage"]


class DenseStage:
    """The contiguous stand-ins of one op (see the module docstring)."""

    __slots__ = ("_back",)

    def __init__(self) -> None:
        self._back: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (the user's tensor, its buffer)

    @staticmethod
    def read(tensor: Any) -> Any:
        """``tensor`` as the op may read it (anything else is passed on for torch to refuse)."""
        if isinstance(tensor, torch.Tensor) and not tensor.is_contiguous():
            return tensor.contiguous()
        return tensor

    def write(self, tensor: Any, reads: bool = True) -> Any:
        """A contiguous tensor for the op to write, copied into ``tensor`` by :meth:`done`;
        ``reads``: the op reads its values first (in place ops)."""
        if not isinstance(tensor, torch.Tensor) or tensor.is_contiguous():
            return tensor
        buffer = tensor.contiguous() if reads else torch.empty_like(tensor, memory_format=torch.contiguous_format)
        self._back.append((tensor, buffer))
        return buffer

    def writes(self, tensors: Any, reads: bool = False) -> Any:
        """:meth:`write` of each of ``tensors``, a list (None, or anything else, is passed on)."""
        if tensors is None or not isinstance(tensors, (list, tuple)):
            return tensors
        return [self.write(t, reads) for t in tensors]

    def done(self, work: Any, async_op: bool) -> Any:
        """What the op returns: ``work``, or one whose ``wait()`` also copies the results
        back; with ``async_op`` False the op has finished, so they are copied now."""
        if not self._back:
            return work
        if async_op and work is not None:
            return _CopiedBack(work, self._back)
        for tensor, buffer in self._back:
            tensor.copy_(buffer)
        return work


class _CopiedBack:
    """A work handle whose ``wait()`` copies the op's results into the caller's tensors."""

    def __init__(self, work: Any, back: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        self._work = work
        self._back = back
        self._copied = False

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        """As torch's ``Work.wait``, then the copy back (once)."""
        self._work.wait(*args, **kwargs)
        if not self._copied:
            for tensor, buffer in self._back:
                tensor.copy_(buffer)
            self._copied = True
        return True

    def is_completed(self) -> bool:
        # The results reach the caller's tensors in wait(): only then is it complete.
        return self._copied

    def __getattr__(self, name: str) -> Any:  # the rest of torch's Work (a receive's _source_rank())
        return getattr(self._work, name)
