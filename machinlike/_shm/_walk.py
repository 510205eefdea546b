"""The walk: every tensor and numpy array of a message, found before its carrier pickles it.

Why before: the carriers (TensorPipe's pickler, a pool's, the lane's) are not all ours, so
the message's tensors are swapped for placeholders first, in a copy of the structure that
holds them; what holds none is passed on as it is::

    tensor / Parameter / array      ─► leaf(x)   (once per object: the memo)
    list, tuple, dict (ordered, or  ─► its items walked (a dict's keys too); a copy when
      with a default)                  one changed
    namedtuple, deque               ─► the same, rebuilt with ``_make`` / maxlen kept
    an object pickled by its state  ─► its ``__dict__`` walked; when one changed, a
      (dataclass, plain class,         _Rebuilt, which pickles as pickle would have
      an environment's info)           pickled the object (a blank one, then its state)
    one with slots or its own       ─► what its ``__getstate__`` returns walked: a
      ``__getstate__`` (a Batch)       _Rebuilt too (its ``__setstate__`` gets that state)
    a dict's or a list's subclass   ─► its items and attributes walked: a _Rebuilt too
      (a SampleBatch)                  (a blank one, its items, then its state)
    anything else                   ─► left to the carrier

Objects count since RL code moves ``Batch``/``Transition`` namedtuples and dataclasses:
before, their tensors took the carrier's slow path (a 64 MB one 2.5 times slower than in
a tuple). Containers and objects are memoised like tensors, before their contents are
walked, so a structure that reaches itself (a node's parent) or shares a part arrives
as pickle would give it (a cycle through a tuple, which cannot exist before its items,
keeps that tuple as it is: its tensors then take the carrier's path).
"""

from __future__ import annotations

import collections
import copyreg
import itertools
import operator
import sys
import types
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np
import torch

__all__ = ["walk", "untouched", "Leaf", "ArrayLeaf"]

Leaf = Callable[[torch.Tensor], Any]
ArrayLeaf = Callable[[np.ndarray], Any]

# Types the walk leaves as they are: they hold no tensor or array, or (functions, methods,
# classes) the walk never looks inside them (their plan would be _LEAVE; pickle carries
# them by name or by value). A list, tuple or dict made of them, directly or one level
# down (transitions as tuples, infos as dicts), is passed over at C speed (sets of its
# items' types) instead of one Python call per item, which made a call with a list of a
# million rewards 3.5 times slower than raw RPC and one of 200k tuples 4.8 times; a pool
# call's (function, args, kwargs) is one such tuple (its walk was half of a 11 us encode).
_ATOMS = frozenset({float, int, bool, str, bytes, complex, type(None), np.float64, np.float32, np.float16,
                    np.int64, np.int32, np.int16, np.int8, np.uint8, np.bool_,
                    types.FunctionType, types.BuiltinFunctionType, types.MethodType, type})
_SEQUENCES = frozenset({tuple, list})
_DICTS = frozenset({dict})
_MIXED = _ATOMS | _SEQUENCES | _DICTS

_LEAVE, _FIELDS, _STATE, _KEYED, _LISTED, _GETSTATE = 0, 1, 2, 3, 4, 5  # what the walk does with an object of a class
_plans: Dict[type, int] = {}
# Per class of slots only (no state of its own, no __dict__): its slots' values at once, for
# lists of them (a million-transition replay of slotted dataclasses); None: it has none.
_slot_values: Dict[type, Tuple[Optional[Callable[[Any], Any]], bool]] = {}  # (getter, several slots)
_PLANS_MAX = 1024
_IN_PROGRESS = object()  # the memo's mark of a tuple whose items are being walked
_OBJECT_GETSTATE = getattr(object, "__getstate__", None)
_OBJECT_REDUCE_EX, _OBJECT_REDUCE = object.__reduce_ex__, object.__reduce__


class _Rebuilt:
    """Pickles as its object would have, with the walked state and items (see the module
    doc): a blank object of ``kind``, then its items (a list's or a dict's subclass), then
    its state."""

    __slots__ = ("kind", "state", "listed", "keyed")

    def __init__(self) -> None:
        self.kind: type = object
        self.state: Any = None  # (None: no state, as pickle skips a None state)
        self.listed: Optional[List[Any]] = None
        self.keyed: Optional[List[Tuple[Any, Any]]] = None

    def __reduce__(self) -> Tuple[Any, ...]:
        # (fresh iterators each time: a message pickled twice, the lane's then TensorPipe's)
        return (_new, (self.kind,), self.state, None if self.listed is None else iter(self.listed),
                None if self.keyed is None else iter(self.keyed))


