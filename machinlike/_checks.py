"""Argument checks at machinlike's public boundaries: one family, one wording.

Each check raises before anything is sent or waited for, naming the parameter, the value
and the fix: ``TypeError`` for a value of the wrong type (a bool is not a number),
``ValueError`` for one out of range. Timeouts are seconds, finite; a wait that may just
poll says so with ``allow_zero=True``.
"""

from __future__ import annotations

import inspect
import math
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple, overload

__all__ = ["MAX_SECONDS", "MAX_NAME_BYTES", "BACKENDS", "seconds", "seconds_or_none", "member_name", "service_key", "fits_the_store", "boolean", "call_args", "positive_int",
           "sequence_of_str", "optional_str", "nonempty_str", "not_async", "local_device"]


#: The longest bound a wait takes, s (11.6 days): poll() counts milliseconds in 31 bits
#: (24.8 days), and a wait of a week is as good as none for a job, so "forever" written
#: as 1e9 is refused by name instead of failing as an OverflowError deep in a call.
MAX_SECONDS = 1_000_000.0


def seconds(param: str, value: Any, *, allow_zero: bool = False, or_none: bool = False) -> float:
    """``value`` as a positive (or, with ``allow_zero``, non-negative), finite number of seconds.

    ``or_none``: the caller takes None too (its default); the message says so.

    Raises:
        TypeError: not a number (bool counts as not a number).
        ValueError: negative, NaN, infinite or above :data:`MAX_SECONDS`; zero unless
            ``allow_zero``.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{param}={value!r} must be a number of seconds, not {type(value).__name__}"
                        + ("; or None for the default" if or_none else ""))
    if allow_zero:
        if not (value >= 0 and math.isfinite(value)):
            raise ValueError(f"{param}={value!r} must be a number of seconds >= 0 (finite), or None to wait "
                             f"without a limit")
    elif not (value > 0 and math.isfinite(value)):
        # torch RPC reads 0 (and machin -1) as "no limit"; nothing here waits without one.
        fix = "; pass None for the default, or a bound in seconds" if or_none else ""
        unbounded = " (0 or a negative value does not mean 'no limit': every wait here is bounded)" \
            if or_none and value <= 0 else ""
        raise ValueError(f"{param}={value!r} must be a positive number of seconds (finite){fix}{unbounded}")
    if value > MAX_SECONDS:
        raise ValueError(f"{param}={value!r} is longer than the longest bound a wait here takes, "
                         f"{MAX_SECONDS:,.0f} s (11.6 days): pass at most that")
    return float(value)


@overload
def seconds_or_none(param: str, value: Any, default: float, *, allow_zero: bool = False) -> float: ...


@overload
def seconds_or_none(param: str, value: Any, default: None = None, *, allow_zero: bool = False) -> Optional[float]: ...


def seconds_or_none(param: str, value: Any, default: Optional[float] = None, *,
                    allow_zero: bool = False) -> Optional[float]:
    """Like :func:`seconds`, with None standing for ``default`` (None: no limit)."""
    return default if value is None else seconds(param, value, allow_zero=allow_zero, or_none=True)


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
    """A valid member name: 1-100 ASCII letters, digits, ``_``, ``:`` or ``-`` (what torch
    RPC's worker names allow).

    Raises:
        TypeError: not a str.
        ValueError: empty, too long, or with other characters.
    """
    if not isinstance(value, str):
        raise TypeError(f"{param} must be a str, not {type(value).__name__} ({value!r})")
    if not value or len(value) > 100 or not value.isascii() or not all(c.isalnum() or c in "_:-" for c in value):
        raise ValueError(f"{param}={value!r} is not a valid member name: use 1-100 ASCII letters, digits, "
                         f"'_', ':' or '-'")
    return value


def nonempty_str(param: str, value: Any) -> str:
    """``value`` as a non-empty str (a name) of at most :data:`MAX_NAME_BYTES`.

    Raises:
        TypeError: not a str.
        ValueError: empty, or too long.
    """
    if not isinstance(value, str):
        raise TypeError(f"{param} must be a str, not {type(value).__name__} ({value!r})")
    if not value:
        raise ValueError(f"{param}='' is empty: give it a name")
    return fits_the_store(param, value)


#: torch.distributed's backends, by the names World and its collective groups take.
BACKENDS = ("gloo", "nccl", "mpi", "ucc")

#: The longest key, group or server name, in UTF-8 bytes. Each goes into store keys
#: with a prefix, and torch's store drops the connection of a client that sends a key
#: over 8,192 bytes: the process's World was lost for good over one long name.
MAX_NAME_BYTES = 2048


def fits_the_store(param: str, value: str) -> str:
    """``value`` unless it is longer than :data:`MAX_NAME_BYTES` (a ValueError)."""
    if len(value) * 4 > MAX_NAME_BYTES and len(value.encode("utf-8", "surrogatepass")) > MAX_NAME_BYTES:
        raise ValueError(f"{param} is {len(value.encode('utf-8', 'surrogatepass')):,} bytes long ({value[:40]!r}...): "
                         f"names are kept in the world's store, which refuses long keys; use at most "
                         f"{MAX_NAME_BYTES:,} bytes (UTF-8)")
    return value


def boolean(param: str, value: Any) -> bool:
    """``value`` if it is a bool (a str such as 'no' is true to Python, and was taken so).

    Raises:
        TypeError: not a bool.
    """
    if not isinstance(value, bool):
        raise TypeError(f"{param} must be a bool (True or False), not {type(value).__name__} ({value!r})")
    return value


def service_key(key: Any) -> str:
    """A service or value key: a non-empty str of at most :data:`MAX_NAME_BYTES`.

    Raises:
        TypeError: not a str.
        ValueError: empty, or too long.
    """
    if not isinstance(key, str):
        raise TypeError(f"key must be a str, not {type(key).__name__} ({key!r})")
    if not key:
        raise ValueError("key='' is empty: name the service or value, e.g. key='model'")
    return fits_the_store("key", key)


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


def not_async(param: str, func: Any, runs: str) -> None:
    """Refuse an ``async def`` function where it would be called without an event loop:
    the call would only return an unawaited coroutine, which no caller can use.

    Args:
        param: The parameter's name.
        func: The callable.
        runs: Where it would run, for the message (``"on an RPC thread"``).

    Raises:
        TypeError: naming the function and the fix.
    """
    if inspect.isasyncgenfunction(func):
        name = getattr(func, "__qualname__", type(func).__name__)
        raise TypeError(f"{param} {name} is an async generator function: a call would give an async generator, "
                        f"which cannot be sent back; collect its items in an async def function instead "
                        f"(return [item async for item in {name.rsplit('.', 1)[-1]}(...)])")
    if inspect.iscoroutinefunction(func):
        name = getattr(func, "__qualname__", type(func).__name__)
        raise TypeError(f"{param} {name} is an async function: it would run {runs} without an event loop and "
                        f"return an unawaited coroutine; pass a plain function, such as "
                        f"lambda *args: asyncio.run({name.rsplit('.', 1)[-1]}(*args))")


def local_device(param: str, value: Any) -> Any:
    """``value`` as a ``torch.device`` this process can use: the CPU, or a CUDA device that
    exists here (``"cuda"`` alone: the current one, by index). Checked where a server is made, so that
    a wrong device fails there, named, and not on every request after.

    Raises:
        ValueError: not a device, or a CUDA device this process does not have.
    """
    import torch  # (here: the status tool imports this module without torch)

    try:
        device = torch.device(value)
    except (TypeError, RuntimeError) as err:
        raise ValueError(f"{param}={value!r} is not a torch device: {err}") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"{param}={value!r}: only 'cpu' and 'cuda[:N]' devices are supported")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if not count:
        raise ValueError(f"{param}={value!r} but CUDA is not available in this process; use 'cpu'")
    if device.index is not None and device.index >= count:
        raise ValueError(f"{param}={value!r} but this process sees {count} CUDA device(s) "
                         f"(cuda:0 to cuda:{count - 1}; CUDA_VISIBLE_DEVICES may hide the others)")
    # "cuda" alone is the current device of the thread that asks, and a server's threads
    # (its batcher, its reducer, torch's RPC threads) start on cuda:0 whatever this one
    # chose (torch.cuda.set_device): name the device now, in the thread that made the server.
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
