"""Rows of inference requests: their shape signature, joining many into one batch, and
handing a batch's output rows back to each request.

A request's input is a tensor, a tuple of tensors, or a dict of tensors by name (a
gymnasium ``Dict`` observation: image and vector parts), with rows along dim 0. Requests
join one batch only when their *signatures* are equal: the same structure (the same keys,
in the same order), and per tensor the same trailing shape and dtype; only the row counts
differ. ``fn``'s output is a
tensor, a tuple or list of tensors, or a dict of tensors, each with one row per input row.
"""

from __future__ import annotations

from typing import Any, Dict, Hashable, List, Optional, Sequence, Tuple, Union, cast

import torch

__all__ = ["Inputs", "tensors_of", "check_inputs", "signature", "join", "split", "cuda_device", "nbytes", "to_device"]

Inputs = Union[torch.Tensor, Tuple[torch.Tensor, ...], Dict[str, torch.Tensor]]


_CPU = torch.device("cpu")


def tensors_of(x: Inputs) -> Tuple[torch.Tensor, ...]:
    """The tensors of a request's input, in order."""
    if isinstance(x, torch.Tensor):
        return (x,)
    return tuple(x.values()) if isinstance(x, dict) else x


def check_inputs(x: Any, param: str = "x") -> Tuple[Inputs, int]:
    """``x`` as sent (a tensor or a tuple of tensors) and its row count.

    Raises:
        TypeError: ``x`` is not a tensor or a non-empty tuple/list of tensors, or one is
            sparse.
        ValueError: a tensor has no dim 0, no rows, or the tensors' row counts differ.
    """
    if type(x) is torch.Tensor and x.layout == torch.strided and x.dim() and x.shape[0] and not x.requires_grad:
        return x, x.shape[0]  # the common request, checked in one line (a call costs ~1 ms)
    if isinstance(x, torch.Tensor):
        tensors: Tuple[torch.Tensor, ...] = (x,)
    elif isinstance(x, (tuple, list)) and x and all(isinstance(t, torch.Tensor) for t in x):
        tensors = tuple(x)
    elif isinstance(x, dict) and x and all(type(k) is str and isinstance(t, torch.Tensor) for k, t in x.items()):
        tensors = tuple(x.values())
    else:
        parts = list(x.values()) if isinstance(x, dict) else x if isinstance(x, (tuple, list)) else [x]
        arrays = any(type(t).__module__ == "numpy" for t in parts)
        keys = [k for k in x if type(k) is not str] if isinstance(x, dict) else []
        raise TypeError(f"{param} must be a tensor, a non-empty tuple of tensors or a non-empty dict of tensors by "
                        f"name (rows along dim 0), not {type(x).__name__}"
                        + (f" of {[type(t).__name__ for t in parts][:4]}" if isinstance(x, (tuple, list, dict)) else "")
                        + (f" (keys must be strings: {keys[:4]})" if keys else "")
                        + ("; convert numpy arrays with torch.from_numpy(x) (no copy)" if arrays else ""))
    for t in tensors:
        if t.layout != torch.strided:  # rows are joined and split along dim 0
            raise TypeError(f"{param} holds a {t.layout} tensor: the server batches dense rows; send x.to_dense()")
    rows = [t.shape[0] if t.dim() else -1 for t in tensors]
    if min(rows) < 1:
        raise ValueError(f"{param} has a tensor of shape {list(tensors[rows.index(min(rows))].shape)}: every "
                         f"tensor needs rows along dim 0 (at least one); add a batch dim with x.unsqueeze(0)")
    if len(set(rows)) > 1:
        raise ValueError(f"{param}'s tensors have different row counts {rows}: they must all have the same "
                         f"number of rows along dim 0")
    # requires_grad / autograd history would make RPC record distributed autograd.
    if any(t.requires_grad for t in tensors):
        tensors = tuple(t.detach() for t in tensors)
    if isinstance(x, dict):
        return dict(zip(x.keys(), tensors)), rows[0]
    return (tensors[0] if isinstance(x, torch.Tensor) else tensors), rows[0]


def signature(x: Inputs) -> Hashable:
    """What must agree for two requests to share a batch (everything but the row count)."""
    # (the device with its index: callers on cuda:0 and cuda:1 cannot share a torch.cat)
    if isinstance(x, torch.Tensor):
        return (tuple(x.shape[1:]), x.dtype, x.device)
    parts = tuple((tuple(t.shape[1:]), t.dtype, t.device) for t in tensors_of(x))
    return (tuple(x), parts) if isinstance(x, dict) else parts