def _plan_of(kind: type) -> int:
    """How pickle's default reduction treats ``kind``'s objects, where the walk can mirror it."""
    if kind is types.SimpleNamespace:  # (its reduction: the class, then its __dict__ as state)
        return _STATE
    if kind in copyreg.dispatch_table or getattr(kind, "__reduce_ex__") is not _OBJECT_REDUCE_EX \
            or getattr(kind, "__reduce__") is not _OBJECT_REDUCE:
        return _LEAVE  # pickled its own way (an enum, a tensor subclass, a lock's refusal)
    if issubclass(kind, tuple):  # a namedtuple without instance attributes: its items are all
        return _FIELDS if hasattr(kind, "_make") and hasattr(kind, "_fields") and kind.__dictoffset__ == 0 else _LEAVE
    if issubclass(kind, dict):  # a batch class over a dict (an RLlib SampleBatch): its items too
        return _KEYED if _by_default(kind, dict) else _LEAVE
    if issubclass(kind, list):
        return _LISTED if _by_default(kind, list) else _LEAVE
    if kind.__dictoffset__ != 0 and _by_default(kind, object):
        return _STATE
    return _GETSTATE if _by_getstate(kind) else _LEAVE


def _by_default(kind: type, base: type) -> bool:
    """Whether ``kind``, a subclass of ``base``, is pickled by ``base``'s default reduction:
    not with slots, a proxy's attribute lookup, constructor arguments or a state of its own."""
    return (kind.__new__ is base.__new__
            and kind.__getattribute__ is base.__getattribute__
            and not any("__slots__" in vars(cls) for cls in kind.__mro__)
            and not hasattr(kind, "__getnewargs_ex__") and not hasattr(kind, "__getnewargs__")
            and getattr(kind, "__getstate__", None) is _OBJECT_GETSTATE)


def _by_getstate(kind: type) -> bool:
    """Whether pickle reduces ``kind``'s objects to a blank one and what ``__getstate__``
    returns (slots, or a state of the class's own), with nothing the walk cannot mirror."""
    if getattr(kind, "__getattribute__") is not object.__getattribute__ or hasattr(kind, "__getnewargs_ex__") \
            or hasattr(kind, "__getnewargs__") or _carried_own_way(kind):
        return False
    # (A type of C without slots of Python, a lock, refuses pickling in its own way.)
    own = getattr(kind, "__getstate__", None) is not _OBJECT_GETSTATE
    return own or any("__slots__" in vars(cls) for cls in kind.__mro__)


def _carried_own_way(kind: type) -> bool:
    """Whether torch RPC's pickler reduces ``kind`` its own way (an RRef, a script module,
    a class registered with it, a RemoteModule), bypassed if the walk rebuilt it."""
    if issubclass(kind, torch.jit.ScriptModule):
        return True
    internal = sys.modules.get("torch.distributed.rpc.internal")  # (loaded with torch RPC)
    if internal is None:
        return False
    # (private names of torch's: read with defaults, so that a torch without them walks on)
    owns = tuple(getattr(getattr(internal, "_internal_rpc_pickler", None), "_class_reducer_dict", ()))
    rref = getattr(getattr(getattr(internal, "dist", None), "rpc", None), "PyRRef", None)
    return issubclass(kind, owns + ((rref,) if isinstance(rref, type) else ()))


def _plan(kind: type) -> int:
    plan = _plans.get(kind)
    if plan is None:
        if len(_plans) >= _PLANS_MAX:  # classes made anew per call (a namedtuple in a function)
            _plans.clear()             # must not pile up here, each kept alive
            _slot_values.clear()
        try:
            plan = _plan_of(kind)
            if plan == _GETSTATE and kind.__dictoffset__ == 0 and getattr(kind, "__getstate__") is _OBJECT_GETSTATE:
                names = copyreg._slotnames(kind)  # type: ignore[attr-defined]  # (what pickle reads)
                _slot_values[kind] = (operator.attrgetter(*names) if names else None, len(names) > 1)
        except Exception:  # a metaclass whose attribute lookup raises: the carrier decides
            plan = _LEAVE
        _plans[kind] = plan
    return plan


