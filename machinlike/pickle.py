"""Pickling that handles lambdas, closures and local classes, and shares or copies tensors.

``dumps`` / :class:`Pickler` run in two tiers::

    obj ──> C pickle.Pickler (protocol 5)
              │  reducer_override: lambdas, local functions and classes, closures,
              │  code/cell/module/lock objects ──> one dill stream each, embedded
              │  dispatch_table: tensors and storages ──> the tensor policy
              │                 (then multiprocessing's reducers, then copyreg)
              └─ on PicklingError / TypeError / AttributeError ──> whole object through
                 dill, wrapped so that ``loads`` (the C unpickler) reads it as well

Ordinary data therefore pickles at C speed, and only what the standard pickler cannot
pickle by reference goes through dill (by value), as cloudpickle does. Every output is
read by :func:`loads`, which is ``pickle.loads``.

Tensor policy: ``copy_tensor=True`` puts tensor data into the bytes; ``copy_tensor=False``
shares it: CPU tensors through shared memory, CUDA tensors through CUDA IPC handles, with
torch's multiprocessing reducers (details and the reasons in ``machinlike/_reductions.py``).
A shared payload can be loaded several times, in the same or in other processes, while
some process still holds the tensor; the memory stays alive until the first load even if
the sender drops the tensor (or exits) meanwhile.

Lifetime of a CPU share-mode payload: its memory is a named shared-memory segment kept by
torch's shared-memory manager (``/dev/shm/torch_*``). It is freed once every process
that loaded it has dropped the tensor and the payload has been loaded once; a payload
never loaded is freed when the manager exits, with the last process of the job. A tensor
that ``share_memory_()`` put in file-descriptor memory is moved into such a segment at
its first share-mode pickling when no other process can be using it yet, so a child may
share a tensor, send it and exit before the parent loads it. One that another process
already uses keeps its descriptor: its payload can be loaded only while the sender lives.

Importing this module changes no process-wide setting: torch's sharing strategy, copyreg
and multiprocessing's reducer table are read, never written.

Known limit: each object pickled by value gets its own dill stream, so an object that is
reachable both from such an object (say, a lambda's closure) and from the rest of the
payload arrives as two copies.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import io
import pickle
import sys
import threading
import types
import weakref
from collections import OrderedDict
from typing import Any, BinaryIO, Optional, Tuple

import torch

from . import _byvalue, _reductions

__all__ = ["Pickler", "dumps", "loads", "mark_static_module"]

_PROTOCOL = pickle.HIGHEST_PROTOCOL

# Types the C pickler cannot handle (or handles wrongly: singletons) and dill can.
_BY_VALUE_TYPES = frozenset(
    {
        types.CodeType,
        types.CellType,
        types.MappingProxyType,
        type({}.keys()),
        type({}.values()),
        type({}.items()),
        type(OrderedDict().keys()),
        type(OrderedDict().values()),
        type(OrderedDict().items()),
        type(threading.Lock()),
        type(threading.RLock()),
        io.TextIOWrapper,
        io.BufferedWriter,
        io.BufferedReader,
        io.BufferedRandom,
        io.FileIO,
        super,
        property,
        classmethod,
        staticmethod,
        weakref.ReferenceType,
        weakref.ProxyType,
        weakref.CallableProxyType,
        contextvars.Context,
    }
)
_FUNCTION_TYPES = (types.FunctionType, functools._lru_cache_wrapper)
_PLAIN_TYPES = frozenset(
    {tuple, list, dict, set, frozenset, bytearray, slice, range, complex}
    | {torch.Tensor, torch.Size, torch.dtype, torch.device}
)
# Classes the C pickler special-cases although they are not importable by name.
_SPECIAL_CLASSES = frozenset({type(None), type(NotImplemented), type(...)})
_MAIN_MODULES = frozenset({"__main__", "__mp_main__"})


def mark_static_module(module: types.ModuleType) -> None:
    """Pickle ``module`` by reference only (by name), never with its contents.

    dill pickles a module that is not part of the installation (not in site-packages or
    the standard library) *by value*, together with its namespace; a module that holds
    handles into a C library (a ``ctypes.CDLL`` and the pointers it returned) cannot be
    pickled that way. A static module is one that is the same wherever it is imported:
    marking it makes every pickle refer to it by name, and the loading process imports
    it. The mark lives in this process's registry; the module itself is not modified.

    Args:
        module: The module object.

    Raises:
        TypeError: ``module`` is not a module.
    """
    if not isinstance(module, types.ModuleType):
        raise TypeError(f"module must be a module object, not {type(module).__name__}")
    _byvalue.static_modules.add(module.__name__)


def _is_importable(obj: Any) -> bool:
    """Whether ``obj`` can be found again by its module and qualified name."""
    module_name = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if not isinstance(module_name, str) or not isinstance(qualname, str):
        return False
    if module_name in _MAIN_MODULES or "<" in qualname:  # <lambda>, <locals>
        return False
    found: Any = sys.modules.get(module_name)
    if found is None:
        return False
    try:
        for part in qualname.split("."):
            found = getattr(found, part)
    except Exception:
        return False
    return found is obj


def _of_unimportable_main(func: Any) -> bool:
    """Whether ``func`` was defined in a main module that no process can import again: a
    notebook, ``python -c``, a REPL (``__main__`` has no file), or a namespace rebuilt
    from a pickle (a launched rank's function and the helpers it calls: their globals
    are a copy, no module's dict, which dill would send whole, modules and all)."""
    name = getattr(func, "__module__", None)
    if name not in _MAIN_MODULES:
        return False
    module = sys.modules.get(name)
    if name == "__main__" and getattr(module, "__file__", None) is None:
        return True
    return module is not None and getattr(module, "__dict__", None) is not getattr(func, "__globals__", None)


class _ByValue:
    """Envelope for a whole-object dill stream, so that the C unpickler can load it."""

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> Tuple[Any, ...]:
        return _byvalue.load_by_value, (self.data,)


def _too_deep(exc: RecursionError) -> pickle.PicklingError:
    """The error for an object nested deeper than the pickler allows.

    What bounds the depth depends on who met it: dill is Python code, bounded by the
    recursion limit; the C pickler is too up to Python 3.11, but from 3.12 on it is
    bounded by the interpreter's fixed C recursion limit (about 750 levels of lists in
    3.12.0-3.12.2, about 5000 from 3.12.3 and in 3.13), which ``sys.setrecursionlimit()``
    does not change. A RecursionError does not say which, so the message says both.
    """
    return pickle.PicklingError(
        f"object too deeply nested to pickle ({exc}); flatten it. Raising sys.setrecursionlimit() (now "
        f"{sys.getrecursionlimit()}) helps only below Python 3.12 or for objects pickled by value (dill): from "
        f"3.12 on the C pickler's depth is a fixed limit of the interpreter"
    )


class _NoSink:
    def write(self, data: bytes) -> int:  # pragma: no cover - never called
        raise RuntimeError("internal pickler has no output file")


def _check_flags(recurse: Any, copy_tensor: Any) -> None:
    if not isinstance(recurse, bool):
        raise TypeError(f"recurse must be a bool, not {type(recurse).__name__}")
    if not isinstance(copy_tensor, bool):
        raise TypeError(f"copy_tensor must be a bool, not {type(copy_tensor).__name__}")


_c_dump = pickle.Pickler.dump


class Pickler(pickle.Pickler):
    """A pickler for lambdas, local functions and classes, closures, and tensors.

    It is the C ``pickle.Pickler`` (protocol 5) with a class-level dispatch table per
    tensor policy, layered over multiprocessing's reducers and ``copyreg``, and a
    ``reducer_override`` that hands what cannot be pickled by reference to dill. Each
    :meth:`dump` writes one self-contained pickle that :func:`loads` reads; objects are
    not memoised across calls.

    Args:
        file: Binary file-like object with a ``write`` method.
        recurse: dill's ``recurse``: pickle only the globals a by-value function uses,
            by value, instead of referring to its module's namespace. Needed for
            functions whose module the loading process cannot import with the same
            contents (e.g. globals defined after start, or unpicklable module state).
        copy_tensor: True copies tensor and storage data into the pickle; False (the
            default here, as in machin) shares it by reference: CPU tensors through
            shared memory (a tensor not yet shared is moved there), CUDA tensors through
            CUDA IPC.

    Raises:
        TypeError: ``file`` has no ``write`` method, or a flag is not a bool.
    """

    _share_table = _reductions.share_reducers()
    _copy_table = _reductions.copy_reducers()
    dispatch_table = _share_table

    def __init__(self, file: BinaryIO, recurse: bool = False, copy_tensor: bool = False) -> None:
        if not callable(getattr(file, "write", None)):
            raise TypeError(f"file must have a write() method; got {type(file).__name__}")
        _check_flags(recurse, copy_tensor)
        self._sink = file
        self._buffer = io.BytesIO()
        self._recurse = recurse
        self._copy_tensor = copy_tensor
        self._busy = False
        # the C pickler reads dispatch_table when it is initialised
        self.dispatch_table = self._copy_table if copy_tensor else self._share_table
        super().__init__(self._buffer, protocol=_PROTOCOL)

    @property
    def recurse(self) -> bool:
        """dill's ``recurse`` flag for objects pickled by value."""
        return self._recurse

    @property
    def copy_tensor(self) -> bool:
        """Whether tensors are copied (True) or shared (False)."""
        return self._copy_tensor

    def dump(self, obj: Any) -> None:
        """Write the pickle of ``obj`` to the file.

        Args:
            obj: The object to pickle.

        Raises:
            pickle.PicklingError: ``obj`` cannot be pickled, or is nested too deeply.
            TypeError: ``obj`` (or a part of it) cannot be pickled.
        """
        self._sink.write(self._to_bytes(obj))

    def reducer_override(self, obj: Any) -> Any:
        """Route ``obj`` to dill (by value) if the C pickler cannot pickle it by reference.

        Functions and classes that are importable by module and qualified name (and not
        defined in ``__main__``) stay references; lambdas, local and ``__main__``
        functions and classes, code objects, cells, locks and the like go by value.

        Args:
            obj: An object met while pickling.

        Returns:
            A reduction, or ``NotImplemented`` to leave ``obj`` to the standard pickler.
        """
        cls = type(obj)
        if cls in _PLAIN_TYPES:  # the bulk of any payload: leave it to the C code at once
            return NotImplemented
        if cls in _FUNCTION_TYPES:
            if _is_importable(obj):
                return NotImplemented
            if not self._recurse and _of_unimportable_main(obj):
                # A notebook's or ``python -c``'s function, or one a launcher rebuilt: no
                # process can import its module, so the globals it uses (helpers, constants)
                # travel with it, as cloudpickle does; by reference they were a NameError in
                # the worker, and a rebuilt namespace sent whole failed on its modules
                # (cold trial 13: a pool's lambda made in a launched rank's helper).
                return _byvalue.reduce_by_value(obj, True, self.dispatch_table)
        elif issubclass(cls, type):
            if obj in _SPECIAL_CLASSES or _is_importable(obj):
                return NotImplemented
        elif cls is types.ModuleType:
            if obj.__name__ in _byvalue.static_modules:
                return importlib.import_module, (obj.__name__,)
        elif cls not in _BY_VALUE_TYPES:
            return NotImplemented
        return _byvalue.reduce_by_value(obj, self._recurse, self.dispatch_table)

    def _to_bytes(self, obj: Any) -> bytes:
        if self._copy_tensor:  # the copy policy's reducers leave nothing to undo
            return self._one_pass(obj, None)
        mark = _reductions.undo_mark()
        try:
            return self._one_pass(obj, mark)
        except BaseException:
            _reductions.undo_rollback(mark)
            raise
        finally:
            _reductions.undo_release()

    def _one_pass(self, obj: Any, mark: Optional[int]) -> bytes:
        self._busy = True
        try:
            return self._fast_or_dill(obj, mark)
        finally:
            self.clear_memo()  # the memo would keep the payload's objects alive
            self._buffer.seek(0)
            self._buffer.truncate()  # drops the buffer getvalue() handed out: no pinning
            self._busy = False

    def _fast_or_dill(self, obj: Any, mark: Optional[int]) -> bytes:
        try:
            _c_dump(self, obj)  # the C pickler's dump (ours writes to the sink)
            return self._buffer.getvalue()
        except RecursionError as exc:
            raise _too_deep(exc) from exc
        except (pickle.PicklingError, TypeError, AttributeError):
            # The C tier met something only dill may handle: start over with dill, after
            # releasing what the failed pass shared. If dill fails too, its error
            # propagates with this one as context.
            if mark is not None:
                _reductions.undo_rollback(mark)
        self.clear_memo()
        try:
            data = _byvalue.dill_dumps(obj, self._recurse, self.dispatch_table)
        except RecursionError as exc:
            raise _too_deep(exc) from exc
        return pickle.dumps(_ByValue(data), protocol=_PROTOCOL)


class _CpuPickler(Pickler):
    """The copy policy, every tensor and storage rebuilt on the CPU (see ``dumps_to_cpu``)."""

    _copy_table = _reductions.cpu_copy_reducers()


def dumps_to_cpu(obj: Any) -> bytes:
    """(Internal) ``dumps(obj)`` (tensors copied), each tensor and storage arriving on the
    CPU: a worker's or a child's error report, whose reader may have no GPU and must not
    make a CUDA context to read it (``_reductions.cpu_copy_reducers`` says why).

    Raises:
        As :func:`dumps`.
    """
    return _CpuPickler(_NoSink(), False, True)._to_bytes(obj)  # type: ignore[arg-type]


_cache = threading.local()


def dumps(obj: Any, recurse: bool = False, copy_tensor: bool = True) -> bytes:
    """Pickle ``obj`` to bytes that :func:`loads` reads.

    Args:
        obj: Anything the standard pickler or dill can pickle, including lambdas, local
            functions and classes, closures and tensors.
        recurse: See :class:`Pickler`.
        copy_tensor: True (the default here, as in machin) copies tensor data into the
            bytes; False shares it (see :class:`Pickler`).

    Returns:
        The pickle.

    Raises:
        pickle.PicklingError: ``obj`` cannot be pickled, or is nested too deeply.
        TypeError: a flag is not a bool, or ``obj`` cannot be pickled.
    """
    if recurse.__class__ is not bool or copy_tensor.__class__ is not bool:
        _check_flags(recurse, copy_tensor)
    picklers = getattr(_cache, "picklers", None)
    if picklers is None:
        picklers = _cache.picklers = {}
    key = (recurse, copy_tensor)
    pickler: Optional[Pickler] = picklers.get(key)
    if pickler is None or pickler._busy:  # busy: dumps() called from inside a reducer
        pickler = Pickler(_NoSink(), recurse, copy_tensor)  # type: ignore[arg-type]
        picklers.setdefault(key, pickler)
    return pickler._to_bytes(obj)


def loads(data: Any) -> Any:
    """Rebuild an object from the bytes of :func:`dumps` or :class:`Pickler`.

    Args:
        data: The pickle (bytes, bytearray or memoryview).

    Raises:
        TypeError: ``data`` is not bytes-like.
        pickle.UnpicklingError: ``data`` is not a valid pickle.
        RuntimeError: a shared tensor's memory is no longer reachable.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"data must be bytes-like, not {type(data).__name__}")
    return pickle.loads(data)
