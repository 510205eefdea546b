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
    """``key`` if the host can find it again: hashable, and equal to its copy.

    Raises:
        TypeError: not hashable, or a tensor (hashed by identity: each push's copy on the
            host is a new key that no pull reaches, cold trial 29), also inside a tuple.
        ValueError: a float NaN (it equals nothing, its copy included).
    """
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"key must be hashable (e.g. a str), not {type(key).__name__}") from None
    _same_on_the_host(key, key)
    return key


def _same_on_the_host(part: Any, key: Any) -> None:
    if isinstance(part, torch.Tensor):
        raise TypeError(f"key={key!r} holds a tensor, which hashes by identity: the copy the host gets is a new "
                        f"key on every call and no pull would find it; use a number (tensor.item()) or a str")
    if isinstance(part, (float, complex)) and part != part:
        raise ValueError(f"key={key!r} holds nan, which equals nothing, its copy on the host included: no pull "
                         f"would find it; use a str or a number")
    if isinstance(part, (tuple, frozenset)):
        for item in part:
            _same_on_the_host(item, key)


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