def _plain(values: Any) -> bool:
    """Whether ``values`` (a list, tuple or dict's values) holds only atoms, directly or in
    lists, tuples, dicts or objects of one class (namedtuples, dataclasses) of atoms."""
    kinds = set(map(type, values))
    if kinds <= _ATOMS:
        return True
    if kinds <= _SEQUENCES:
        return _ATOMS.issuperset(map(type, itertools.chain.from_iterable(values)))
    if kinds <= _DICTS:
        return _ATOMS.issuperset(map(type, itertools.chain.from_iterable(map(dict.values, values))))
    if kinds <= _MIXED:  # atoms beside lists, tuples or dicts of atoms: a pool call's (function, args, kwargs)
        return all(_ATOMS.issuperset(map(type, value.values() if type(value) is dict else value))
                   for value in values if type(value) not in _ATOMS)
    if len(kinds) == 1:
        plan = _plan(next(iter(kinds)))
        if plan == _FIELDS:  # (a list of namedtuples of numbers)
            return _ATOMS.issuperset(map(type, itertools.chain.from_iterable(values)))
        if plan == _STATE:  # (a list of dataclasses of numbers)
            states: Any = map(vars, values)
            return _ATOMS.issuperset(map(type, itertools.chain.from_iterable(map(dict.values, states))))
        if plan == _GETSTATE:
            return _plain_states(next(iter(kinds)), values)
    return False


def _plain_states(kind: type, values: Any) -> bool:
    """Whether objects of ``kind``, pickled by their slots or ``__getstate__``, hold only atoms."""
    try:
        if kind in _slot_values:  # slots only: their values read at C speed
            getter, several = _slot_values[kind]
            if getter is None:
                return True
            rows = map(getter, values)
            return _ATOMS.issuperset(map(type, itertools.chain.from_iterable(rows) if several else rows))
        return _plain(list(map(operator.methodcaller("__getstate__"), values)))  # (dicts or lists of atoms)
    except Exception:  # an unset slot, a refusal to pickle: each is walked (or left) on its own
        return False


def untouched(obj: Any) -> bool:
    """Whether :func:`walk` would return ``obj`` as it is without a call per part: an atom,
    or a list, tuple or dict of atoms (directly or one level down). Lets a caller skip
    what it sets up around a walk (a pool call's ``(function, args, kwargs)``)."""
    kind = type(obj)
    if kind in _ATOMS:
        return True
    if kind is tuple or kind is list:
        return not obj or _plain(obj)
    return kind is dict and (not obj or _plain(obj.values()))


def walk(obj: Any, leaf: Leaf, memo: Optional[Dict[int, Any]] = None, array: Optional[ArrayLeaf] = None) -> Any:
    """``obj`` with each tensor ``t`` (in lists, tuples, dicts, namedtuples and objects
    pickled by their state) replaced by ``leaf(t)``, and with ``array`` given, each numpy
    array ``a`` by ``array(a)``.

    Returns ``obj`` itself when ``leaf`` replaced nothing (it returns its argument); an
    object met twice is walked once, so the receiver gets one object twice, as pickle
    would give. ``memo``: shared by the walks of one message's parts (None: a new one).
    """
    kind = type(obj)
    if kind is torch.Tensor or kind is torch.nn.Parameter or kind is np.ndarray:
        one = leaf if kind is not np.ndarray else array
        if one is None:
            return obj
        if memo is None:
            return one(obj)
        done = memo.get(id(obj))
        if done is None:
            done = memo[id(obj)] = one(obj)
        return done
    if kind in _ATOMS:
        return obj
    memo = {} if memo is None else memo
    done = memo.get(id(obj))
    if done is not None:
        return obj if done is _IN_PROGRESS else done
    if kind is list:
        return obj if not obj or _plain(obj) else _list(obj, leaf, memo, array)
    if kind is dict or kind is collections.OrderedDict or kind is collections.defaultdict:
        return obj if not obj or _plain(obj.values()) else _dict(obj, leaf, memo, array)
    if kind is tuple:
        return obj if not obj or _plain(obj) else _tuple(obj, leaf, memo, array, tuple)
    plan = _plan(kind)
    if plan == _FIELDS:
        return obj if _plain(obj) else _tuple(obj, leaf, memo, array, kind._make)
    if plan == _STATE or plan == _KEYED or plan == _LISTED:
        return _object(obj, leaf, memo, array, plan)
    if plan == _GETSTATE:
        return _stated(obj, leaf, memo, array)
    if kind is collections.deque:  # (a frame stack)
        return obj if not obj or _plain(obj) else _tuple(obj, leaf, memo, array,
                                                         lambda items: collections.deque(items, obj.maxlen))
    return obj


