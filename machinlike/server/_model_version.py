"""A model's place on a server's version chain, and whether it still holds that version.

::

    push / pull loaded version v ──> model.<attr> = v, and a mark beside it:
                                      (v, the chain, each tensor's in-place write count)
    next pull ──> held_version(): v   if the mark still fits: nothing is transferred
                                  None if the tensors were written since (an optimizer
                                       step, a fill_, a load), or v came from another
                                       chain: the newest is loaded whole

Why the mark: machin's pull always loaded the newest state; ours skips the transfer when
the model has the newest version. Without a mark a model edited in place after its pull
(a diverged step to be undone, a reset) kept its edits through every later pull, in
silence. torch counts every in-place write to a tensor (``Tensor._version``), so telling
"still holds v" costs one read per tensor. A write through ``.data`` is not counted (torch
gives ``.data`` a counter of its own): such a model should drop its version
(``vars(model).pop("pp_version")``) to be pulled whole.

Why two attributes: ``pp_version`` is the model server's (machin's name); the gradient
server, which machin gave no version, keeps ``pp_grad_version``, so a model that pulls
from a gradient server and pushes to a model server (a learner publishing to its actors)
pushes on top of the model server's version, not the gradient server's.
"""

from __future__ import annotations

from typing import Dict, Iterable, Optional, Tuple

import torch

__all__ = ["VERSION_ATTR", "GRAD_VERSION_ATTR", "get_version", "set_version", "held_version"]

VERSION_ATTR = "pp_version"
GRAD_VERSION_ATTR = "pp_grad_version"
_MARKS = "_machinlike_version_marks"  # {attr: (version, chain, fingerprint)}

Fingerprint = Optional[Tuple[Tuple[int, int], ...]]


def get_version(model: torch.nn.Module, attr: str = VERSION_ATTR) -> Optional[int]:
    """The model's version (``model.<attr>``), None if it has none.

    Raises:
        TypeError: it is set to something else than an int or None (named, with the fix).
    """
    version = getattr(model, attr, None)
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)):
        raise TypeError(f"model.{attr}={version!r} must be an int (the version push and pull set) or None; "
                        f"set it to None to pull the newest version whole")
    return version


def _fingerprint(tensors: Iterable[torch.Tensor]) -> Fingerprint:
    try:
        return tuple((id(t), t._version) for t in tensors)
    except RuntimeError:  # (an inference-mode tensor counts no writes: nothing to tell by)
        return None


def set_version(model: torch.nn.Module, version: Optional[int], attr: str = VERSION_ATTR, chain: str = "",
                tensors: Iterable[torch.Tensor] = ()) -> None:
    """Set ``model.<attr>`` to ``version`` and mark the state of ``tensors`` it holds now.

    Args:
        version: The version the model now holds; None: a mix of versions.
        chain: Names the server's chain the version belongs to.
        tensors: The tensors a pull loads (their write counts are kept).
    """
    # Plain attributes (not buffers): they must not enter the state dict.
    object.__setattr__(model, attr, version)
    marks: Dict[str, Tuple[int, str, Fingerprint]] = vars(model).setdefault(_MARKS, {})
    if version is None:
        marks.pop(attr, None)
    else:
        marks[attr] = (version, chain, _fingerprint(tensors))


def held_version(model: torch.nn.Module, attr: str, chain: str, tensors: Iterable[torch.Tensor]) -> Optional[int]:
    """The version a pull from ``chain`` may take the model to hold: ``model.<attr>``,
    or None when its tensors were written in place since it was set, or it was set by
    another chain's push or pull. A version set by hand (no mark, or another number
    than the mark's) is taken as it is.

    Raises:
        TypeError: ``model.<attr>`` is not an int or None.
    """
    version = get_version(model, attr)
    mark = vars(model).get(_MARKS, {}).get(attr)
    if version is None or mark is None or mark[0] != version:
        return version
    _, made_by, fingerprint = mark
    if made_by != chain:
        return None
    if fingerprint is not None and fingerprint != _fingerprint(tensors):
        return None
    return version