def join(inputs: Sequence[Inputs]) -> Inputs:
    """One batch of the requests' rows, in order (the inputs share a signature)."""
    if len(inputs) == 1:
        return inputs[0]
    first = inputs[0]
    if isinstance(first, torch.Tensor):
        # (one signature: all tensors; a cast, as torch's stubs for cat differ by release)
        return torch.cat(cast(List[torch.Tensor], inputs))
    if isinstance(first, dict):
        dicts: Sequence[Dict[str, torch.Tensor]] = inputs  # type: ignore[assignment]  # (one signature: all dicts)
        return {key: torch.cat([x[key] for x in dicts]) for key in first}
    return tuple(torch.cat([x[i] for x in inputs]) for i in range(len(first)))  # type: ignore[index]


def _rows(value: Any, total: int, what: str) -> List[torch.Tensor]:
    tensors = list(value.values()) if isinstance(value, dict) else \
        list(value) if isinstance(value, (tuple, list)) else [value]
    bad = [type(t).__name__ for t in tensors if not isinstance(t, torch.Tensor)]
    if bad or not tensors:
        raise TypeError(f"{what} must return a tensor, or a tuple, list or dict of tensors, not "
                        f"{type(value).__name__}" + (f" holding {bad[:4]}" if bad else ""))
    wrong = [list(t.shape) for t in tensors if not t.dim() or t.shape[0] != total]
    if wrong:
        raise ValueError(f"{what} returned shapes {wrong} for {total} input rows: every output needs one "
                         f"row per input row along dim 0 (the server reads a request's dim 0 as its rows: send one "
                         f"sample as x.unsqueeze(0))")
    return tensors


def split(out: Any, counts: Sequence[int], what: str, devices: Sequence[Optional[torch.device]] = ()) -> List[Any]:
    """``out`` cut into one piece per request (``counts`` rows each), as CPU tensors, or
    on ``devices[i]`` for each request whose inputs came on that GPU (the reply moves them
    device to device through CUDA IPC on this host, see ``distributed._calls.cuda_ipc``);
    a device None, or absent: the CPU. Why the request's device and not the server's: a
    caller on cuda:1 served on cuda:0 mixes the output with its own tensors, and would
    need a context on cuda:0 (half a GiB) just to receive it.

    Pieces are copies when ``out`` is cut, so none of them drags the whole batch's
    storage along when it is sent.

    Raises:
        TypeError, ValueError: ``out`` is not tensors with one row per input row (naming
            ``what``, the callable).
    """
    total = sum(counts)
    if len(counts) == 1 and type(out) is torch.Tensor and out.dim() and out.shape[0] == total \
            and out.device.type == "cpu" and (not devices or devices[0] is None):
        return [out.detach() if out.requires_grad else out]  # one request, one tensor: the common call
    keep = any(device is not None for device in devices)
    tensors = [t.detach() if keep else t.detach().cpu() for t in _rows(out, total, what)]
    if len(counts) == 1:
        columns = [[t] for t in tensors]
    else:
        columns = [[piece.clone() for piece in torch.split(t, list(counts))] for t in tensors]
    pieces: List[Any] = []
    for i in range(len(counts)):
        row = [column[i] for column in columns]
        if keep:
            device = devices[i] if devices[i] is not None else _CPU
            row = [t if t.device == device else t.to(device) for t in row]
        if isinstance(out, dict):
            pieces.append(dict(zip(out.keys(), row)))
        elif isinstance(out, list):  # (as fn returned it: cold trial 29 got a tuple)
            pieces.append(row)
        elif isinstance(out, tuple):
            pieces.append(type(out)._make(row) if hasattr(out, "_make") else tuple(row))  # (a namedtuple stays one)
        else:
            pieces.append(row[0])
    return pieces


def cuda_device(x: Optional[Inputs]) -> Optional[torch.device]:
    """The GPU a request's inputs came on (its first CUDA tensor's; its outputs go back
    there); None: they came on the CPU."""
    if x is None:
        return None
    if isinstance(x, torch.Tensor):
        return x.device if x.is_cuda else None
    return next((t.device for t in tensors_of(x) if t.is_cuda), None)


def nbytes(x: Inputs) -> int:
    """Bytes of a request's tensors."""
    return x.nbytes if isinstance(x, torch.Tensor) else sum(t.nbytes for t in tensors_of(x))


def to_device(x: Inputs, device: Union[None, torch.device]) -> Inputs:
    if device is None:
        return x
    # Only a copy to a GPU may be left to run on: one from a GPU to the CPU (pinned) would
    # return before it finished, and the CPU model would read it at once.
    quick = device.type != "cpu"
    if isinstance(x, torch.Tensor):
        return x.to(device, non_blocking=quick)
    if isinstance(x, dict):
        return {key: t.to(device, non_blocking=quick) for key, t in x.items()}
    return tuple(t.to(device, non_blocking=quick) for t in x)

