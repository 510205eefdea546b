"""Argument checks shared by the assigner's public classes (messages name the argument,
the constraint and the fix)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from typing import Any, Optional, Sequence

import numpy as np
import torch

__all__: list[str] = []


def _check_number(value: object, name: str, *, positive: bool = False) -> float:
    """Returns ``value`` as a float after checking it is a finite number >= 0 (> 0)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be a finite number {bound}, got {value!r}")
    return value


def _check_int(value: object, name: str, minimum: int) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


def _check_models(models: object) -> list[torch.nn.Module]:
    if isinstance(models, torch.nn.ModuleList):  # (a list of models that is a module too)
        models = list(models)
    if isinstance(models, torch.nn.Module) or not isinstance(models, Sequence):
        raise TypeError(f"models must be a list of nn.Module, got {type(models).__name__}")
    if not models:
        raise ValueError("models is empty; pass at least one model to place")
    for i, model in enumerate(models):
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"models[{i}] must be an nn.Module, got {type(model).__name__}")
    return list(models)


def _check_moved_once(models: Sequence[torch.nn.Module]) -> None:
    """Raise ValueError if one module is listed twice for moving: it is on one device, so
    it would end up at the last of its places while ``assignment`` lists both. (A plan
    alone may list a module as the template of several copies.)"""
    seen: dict[int, int] = {}
    for i, model in enumerate(models):
        first = seen.setdefault(id(model), i)
        if first != i:
            raise ValueError(f"models[{i}] is the same module as models[{first}], and move_models=True would move "
                             f"it twice (it ends up on one device only); pass each model once, or plan with "
                             f"move_models=False")
    # A tensor shared between two models (a shared encoder, tied weights) is on one device
    # too: moving the second model took it from the first, which was then split across
    # devices while ``assignment`` said otherwise (cold trial 27).
    owner: dict[int, tuple[int, str]] = {}
    for i, model in enumerate(models):
        for name, tensor in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
            first_owner = owner.setdefault(id(tensor), (i, name))
            if first_owner[0] != i:
                raise ValueError(f"models[{i}] shares {name!r} with models[{first_owner[0]}] ({first_owner[1]!r}): a "
                                 f"shared tensor is on one device, so move_models=True would split one of them across "
                                 f"devices; pass the models that share modules as one model (an nn.ModuleDict), or "
                                 f"plan with move_models=False and place them yourself")


def _connection_matrix(model_connection: Any, n: int) -> np.ndarray:
    """``model_connection`` (dict of pairs or ``[n, n]`` matrix) as an ``[n, n]`` array."""
    if isinstance(model_connection, Mapping):
        conn = np.zeros((n, n))
        for key, weight in model_connection.items():
            if (
                not isinstance(key, tuple) or len(key) != 2
                or not all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in key)
            ):
                raise TypeError(
                    "model_connection keys must be (source, target) pairs of model "
                    f"indices, got {key!r}"
                )
            src, dst = int(key[0]), int(key[1])  # (numpy's integers too)
            if not (0 <= src < n and 0 <= dst < n):
                raise ValueError(
                    f"model_connection key {key!r} names a model outside 0..{n - 1} "
                    f"({n} models given)"
                )
            if src == dst:
                raise ValueError(
                    f"model_connection key {key!r} connects model {src} to itself; "
                    "only connections between different models count"
                )
            conn[src, dst] += _check_number(weight, f"model_connection[{key!r}]")
        return conn
    if isinstance(model_connection, torch.Tensor):
        model_connection = model_connection.detach().cpu().numpy()
    if isinstance(model_connection, (np.ndarray, list, tuple)):
        try:
            conn = np.array(model_connection, dtype=np.float64)
        except (TypeError, ValueError) as e:
            raise TypeError(f"model_connection is not a numeric matrix: {e}") from e
        if conn.shape != (n, n):
            raise ValueError(
                f"model_connection as a matrix must have shape ({n}, {n}) for {n} models, "
                f"got {conn.shape}"
            )
        if not np.isfinite(conn).all() or (conn < 0).any():
            raise ValueError("model_connection entries must be finite numbers >= 0")
        if np.diagonal(conn).any():
            raise ValueError(
                "model_connection has a nonzero diagonal (a model connected to itself); "
                "set it to 0"
            )
        return conn
    raise TypeError(
        "model_connection must be a dict {(source, target): amount} or an n x n matrix, "
        f"got {type(model_connection).__name__}"
    )


def _complexities(model_complexity: Optional[Sequence[float]], n: int) -> Optional[list[float]]:
    if model_complexity is None:
        return None
    if isinstance(model_complexity, torch.Tensor):
        model_complexity = model_complexity.tolist()
    if isinstance(model_complexity, (str, bytes)) or not isinstance(
        model_complexity, (Sequence, np.ndarray)
    ):
        raise TypeError(
            "model_complexity must be a list of numbers (one per model) or None, "
            f"got {type(model_complexity).__name__}"
        )
    if len(model_complexity) != n:
        raise ValueError(
            f"model_complexity has {len(model_complexity)} entries but {n} models were "
            "given; pass one number per model"
        )
    return [_check_number(v, f"model_complexity[{i}]") for i, v in enumerate(model_complexity)]