def _list(obj: list, leaf: Leaf, memo: Dict[int, Any], array: Optional[ArrayLeaf]) -> Any:
    out: list = []
    memo[id(obj)] = out  # (before the items: one that reaches this list gets the copy)
    out.extend([walk(item, leaf, memo, array) for item in obj])
    if all(a is b for a, b in zip(out, obj)):
        memo[id(obj)] = obj
        return obj
    return out


def _dict(obj: dict, leaf: Leaf, memo: Dict[int, Any], array: Optional[ArrayLeaf]) -> Any:
    """A dict, an OrderedDict or a defaultdict; keys that are not atoms are walked too (an
    optimizer's state is keyed by its parameters, which its groups hold too: walked in one
    place and not in the other, they would arrive as two tensors, and its state lost).
    (Not the keys of a dict whose values are atoms, here or one level down in a list or an
    object, which is passed over whole: checking a million keys doubled the time of a dict
    of a million rewards, and the keys of 100,000 infos would add 74%.)"""
    kind = type(obj)
    out: dict = {} if kind is dict else collections.defaultdict(getattr(obj, "default_factory")) \
        if kind is collections.defaultdict else collections.OrderedDict()
    memo[id(obj)] = out
    if _ATOMS.issuperset(map(type, obj)):
        out.update({key: walk(value, leaf, memo, array) for key, value in obj.items()})
        same = all(out[key] is value for key, value in obj.items())
    else:
        pairs = [(walk(key, leaf, memo, array), walk(value, leaf, memo, array)) for key, value in obj.items()]
        out.update(pairs)
        same = all(walked is key and value is obj[key] for (walked, value), key in zip(pairs, obj))
    if same:
        memo[id(obj)] = obj
        return obj
    if kind is collections.OrderedDict:
        out.__dict__.update(obj.__dict__)  # a state dict's _metadata (module versions)
    return out


def _tuple(obj: Any, leaf: Leaf, memo: Dict[int, Any], array: Optional[ArrayLeaf],
           make: Callable[[Any], Any]) -> Any:
    """A tuple, a namedtuple or a deque (``make`` builds one from the walked items)."""
    memo[id(obj)] = _IN_PROGRESS  # (a tuple exists only after its items: met again meanwhile, it stays as it is)
    items = [walk(item, leaf, memo, array) for item in obj]
    out = obj if all(a is b for a, b in zip(items, obj)) else make(items)
    memo[id(obj)] = out
    return out


def _object(obj: Any, leaf: Leaf, memo: Dict[int, Any], array: Optional[ArrayLeaf], plan: int) -> Any:
    """An object pickled by its state; a list's or a dict's subclass, its items too."""
    state = getattr(obj, "__dict__", None) or None
    items = obj.values() if plan == _KEYED else obj if plan == _LISTED else ()
    if _plain(items) and (state is None or _plain(state.values())):
        return obj
    out = _Rebuilt()
    memo[id(obj)] = out  # (before its contents: a part that points back, a child's parent, gets it)
    if plan == _KEYED:
        out.keyed = [(key, walk(value, leaf, memo, array)) for key, value in obj.items()]
        same = all(walked is value for (_, walked), value in zip(out.keyed, obj.values()))
    else:
        out.listed = [walk(item, leaf, memo, array) for item in items] if plan == _LISTED else None
        same = out.listed is None or all(walked is item for walked, item in zip(out.listed, obj))
    walked_state = None if state is None else _dict(state, leaf, memo, array)
    if same and walked_state is state:
        memo[id(obj)] = obj
        return obj
    out.kind, out.state = type(obj), walked_state
    return out


def _stated(obj: Any, leaf: Leaf, memo: Dict[int, Any], array: Optional[ArrayLeaf]) -> Any:
    """An object pickled by what its ``__getstate__`` returns (slots, a state of its own)."""
    try:
        state = obj.__getstate__()
    except Exception:  # (its refusal to be pickled: the carrier says it, with its message)
        return obj
    if state is None or type(state) in _ATOMS:
        return obj
    # The memo keys objects by id: a state made for this call must outlive the walk, or
    # another object could take its id and find its entry.
    memo[~id(state)] = state
    out = _Rebuilt()
    memo[id(obj)] = out  # (before the state: a part that points back gets it)
    walked = walk(state, leaf, memo, array)
    if walked is state:
        memo[id(obj)] = obj
        return obj
    out.kind, out.state = type(obj), walked
    return out


def _new(kind: Any) -> Any:
    """The receiver's blank object; pickle then sets its state as for any object (its
    ``__setstate__``, or its ``__dict__`` updated). (Not ``copyreg.__newobj__``, which
    pickle accepts only from the object's own class.)"""
    return kind.__new__(kind)
