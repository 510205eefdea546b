"""The same-host walk against pickle, on random messages: what arrives after the walk has
the structure, the types, the values and the sharing that plain pickling gives.

The walk rebuilds containers and objects around the tensors it replaces (lists, tuples,
dicts with tensor keys, defaultdicts, OrderedDicts, deques, namedtuples, dataclasses,
SimpleNamespaces, slotted classes, classes with their own ``__getstate__``, dict and list
subclasses), so each of them, an object
reached twice and a structure that reaches itself included, must arrive as pickle would
give it. Random messages find the combinations no hand-written case thinks of.
"""

from __future__ import annotations

import collections
import dataclasses
import pickle
import random
import types
from typing import Any, Dict, List

import numpy as np
import pytest
import torch

from machinlike._shm._walk import untouched, walk

_MARK = 1000.0  # a walked tensor arrives with this added: the walk's reach is seen too


class _Placeholder:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __reduce__(self):
        return (torch.add, (self.tensor, _MARK))


class _ArrayPlaceholder:
    def __init__(self, array: np.ndarray) -> None:
        self.array = array

    def __reduce__(self):
        return (np.add, (self.array, _MARK))


_Pair = collections.namedtuple("_Pair", "a b")


@dataclasses.dataclass
class _Plain:
    a: Any
    b: Any


@dataclasses.dataclass(slots=True)
class _SlottedDataclass:
    a: Any
    b: Any


class _Slots:
    __slots__ = ("a", "b")


class _OwnState:
    def __init__(self) -> None:
        self.a = self.b = None

    def __getstate__(self):
        return {"a": self.a, "b": self.b}

    def __setstate__(self, state):
        self.a, self.b = state["a"], state["b"]


class _Keyed(dict):
    pass


class _Listed(list):
    pass


def _message(rng: random.Random, depth: int, made: List[Any]) -> Any:
    """A random message of tensors and numpy arrays; ``made`` collects what may be
    referred to again."""
    if depth == 0 or rng.random() < 0.2:
        pick = rng.random()
        if pick < 0.3 and made:
            return rng.choice(made)  # one object reached twice
        if pick < 0.6:
            value = float(rng.randint(0, 9))
            made.append(torch.full((2,), value) if rng.random() < 0.7 else np.full(2, value))
            return made[-1]
        return rng.choice([1, 2.5, "s", None, True, len, _message])  # (functions: left whole, as atoms)
    a, b = _message(rng, depth - 1, made), _message(rng, depth - 1, made)
    kind = rng.randrange(15)
    out: Any
    if kind == 0:
        out = [a, b]
    elif kind == 1:
        out = (a, b)
    elif kind == 2:
        out = {"a": a, "b": b}
    elif kind == 3:
        out = _Pair(a, b)
    elif kind == 4:
        out = _Plain(a, b)
    elif kind == 5:
        out = _SlottedDataclass(a, b)
    elif kind == 6:
        out = _Slots()
        out.a = a
        if rng.random() < 0.7:  # (else a slot without a value)
            out.b = b
    elif kind == 7:
        out = _OwnState()
        out.a, out.b = a, b
    elif kind == 8:
        out = _Keyed(a=a, b=b)
        out.count = 1
    elif kind == 9:
        out = _Listed([a, b])
    elif kind == 10:
        out = collections.defaultdict(list, a=[a], b=b)
    elif kind == 11:  # tensors as keys (an optimizer's state), beside a tensor value
        out = {key: 1 for key in (a, b) if isinstance(key, torch.Tensor)}  # (arrays are not hashable)
        out["v"] = torch.zeros(1)
    elif kind == 12:
        out = collections.deque([a, b], maxlen=rng.choice([None, 4]))
    elif kind == 13:
        out = collections.OrderedDict(b=b, a=a)
    else:
        out = types.SimpleNamespace(a=a, b=b)
    if type(out) in (list, dict, _Plain, _OwnState, _Slots) and rng.random() < 0.15:
        if isinstance(out, list):
            out.append(out)  # a structure that reaches itself
        elif isinstance(out, dict):
            out["self"] = out
        else:
            out.a = out
    made.append(out)
    return out


def _shape(x: Any, seen: Dict[int, int], mark: float) -> Any:
    """``x``'s structure, types and values, with sharing as back references."""
    if id(x) in seen:
        return ("again", seen[id(x)])
    if isinstance(x, (int, float, str, bool, type(None))):
        return x
    seen[id(x)] = len(seen)
    if isinstance(x, (torch.Tensor, np.ndarray)):
        return (type(x).__name__, tuple((x - mark).tolist()))
    name = type(x).__name__
    if isinstance(x, dict):
        items = [(_shape(k, seen, mark) if not isinstance(k, (str, int)) else k, _shape(v, seen, mark))
                 for k, v in x.items()]
        extra = (x.default_factory,) if isinstance(x, collections.defaultdict) else ()
        return (name, tuple(items), tuple(sorted(vars(x).items())) if hasattr(x, "__dict__") else (), *extra)
    if isinstance(x, (list, tuple, collections.deque)):
        extra = (x.maxlen,) if isinstance(x, collections.deque) else ()
        return (name, tuple(_shape(v, seen, mark) for v in x), *extra)
    if not hasattr(x, "__dict__"):
        return (name, tuple((n, _shape(getattr(x, n), seen, mark) if hasattr(x, n) else "unset") for n in ("a", "b")))
    return (name, tuple((n, _shape(v, seen, mark)) for n, v in sorted(vars(x).items())))


@pytest.mark.parametrize("seed", range(4))
def test_walked_messages_arrive_as_pickle_gives_them(seed):
    rng = random.Random(seed)
    walked = 0
    for _ in range(300):
        message = _message(rng, rng.randint(1, 5), [])
        expected = _shape(pickle.loads(pickle.dumps(message)), {}, 0.0)
        out = walk(message, _Placeholder, None, _ArrayPlaceholder)
        walked += out is not message
        assert _shape(pickle.loads(pickle.dumps(out)), {}, _MARK) == expected, message
    assert walked > 100  # (the messages did hold tensors to replace)


def test_a_pool_calls_tuple_is_left_whole_unless_a_tensor_sits_one_level_down():
    """A pool call's ``(function, args, kwargs)`` of numbers is passed over without a walk
    (the walk was half of its encoding); the same shapes with a tensor inside are walked."""
    t = torch.zeros(2)
    for whole in [(len, (1, "s"), None), (len, [2.5], {"k": 1}), (_message, (), {}), [len, int, 3], {"f": len}]:
        assert untouched(whole) and walk(whole, _Placeholder) is whole
    for holding in [(len, (t,), None), (len, (1,), {"k": t}), [len, [t]], {"f": len, "t": t}, (len, ((t,),), None)]:
        assert not untouched(holding)
        out = walk(holding, _Placeholder)
        assert out is not holding and _shape(pickle.loads(pickle.dumps(out)), {}, _MARK) == \
            _shape(pickle.loads(pickle.dumps(holding)), {}, 0.0)
