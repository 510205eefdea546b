"""What a model's tensors look like (names, shapes, dtypes), and how two such lists differ.

The servers compare these *specs* at the client, before anything is sent or loaded, so a
gradient dict or state dict of another architecture is refused with a message that names
the offending entries instead of crashing a server thread or half-loading a model.
"""

from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Tuple

import sys

import torch

__all__ = ["Spec", "spec_of", "mismatch", "cast_loss", "uncastable", "loadable", "check_module", "unwrap"]

# name -> (shape, dtype)
Spec = Dict[str, Tuple[Tuple[int, ...], torch.dtype]]

_SHOWN = 6  # entries listed per kind of difference before "and N more"


def spec_of(tensors: Mapping[str, object]) -> Spec:
    """The spec of a name -> tensor mapping (a state dict, named parameters).

    Entries that are not tensors (a module's extra state) are left out.
    """
    return {name: (tuple(t.shape), t.dtype) for name, t in tensors.items() if isinstance(t, torch.Tensor)}


def _listed(names: List[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:_SHOWN])
    return shown + (f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


def mismatch(expected: Spec, got: Spec, expected_is: str, got_is: str, *, check_dtypes: bool = True) -> Optional[str]:
    """Describe how ``got`` differs from ``expected``; None when they agree.

    Args:
        expected, got: The two specs.
        expected_is, got_is: What each one is, for the message (e.g. ``"the server's model"``).
        check_dtypes: Compare dtypes too; False when the values will be converted (as
            ``load_state_dict`` does).
    """
    problems = []
    missing = [n for n in expected if n not in got]
    extra = [n for n in got if n not in expected]
    if missing:
        problems.append(f"{got_is} lacks {_listed(missing)}")
    if extra:
        problems.append(f"{got_is} has {_listed(extra)} that {expected_is} does not have")
    shapes = [f"{n!r}: {list(got[n][0])} instead of {list(s)}" for n, (s, _) in expected.items()
              if n in got and got[n][0] != s]
    dtypes = [f"{n!r}: {got[n][1]} instead of {d}" for n, (_, d) in expected.items()
              if check_dtypes and n in got and got[n][1] != d]
    if shapes:
        problems.append("shapes differ (" + "; ".join(shapes[:_SHOWN])
                        + (f"; and {len(shapes) - _SHOWN} more" if len(shapes) > _SHOWN else "") + ")")
    if dtypes:
        problems.append("dtypes differ (" + "; ".join(dtypes[:_SHOWN])
                        + (f"; and {len(dtypes) - _SHOWN} more" if len(dtypes) > _SHOWN else "") + ")")
    return "; ".join(problems) if problems else None


def cast_loss(source: torch.dtype, target: torch.dtype) -> Optional[str]:
    """What converting values of ``source`` to ``target`` would destroy; None when the
    cast keeps their meaning.

    The rules of the servers' casts: between floating dtypes, whatever the precision
    (float64 to float32 or bfloat16 rounds, as ``load_state_dict`` does), and from real
    to complex, a cast keeps the meaning. Complex to real would drop the imaginary part;
    floating or complex to an integer or bool dtype would truncate.
    """
    if source.is_complex and not target.is_complex:
        return "the imaginary part would be dropped"
    if (source.is_floating_point or source.is_complex) and not (target.is_floating_point or target.is_complex):
        return "the values would be truncated"
    return None


def uncastable(source: Mapping[str, torch.dtype], target: Mapping[str, torch.dtype]) -> Optional[str]:
    """List the entries of ``source`` whose cast to ``target``'s dtype of the same name
    would lose meaning (:func:`cast_loss`); None when every cast keeps it. Names absent
    from ``target`` are left out (:func:`mismatch` reports them)."""
    bad = [f"{n!r}: {d} to {target[n]}, {cast_loss(d, target[n])}" for n, d in source.items()
           if n in target and cast_loss(d, target[n]) is not None]
    if not bad:
        return None
    return "; ".join(bad[:_SHOWN]) + (f"; and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else "")


def loadable(source: Spec, target: Spec, source_is: str, target_is: str) -> Optional[str]:
    """How ``source``'s values fail to load into ``target`` as ``load_state_dict`` would
    load them (names and shapes must agree, dtypes are cast unless :func:`cast_loss`
    objects); None when they load."""
    diff = mismatch(source, target, source_is, target_is, check_dtypes=False)
    if diff is not None:
        return diff
    lossy = uncastable({n: d for n, (_, d) in source.items()}, {n: d for n, (_, d) in target.items()})
    return None if lossy is None else f"values cannot be cast to {target_is}'s dtypes ({lossy})"


def check_module(model: object, param: str = "model") -> torch.nn.Module:
    """Refuse anything but an ``nn.Module`` with a TypeError naming the parameter."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{param} must be a torch.nn.Module, not {type(model).__name__}")
    return model


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose tensors a server moves: ``model`` without the wrappers that only
    prefix its names (``torch.compile``'s ``_orig_mod.``, ``DistributedDataParallel``'s and
    ``DataParallel``'s ``module.``).

    Why: a learner compiles or wraps its model while actors and servers run it plain; the
    names a server compares and loads must be the same on both sides.
    """
    parallel = (torch.nn.parallel.DistributedDataParallel, torch.nn.DataParallel)
    while True:
        if isinstance(model, parallel):
            model = model.module
            continue
        # Only a process that imported dynamo can hold a compiled module: no import here.
        dynamo = sys.modules.get("torch._dynamo.eval_frame")
        if dynamo is not None and isinstance(model, dynamo.OptimizedModule):
            model = model._orig_mod
            continue
        return model
