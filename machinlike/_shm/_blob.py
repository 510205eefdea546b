"""A large message of plain data, pickled once at C speed instead of walked item by item.

Why: before a call's carrier pickles it, the walk (``_walk``) looks at every item of a
message for tensors and arrays. For a list of 200,000 (int, float, bool) tuples that is
600,000 type checks on each side, about 17 ms beside pickle's 26: such an echo took 0.77
of raw torch RPC's speed. Here a message with a container of ``BIG`` items or more is
pickled first by a pickler that refuses what the walk would replace (tensors, arrays,
storages) and what only the carrier pickles its own way (RRefs, torch RPC's registered
classes); where it pickles whole, the carrier gets its bytes::

    outgoing / reply: a container of >= BIG items at the top of the message, its
                      first and last items builtin data (numbers, strings, tuples of them)?
      no  ─► the walk, as before
      yes ─► strict pickle ── refused (a tensor, an array, an RRef, anything pickle
               │               cannot do) ─► the walk, as before
               └─ done ─► Blob(bytes): the carrier copies the bytes; its unpickling
                          runs ``pickle.loads`` on them (the object the sender had)

What it keeps: the message's own sharing (one pickle holds all of it: an object met twice
arrives as one object, twice). What it costs: a message refused late (a tensor after a long plain
list) is pickled up to there for nothing; only the top level is looked at for a tensor
before trying.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any, Callable, Optional, Tuple

import numpy as np
import torch

__all__ = ["BIG", "Blob", "large", "blob", "whole"]

#: Items a list, tuple or dict at the top of a message (or one of its arguments) holds at
#: least for the message to be tried whole: below it the walk costs less than a pickle.
BIG = 4096

_CONTAINERS = (list, tuple, dict)
_BUILTIN = frozenset({int, float, bool, str, bytes, complex, type(None)})
_REFUSED = (torch.Tensor, np.ndarray, torch.UntypedStorage, torch.TypedStorage, torch.jit.ScriptModule)
# Modules whose classes are refused: RRefs (torch's C classes too) pickle only inside RPC.
_OWN_WAY = ("machinlike.", "torch.distributed.", "torch._C._distributed")


class _Refused(Exception):
    """The strict pickler met what the walk or the carrier must see."""


class _Strict(pickle.Pickler):
    """Pickle, refusing tensors, arrays and storages (their subclasses too), and objects of
    classes pickled their own way by torch RPC or by this package. Exact lists, tuples,
    dicts, strings and numbers never reach ``reducer_override``: a message of them costs
    no Python call per item."""

    owned: Tuple[type, ...] = ()

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        # (This package's classes: a handle's copy may register a hold with its owner
        # when pickled, which a refused message would leave held.)
        if issubclass(kind, self.owned) or str(getattr(kind, "__module__", "")).startswith(_OWN_WAY):
            raise _Refused(kind.__name__)
        return NotImplemented


class Blob:
    """A message pickled whole; unpickles as that message."""

    __slots__ = ("data",)

    def __init__(self, data: bytes) -> None:
        self.data = data

    def __reduce__(self) -> Tuple[Callable[..., Any], Tuple[bytes]]:
        return pickle.loads, (self.data,)


def large(obj: Any) -> bool:
    """Whether ``obj`` (a message, or a call's args) holds a list, tuple or dict of ``BIG``
    items or more, itself or as an item, whose first and last items are builtin data, and
    no tensor or array as an item."""
    if type(obj) in _CONTAINERS and len(obj) >= BIG:
        return _looks_builtin(obj)
    if type(obj) is not tuple or len(obj) > 64:  # (a call's args: a few)
        return False
    found = False
    for item in obj:
        kind = type(item)
        if issubclass(kind, _REFUSED):
            return False
        if kind in _CONTAINERS and len(item) >= BIG:
            if not _looks_builtin(item):
                return False
            found = True
    return found


def _looks_builtin(container: Any) -> bool:
    """Whether the first and last items of a long ``container`` are builtin numbers or
    strings, or tuples, lists or dicts of them: what the strict pickler pickles with no
    Python call per item. (Any other object costs one ``reducer_override`` call: a list
    of a million numpy scalars took 2.5 s where the walk and pickle took 1.87.)"""
    ends = (next(iter(container.values())), next(reversed(container.values()))) if type(container) is dict \
        else (container[0], container[-1])
    for item in ends:
        kind = type(item)
        if kind in _BUILTIN:
            continue
        if kind is dict:
            if not (_BUILTIN.issuperset(map(type, item)) and _BUILTIN.issuperset(map(type, item.values()))):
                return False
        elif kind not in (tuple, list) or not _BUILTIN.issuperset(map(type, item)):
            return False
    return True


def _owned() -> Tuple[type, ...]:
    owned = list(_REFUSED)
    internal = sys.modules.get("torch.distributed.rpc.internal")  # (loaded with torch RPC)
    if internal is not None:  # what torch RPC's pickler was told to carry its own way
        owned += [kind for kind in getattr(getattr(internal, "_internal_rpc_pickler", None), "_class_reducer_dict", ())
                  if isinstance(kind, type)]
    return tuple(owned)


def blob(obj: Any) -> Optional[Blob]:
    """``obj`` pickled whole, or None where it holds what the strict pickler refuses (see
    the module doc) or what pickle cannot do (the carrier then says so, or does it)."""
    pickler = _Strict(buf := io.BytesIO(), protocol=pickle.HIGHEST_PROTOCOL)
    pickler.owned = _owned()  # (per message: torch RPC may have been told of a class since)
    try:
        pickler.dump(obj)
    except Exception:  # (_Refused, or pickle's own refusal)
        return None
    return Blob(buf.getvalue())


def whole(obj: Any) -> Optional[Blob]:
    """``obj`` pickled whole where it is :func:`large` and the strict pickler takes it;
    None: walk it (the caller's path as before)."""
    return blob(obj) if large(obj) else None
