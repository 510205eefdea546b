"""Pickling by value through dill, for what the C pickler cannot pickle by reference.

Each such object becomes one dill stream, embedded in the outer pickle as
``_load_by_value(stream)``. dill's pure-Python pickler costs a few hundred microseconds for
a lambda (tens of pickle ``save`` calls, most of them for the code object), which would
dominate a pool task or an RPC call, so two shortcuts apply:

* code objects go through ``marshal`` (the interpreter's own, complete format), tagged
  with the Python version that wrote them;
* a function whose state is immutable — no ``__dict__``, defaults and closure cells that
  hold only atoms (None, bool, numbers, str, bytes, tuples of these), globals that are its
  module's namespace (referred to by name, ``recurse=False``) — always pickles to the same
  bytes, so those bytes are cached by a key of that state (not by the function object:
  a lambda created anew in a loop hits the cache too). Its loader keeps the first
  function it built for those bytes and hands out fresh copies of it.
"""

from __future__ import annotations

import importlib
import io
import marshal
import os
import pickle
import sys
import threading
import types
from collections import OrderedDict
from typing import Any, BinaryIO, Callable, Optional, Tuple

import dill
import numpy as np

__all__ = ["static_modules", "reduce_by_value", "dill_dumps", "load_by_value"]

_PROTOCOL = pickle.HIGHEST_PROTOCOL
_CACHE_SIZE = 512
_PY_VERSION = tuple(sys.version_info[:2])

#: Names of modules marked static (pickled by name only); see mark_static_module.
static_modules: set = set()


def _load_code(version: Tuple[int, int], data: bytes) -> types.CodeType:
    if tuple(version) != _PY_VERSION:
        raise pickle.UnpicklingError(
            f"a function pickled by Python {version[0]}.{version[1]} cannot be loaded by Python "
            f"{_PY_VERSION[0]}.{_PY_VERSION[1]}: run the same Python version on both sides"
        )
    return marshal.loads(data)


class _DillPickler(dill.Pickler):
    """dill with a tensor policy table, marshalled code and the static-module registry."""

    def __init__(self, file: BinaryIO, recurse: bool, table: Any) -> None:
        super().__init__(file, protocol=_PROTOCOL, byref=False, recurse=recurse)
        self.dispatch_table = table

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        if cls is types.CodeType:
            return _load_code, (_PY_VERSION, marshal.dumps(obj))
        if cls is types.ModuleType and obj.__name__ in static_modules:
            return importlib.import_module, (obj.__name__,)
        if cls is np.ndarray:  # dill's own save of arrays comes before the table: the policy's first
            reduce = self.dispatch_table.get(cls)
            if reduce is not None:
                return reduce(obj)
        return NotImplemented


def dill_dumps(obj: Any, recurse: bool, table: Any) -> bytes:
    """One dill stream for ``obj`` (``table``: the tensor policy's dispatch table)."""
    buffer = io.BytesIO()
    _DillPickler(buffer, recurse, table).dump(obj)
    return buffer.getvalue()


def load_by_value(data: bytes) -> Any:
    """Loader of a by-value stream (it is named in pickles: keep it importable)."""
    return dill.loads(data)


# --------------------------------------------------------------------------------------
# Functions with immutable state.


class _NotAtom(Exception):
    pass


_ATOMS = (type(None), bool, int, float, complex, str, bytes)


def _atom_key(value: Any, depth: int = 0) -> Any:
    cls = type(value)
    if cls in _ATOMS:
        return cls, value  # the type keeps 1, 1.0 and True apart
    if cls is tuple and depth < 3 and len(value) <= 32:
        return tuple, tuple(_atom_key(item, depth + 1) for item in value)
    raise _NotAtom


def _function_key(func: Any) -> Optional[Tuple[Any, ...]]:
    """The state that determines ``func``'s pickle, or None if it is not all immutable."""
    if type(func) is not types.FunctionType or func.__dict__:
        return None
    module = sys.modules.get(func.__module__)
    if module is None or getattr(module, "__dict__", None) is not func.__globals__:
        return None
    try:
        closure = func.__closure__ or ()
        cells = tuple(_atom_key(cell.cell_contents) for cell in closure)
        defaults = None if func.__defaults__ is None else _atom_key(func.__defaults__)
        kwdefaults = None if not func.__kwdefaults__ else tuple(
            (name, _atom_key(value)) for name, value in func.__kwdefaults__.items()
        )
        annotations = tuple((name, _annotation_key(value)) for name, value in func.__annotations__.items())
    except (_NotAtom, ValueError):  # ValueError: an empty cell
        return None
    return (
        func.__code__,
        func.__module__,
        id(func.__globals__),
        func.__name__,
        func.__qualname__,
        func.__doc__,
        cells,
        defaults,
        kwdefaults,
        annotations,
    )


def _annotation_key(value: Any) -> Any:
    main = ("__main__", "__mp_main__")
    if isinstance(value, type) and "<" not in value.__qualname__ and value.__module__ not in main:
        return value  # pickled by reference: its identity is all that matters
    return _atom_key(value)


class _LRU:
    def __init__(self, size: int) -> None:
        self._items: "OrderedDict[Any, Any]" = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def reset_lock(self) -> None:
        """After a fork: another thread may have held the lock at that moment."""
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self._lock:
            value = self._items.get(key)
            if value is not None:
                self._items.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self._lock:
            self._items[key] = value
            if len(self._items) > self._size:
                self._items.popitem(last=False)


_dumped_functions = _LRU(_CACHE_SIZE)
_loaded_functions = _LRU(_CACHE_SIZE)


def _after_fork_in_child() -> None:
    _dumped_functions.reset_lock()
    _loaded_functions.reset_lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _load_function(data: bytes) -> types.FunctionType:
    template = _loaded_functions.get(data)
    if template is None:
        template = dill.loads(data)
        _loaded_functions.put(data, template)
    return _copy_function(template)


def _copy_function(func: types.FunctionType) -> types.FunctionType:
    closure = None
    if func.__closure__ is not None:
        closure = tuple(types.CellType(cell.cell_contents) for cell in func.__closure__)
    copy = types.FunctionType(func.__code__, func.__globals__, func.__name__, func.__defaults__, closure)
    copy.__qualname__ = func.__qualname__
    copy.__module__ = func.__module__
    copy.__doc__ = func.__doc__
    copy.__kwdefaults__ = dict(func.__kwdefaults__) if func.__kwdefaults__ else None
    copy.__annotations__ = dict(func.__annotations__)
    if hasattr(func, "__type_params__"):  # Python >= 3.12
        setattr(copy, "__type_params__", getattr(func, "__type_params__"))  # unknown to older typeshed
    return copy


def reduce_by_value(obj: Any, recurse: bool, table: Any) -> Tuple[Callable[..., Any], Tuple[Any, ...]]:
    """The reduce value that embeds ``obj``'s dill stream in an outer pickle."""
    key = None if recurse else _function_key(obj)
    if key is None:
        return load_by_value, (dill_dumps(obj, recurse, table),)
    try:
        data = _dumped_functions.get(key)
    except TypeError:  # an unhashable part slipped through (e.g. a tuple-like annotation)
        return load_by_value, (dill_dumps(obj, recurse, table),)
    if data is None:
        data = dill_dumps(obj, recurse, table)
        _dumped_functions.put(key, data)
    return _load_function, (data,)
