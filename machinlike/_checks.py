"""Argument checks at the public boundary of ``machinlike.distributed``: one family, one wording.

Each check raises before anything is sent, with the parameter, the value and the fix.
"""

from __future__ import annotations

import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

__all__ = ["seconds", "seconds_or_none", "member_name", "service_key", "call_args", "positive_int"]


def seconds(param: str, value: Any) -> float:
    """``value`` as a positive, finite number of seconds.

    Raises:
        TypeError: not a number (bool counts as not a number).
        ValueError: zero, negative, NaN or infinite.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{param}={value!r} must be a number of seconds, not {type(value).__name__}")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{param}={value!r} must be a positive number of seconds (finite)")
    return float(value)


def seconds_or_none(param: str, value: Any, default: float) -> float:
    """Like :func:`seconds`, with None standing for ``default``."""
    return default if value is None else seconds(param, value)


def positive_int(param: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int of at least ``minimum``.

    Raises:
        TypeError: not an int (bool counts as not an int).
        ValueError: below ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{param}={value!r} must be an int, not {type(value).__name__}")
    if value < minimum:
        what = "a positive int" if minimum == 1 else f"an int of at least {minimum}"
        raise ValueError(f"{param}={value!r} must be {what}")
    return value


def member_name(value: Any, param: str = "name") -> str:
    """A valid member name: 1-100 letters, digits, ``_``, ``:`` or ``-``.

    Raises:
        TypeError: not a str.
        ValueError: empty, too long, or with other characters.
    """
    if not isinstance(value, str):
        raise TypeError(f"{param} must be a str, not {type(value).__name__} ({value!r})")
    if not value or len(value) > 100 or not all(c.isalnum() or c in "_:-" for c in value):
        raise ValueError(f"{param}={value!r} is not a valid member name: use 1-100 letters, digits, "
                         f"'_', ':' or '-'")
    return value


def service_key(key: Any) -> str:
    """A service or value key: a non-empty str.

    Raises:
        TypeError: not a str.
        ValueError: empty.
    """
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, not {type(key).__name__} ({key!r})")
    if not key:
        raise ValueError("key='' is empty: name the service or value, e.g. key='model'")
    return key


def call_args(args: Any, kwargs: Any) -> Tuple[Tuple[Any, ...], Dict[str, Any]]:
    """``args`` as a tuple and ``kwargs`` as a dict, for a remote call.

    Raises:
        TypeError: ``args`` is not a list or tuple (a lone str or tensor is a common slip),
            or ``kwargs`` is not a mapping with str keys.
    """
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args must be a tuple or list of positional arguments, not {type(args).__name__} "
                        f"({args!r:.60}); wrap a single argument: args=(x,)")
    if kwargs is None:
        return tuple(args), {}
    if not isinstance(kwargs, Mapping) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(f"kwargs must be a dict of keyword arguments (str keys) or None, not "
                        f"{type(kwargs).__name__} ({kwargs!r:.60})")
    return tuple(args), dict(kwargs)


def sequence_of_str(param: str, value: Any) -> Sequence[str]:
    """``value`` as a sequence of str (a lone str is refused).

    Raises:
        TypeError: not a sequence of str.
    """
    if isinstance(value, str) or not isinstance(value, (list, tuple, set, frozenset)) or \
            not all(isinstance(m, str) for m in value):
        raise TypeError(f"{param} must be a sequence of member names (str), not {value!r}")
    return list(value)


def optional_str(param: str, value: Optional[Any]) -> Optional[str]:
    """None or a str.

    Raises:
        TypeError: anything else.
    """
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{param} must be a str or None, not {type(value).__name__} ({value!r})")
    return value
