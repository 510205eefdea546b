"""Shipping the function of a call: by reference when the callee can import it, else by value.

A lambda or closure cannot be pickled by reference, so it travels as bytes of
``machinlike.pickle`` (by value, through dill). Both sides cache: the caller its bytes per
function object (weakly), the callee the loaded function per byte string (bounded, least
recently used first out), so captured objects are unpickled once per process and reused.
"""

from __future__ import annotations

import sys
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Dict, Optional, Sequence, Tuple

from ...pickle import dumps, loads
from .coroutines import is_coroutine_function
from ..._checks import call_args, not_async

__all__ = ["ship_function", "is_async", "prepare_call"]


_shipped: "weakref.WeakKeyDictionary[Any, bytes]" = weakref.WeakKeyDictionary()


_loaded: "OrderedDict[bytes, Callable[..., Any]]" = OrderedDict()


_loaded_lock = threading.Lock()


_LOADED_MAX = 256


def _by_reference(func: Any) -> bool:
    module = sys.modules.get(getattr(func, "__module__", None) or "")
    qualname = getattr(func, "__qualname__", None)
    if module is None or not qualname or "<locals>" in qualname:
        return False
    target: Any = module
    for part in qualname.split("."):
        target = getattr(target, part, None)
    return target is func


def ship_function(func: Callable[..., Any]) -> Any:
    """What to send for ``func``: itself when importable on the callee, else its bytes."""
    if _by_reference(func):
        return func
    try:
        return _shipped[func]
    except (KeyError, TypeError):
        pass
    data = dumps(func)
    try:
        _shipped[func] = data
    except TypeError:  # not weak-referenceable (e.g. a functools.partial): no caching
        pass
    return data


def _load_function(func: Any) -> Callable[..., Any]:
    if type(func) is not bytes:
        return func
    with _loaded_lock:
        loaded = _loaded.get(func)
        if loaded is not None:
            _loaded.move_to_end(func)
            return loaded
    loaded = loads(func)
    with _loaded_lock:
        _loaded[func] = loaded
        if len(_loaded) > _LOADED_MAX:
            _loaded.popitem(last=False)
    return loaded


def is_async(func: Any) -> bool:
    """Whether ``func`` answers later: marked with ``@rpc.functions.async_execution``, or an
    ``async def`` function (the callee runs it on its loop thread, see ``coroutines``)."""
    return hasattr(func, "_wrapped_async_rpc_function") or is_coroutine_function(func)


def prepare_call(func: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]]) -> Tuple:
    """``(shipped func, args, kwargs)`` of a plain call, checked before anything is sent.

    Raises:
        TypeError: ``func`` is not callable or is an async generator function, or
            ``args``/``kwargs`` are not a sequence / dict.
    """
    if not callable(func):
        raise TypeError(f"func must be callable, not {type(func).__name__}")
    if not is_coroutine_function(func):  # (an async def function runs on the callee's loop thread)
        not_async("func", func, "on the callee's RPC thread")
    return (ship_function(func),) + call_args(args, kwargs)
