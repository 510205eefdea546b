"""What an ordered server takes as a key and a version, and what it gives back as a value.

Why apart from the server: these are pure (no server state); the accessor checks keys and
versions before anything is sent, and the host copies what a caller outside its own
pullers must not share with it.
"""

from __future__ import annotations

from typing import Any, Hashable

import torch

from .. import _shm

__all__ = ["check_key", "check_version", "private"]


def check_key(key: Any) -> Hashable:
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"key must be hashable (e.g. a str), not {type(key).__name__}") from None
    return key


def check_version(version: Any) -> Any:
    """``version`` unless it is a float NaN: it equals nothing, itself included, so a key
    pushed with it could never be pushed on again (every ``prev_version`` mismatches)."""
    if isinstance(version, float) and version != version:
        raise ValueError("version=nan equals nothing, itself included: a key pushed with it could never be "
                         "updated again; use an int (or any value equal to itself)")
    return version


def private(value: Any) -> Any:
    """A pulled ``value`` with the tensors of memory its host rewrites (a model or gradient
    server's reused storages, ``_shm.recycled``) copied: outside its own pullers, a value
    pulled is the caller's, and nothing done to it reaches the server. (Copied outside the
    server's lock: the value's reference keeps its memory from being rewritten.)"""
    if not isinstance(value, dict):
        return value
    rewritten = [name for name, item in value.items()
                 if isinstance(item, torch.Tensor) and _shm.recycled.sequence(item.untyped_storage()) is not None]
    return {**value, **{name: value[name].clone() for name in rewritten}} if rewritten else value
