"""Argument checks shared by every pool constructor and call: each names the parameter,
what it must be, and the fix. No state."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, List, Optional

from .._checks import not_async

__all__ = ["PoolPicklingError", "default_processes", "check_processes", "check_maxtasks", "check_callable",
           "check_bool", "check_contexts", "as_args"]


def default_processes() -> int:
    """Number of CPUs this process may run on."""
    counter = getattr(os, "process_cpu_count", None)  # Python >= 3.13
    if counter is not None:
        return counter() or 1
    try:
        return len(os.sched_getaffinity(0)) or 1
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def check_processes(processes: Any, required: bool = False) -> int:
    if processes is None and not required:
        return default_processes()
    if isinstance(processes, bool) or not isinstance(processes, int):
        raise TypeError(f"processes must be an int (number of workers), not {type(processes).__name__}")
    if processes < 1:
        raise ValueError(f"processes must be >= 1, got {processes}")
    return processes


def check_maxtasks(maxtasks: Any) -> Optional[int]:
    if maxtasks is None:
        return None
    if isinstance(maxtasks, bool) or not isinstance(maxtasks, int):
        raise TypeError(f"maxtasksperchild must be None or an int, not {type(maxtasks).__name__}")
    if maxtasks < 1:
        raise ValueError(f"maxtasksperchild must be None (no limit) or >= 1, got {maxtasks}")
    return maxtasks


def check_callable(value: Any, param: str, optional: bool = False) -> None:
    if value is None and optional:
        return
    if not callable(value):
        raise TypeError(f"{param} must be callable{' or None' if optional else ''}, not {type(value).__name__}")
    not_async(param, value, "when its task ends" if param.endswith("callback") else "in a pool worker")


def check_bool(value: Any, param: str) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{param} must be a bool, not {type(value).__name__}")
    return value


def as_args(args: Any, param: str) -> tuple:
    if isinstance(args, tuple):
        return args
    if isinstance(args, (str, bytes)):
        raise TypeError(f"{param} must be a tuple of arguments, not a {type(args).__name__}; write ({args!r},)")
    try:
        return tuple(args)
    except TypeError:
        raise TypeError(f"{param} must be a tuple of arguments, not {type(args).__name__}; write (value,)") from None


class PoolPicklingError(NotImplementedError, TypeError):
    """Pickling a pool: a ``TypeError`` (what pickle raises for what cannot be pickled)
    and a ``NotImplementedError`` (what machin raised), so either ``except`` catches it."""


def check_contexts(worker_contexts: Any, processes: int) -> List[Any]:
    if worker_contexts is None:
        return [None] * processes
    if isinstance(worker_contexts, (str, bytes)) or not isinstance(worker_contexts, Iterable):
        raise TypeError(f"worker_contexts must be a sequence with one context per worker, not {type(worker_contexts).__name__}")
    contexts = list(worker_contexts)
    if len(contexts) != processes:
        raise ValueError(
            f"worker_contexts has {len(contexts)} context(s) but processes={processes}: the number "
            f"of contexts is not equal to the number of processes; give exactly one context per worker"
        )
    return contexts
