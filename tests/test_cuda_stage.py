"""CUDA tensors through RpcGroup calls, staged through the CPU (``distributed._calls.cuda_stage``).

On the CPU: what is staged, where it lands, the single walk, a CPU-only process skipping
it all, and a staged tensor crossing real torch RPC. The end-to-end CUDA runs (static and
elastic worlds, real processes) are marked ``gpu`` and skip without a CUDA device.
"""

from __future__ import annotations

import collections
import dataclasses
import pickle

import pytest
import torch

from machinlike._pids import own_identity
from machinlike.distributed._calls import cuda_stage as _cuda_stage, samehost as _samehost
from machinlike.testing import world_test


# ------------------------------------------------------------------ where it lands
@pytest.mark.parametrize("index, ready, count, expected", [
    (0, True, 1, "cuda:0"), (1, True, 2, "cuda:1"),
    (1, True, 1, "cpu"),    # the receiver has no cuda:1
    (0, False, 4, "cpu"),   # a CPU process on a GPU machine gets no CUDA context from a peer
    (0, True, 0, "cpu"), (3, False, 0, "cpu"),
])
def test_lands_on_the_same_index_or_the_cpu(index, ready, count, expected):
    assert _cuda_stage.lands_on(index, ready, count) == torch.device(expected)


@pytest.mark.parametrize("make", [
    lambda: torch.arange(6.0).reshape(2, 3),
    lambda: torch.arange(12, dtype=torch.int16).reshape(3, 4).t(),  # not contiguous
    lambda: torch.ones(3, requires_grad=True),
    lambda: torch.nn.Parameter(torch.ones(2, 2)),
    lambda: torch.nn.Parameter(torch.ones(2), requires_grad=False),
    lambda: torch.zeros(0, 5),
])
def test_a_staged_tensor_lands_equal_on_the_cpu_here(make):
    tensor = make()
    pending = []
    staged = _cuda_stage.stage_tensor(tensor, pending)
    assert pending == []  # a CPU source: a blocking copy, nothing to synchronise
    landed = pickle.loads(pickle.dumps(staged))
    assert landed.device.type == "cpu"  # this process has no CUDA
    assert type(landed) is type(tensor) and landed.requires_grad == tensor.requires_grad
    assert landed.dtype == tensor.dtype and torch.equal(landed.detach(), tensor.detach())
    assert landed.grad_fn is None  # autograd history does not travel


# ------------------------------------------------------------------------ the walk
def _marked(tensor):
    return ("staged", tensor)


def test_walk_replaces_tensors_in_containers_and_keeps_the_rest():
    a, b = torch.ones(2), torch.zeros(3)
    state = collections.OrderedDict([("w", a)])
    state._metadata = {"": {"version": 1}}  # what a module's state dict carries
    obj = ([a, {"b": b, "n": 3}], (a, "text"), state, torch.Size([2]), None)
    out = _cuda_stage.walk(obj, _marked)
    assert out[0][0] == ("staged", a) and out[0][1] == {"b": ("staged", b), "n": 3}
    assert out[1][0] is out[0][0]  # one tensor twice: one replacement, as pickle would give
    assert type(out[2]) is collections.OrderedDict and out[2]._metadata == {"": {"version": 1}}
    assert out[3] is obj[3] and out[4] is None


def test_walk_returns_the_object_itself_when_nothing_changed():
    obj = ([torch.ones(2)], {"x": (torch.ones(1),)})
    assert _cuda_stage.walk(obj, lambda t: t) is obj
    assert _cuda_stage.walk((), _marked) == () and _cuda_stage.walk({}, _marked) == {}


def test_walk_passes_over_plain_data_but_finds_a_tensor_beside_it():
    np = pytest.importorskip("numpy")
    rewards = [float(i) for i in range(1000)] + [np.float32(1.0), None, "done", True]
    steps = [(i, 0.5, False) for i in range(100)]
    infos = [{"lives": 3, "score": 1.0} for _ in range(100)]
    for plain in (rewards, steps, infos, tuple(steps), {"r": rewards}):
        assert _cuda_stage.walk(plain, _marked) is plain  # the fast path: no copy made
    t = torch.ones(1)
    # Every border of the fast path: a tensor among atoms, one level down in a tuple, a
    # list or a dict, two levels down, and beside sequences and dicts mixed.
    for obj, path in [(rewards + [t], (-1,)), (steps + [(1, t)], (-1, 1)), (infos + [{"x": t}], (-1, "x")),
                      (steps + [[[t]]], (-1, 0, 0)), ([(1,), {"a": t}], (1, "a")),
                      ({"a": 1, "b": [t]}, ("b", 0))]:
        out = _cuda_stage.walk(obj, _marked)
        for key in path:
            out = out[key]
        assert out == ("staged", t), path


class _Box:
    def __init__(self):
        self.t = torch.ones(1)


class _Slots:
    __slots__ = ("t",)

    def __init__(self):
        self.t = torch.ones(1)


class _Args(_Slots):
    __slots__ = ()

    def __getnewargs__(self):  # (made with arguments: left to the carrier)
        return ()


class _Pair:
    __slots__ = ("a", "b")

    def __init__(self, a, b=0.5):
        self.a, self.b = a, b


class _OneSlot:
    __slots__ = ("a",)

    def __init__(self, a):
        self.a = a


class _Kept:
    def __init__(self, a):
        self.a = a

    def __getstate__(self):
        return {"a": self.a}


def test_walk_passes_over_lists_of_slotted_or_own_state_objects_of_numbers():
    """A replay of slotted transitions (or of objects with their own ``__getstate__``)
    holding numbers only is passed over whole; a tensor in any of them is still found."""
    for kind in (_Pair, _OneSlot, _Kept):
        plain = [kind(i) for i in range(100)]
        assert _cuda_stage.walk(plain, _marked) is plain, kind
        t = torch.ones(1)
        for where in (0, 99):
            mixed = [kind(i) for i in range(100)]
            mixed[where] = kind(t)
            back = pickle.loads(pickle.dumps(_cuda_stage.walk(mixed, _marked)))
            assert back[where].a == ("staged", t) and back[50].a == 50, (kind, where)
    unset = [_Pair(1), _Pair(2)]
    del unset[1].b  # (a slot without a value: pickle leaves it out, so does the walk)
    back = pickle.loads(pickle.dumps(_cuda_stage.walk(unset + [_Pair(torch.ones(1))], _marked)))
    assert not hasattr(back[1], "b") and back[2].a[0] == "staged"


def test_walk_finds_tensors_in_objects_pickled_by_their_dict_slots_or_own_state():
    box = _Box()
    out = _cuda_stage.walk([box], _marked)[0]
    assert out is not box and type(pickle.loads(pickle.dumps(out))) is _Box  # pickles as the object, walked
    assert pickle.loads(pickle.dumps(out)).t == ("staged", box.t)
    for kind in (_Slots, torch.nn.Linear):  # slots; a state of its own (a module's __getstate__)
        obj = kind() if kind is _Slots else kind(1, 1)
        back = pickle.loads(pickle.dumps(_cuda_stage.walk([obj], _marked)[0]))
        assert type(back) is kind and (back.t if kind is _Slots else back._parameters["weight"])[0] == "staged"
    args = _Args()
    assert _cuda_stage.walk([args], _marked)[0] is args


def test_walk_leaves_what_torch_rpc_pickles_its_own_way():
    """An RRef, a script module, a RemoteModule: torch RPC's pickler reduces them itself
    (a fork of the RRef, ``torch.jit.save``), which a rebuilt object would bypass."""
    import torch.distributed.rpc as rpc
    from torch.distributed.nn.api.remote_module import RemoteModule

    from machinlike._shm import _walk

    for kind in (rpc.PyRRef, rpc.RRef, RemoteModule, torch.jit.RecursiveScriptModule):
        assert _walk._plan_of(kind) == _walk._LEAVE, kind
    assert _walk._plan_of(torch.nn.Linear) == _walk._GETSTATE


def test_the_walks_plans_stay_bounded_when_classes_are_made_per_call():
    from machinlike._shm import _walk

    for i in range(3 * _walk._PLANS_MAX):
        kind = collections.namedtuple("Made", "x")  # a namedtuple class made inside a loop
        assert _cuda_stage.walk([kind(torch.ones(1))], _marked)[0].x == ("staged", torch.ones(1))
        slotted = dataclasses.make_dataclass("Slotted", ["x"], slots=True)  # (its slots' getter is kept too)
        assert _cuda_stage.walk([slotted(1), slotted(2)], _marked)[0].x == 1
    assert len(_walk._plans) <= _walk._PLANS_MAX and len(_walk._slot_values) <= _walk._PLANS_MAX


class _Odd(type):
    def __getattr__(cls, name):
        raise RuntimeError(f"no {name} here")  # (not AttributeError: hasattr lets it through)


class _OddClass(metaclass=_Odd):
    def __init__(self):
        self.t = torch.ones(1)


def test_a_class_whose_attribute_lookup_raises_is_left_to_the_carrier():
    odd = _OddClass()
    assert _cuda_stage.walk([odd], _marked)[0] is odd


def test_encode_without_cuda_tensors_or_shm_changes_nothing():
    obj = ({"x": torch.ones(1000)}, [torch.ones(3)])
    assert _cuda_stage.encode(obj, 0) is obj


def test_encode_puts_large_cpu_tensors_through_shm_in_the_same_walk():
    small, big = torch.ones(4), torch.ones(1 << 16)
    out = _bare(_cuda_stage.encode([small, big], 1 << 10))  # (a segment was lent: guarded)
    assert torch.equal(pickle.loads(pickle.dumps(out[0])), small)  # (too few to bundle: pickles as itself)
    assert not isinstance(out[1], torch.Tensor)  # a same-host placeholder
    assert torch.equal(pickle.loads(pickle.dumps(out[1])), big)


def _bare(encoded):
    """An encoded object without its wrapper (``_shm._unsent``: a segment was lent for it)."""
    from machinlike._shm._unsent import _Guarded

    assert type(encoded) is _Guarded
    return encoded.value


# ---------------------------------------------------------- CPU-only processes skip it
def test_a_cpu_only_process_is_not_active():
    assert not torch.cuda.is_initialized()
    assert _cuda_stage.active() is False


def test_cpu_only_calls_are_not_walked_by_the_stage(monkeypatch):
    def walked(*_):
        raise AssertionError("a CPU-only process walked a call for CUDA tensors")

    monkeypatch.setattr(_cuda_stage, "walk", walked)
    args = (torch.ones(3), {"k": torch.ones(2)})
    call = ("what", args, {"x": torch.ones(1)})
    out = _samehost.outgoing("someone", call)
    assert out == (*call, 0) and out[1] is args
    value = [torch.ones(2)]
    assert _samehost.reply(value, 0) is value


def test_with_cuda_a_local_call_is_walked_once(monkeypatch):
    # A process with CUDA: the stage's walk does the same-host encoding too; _shm's own
    # walk must not run a second time over the same arguments.
    monkeypatch.setattr(_cuda_stage, "active", lambda: True)
    monkeypatch.setattr(_samehost._shm, "encode", lambda *a: pytest.fail("second walk"))
    monkeypatch.setattr(_samehost._shm, "encode_parts", lambda *a: pytest.fail("second walk"))
    walks = []
    real = _cuda_stage.walk

    def counting(obj, leaf, memo=None, array=None):
        if memo is None:
            walks.append(obj)
        return real(obj, leaf, memo, array)

    monkeypatch.setattr(_cuda_stage, "walk", counting)

    class Local:
        enabled, threshold = True, 1 << 10

        def local(self, member):
            return True

        def cuda_target(self, member, deadline=None):
            return None  # the peer takes no CUDA IPC: staged, as tested here

        def word_of(self, member):
            return 0  # (its process not known: its segments stay lent until it takes them)

    monkeypatch.setattr(_samehost, "_current", Local())
    big = torch.ones(1 << 12)
    what, args, kwargs, reply = _samehost.outgoing("peer", ("f", (big,), {}))
    # (args and kwargs in one walk)
    assert _samehost._shm.split_terms(reply) == (1 << 10, own_identity(), 0)  # (no key: no CUDA IPC)
    assert not isinstance(_bare(args)[0], torch.Tensor) and walks == [((big,), {})]
    walks.clear()
    array = big.numpy().copy()  # a numpy array takes the same walk
    _, args, _, _ = _samehost.outgoing("peer", ("f", (array,), {}))
    assert type(_bare(args)[0]) is not type(array) and len(walks) == 1
    walks.clear()
    out = _samehost.reply([big], 1 << 10)
    assert not isinstance(_bare(out)[0], torch.Tensor) and walks == [[big]]


# ------------------------------------------------- a staged tensor across real RPC
def _stage_here(tensor):
    # What a CUDA callee's reply hook makes of a CUDA result, from a CPU tensor here.
    return _cuda_stage.stage_tensor(tensor, [])


def _staged_crossing(world):
    world.wait_for_members(["0", "1"], timeout=60)
    group = world.create_rpc_group("stage", ["0", "1"])
    if world.name == "1":
        group.register("stage", _stage_here)
    group.barrier()
    if world.name == "0":
        sent = torch.nn.Parameter(torch.arange(6.0).reshape(2, 3))
        got = group.registered_sync("stage", args=(sent,))
        assert type(got) is torch.nn.Parameter and got.device.type == "cpu" and torch.equal(got, sent)
    group.barrier()
    group.destroy()


@world_test(2, timeout=90)
def test_a_staged_tensor_crosses_real_rpc_and_lands_on_the_cpu(world):
    _staged_crossing(world)


@world_test(2, timeout=90, max_restarts=1)
def test_a_staged_tensor_crosses_real_rpc_in_an_elastic_world(world):
    assert world.elastic
    _staged_crossing(world)


# ------------------------------------------------------------------------ on a GPU
_ONE_PROCESS = """
import pickle, torch
from machinlike.distributed._calls import cuda_stage as _cuda_stage
x = torch.arange(12.0, device="cuda").reshape(3, 4)
out = _cuda_stage.encode({"a": [x, x.t()], "b": x}, 0)
staged = out["a"][0]
assert type(staged).__name__ == "_Staged" and out["b"] is staged and staged.index == 0
assert staged.host.is_pinned() and staged.host.device.type == "cpu"
back = pickle.loads(pickle.dumps(out))  # this process uses CUDA: back on cuda:0
assert back["a"][0].device == torch.device("cuda", 0) and back["a"][0] is back["b"]
assert torch.equal(back["a"][1], x.t()) and torch.equal(back["b"], x)
print("ok")
"""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_stage_and_land_in_a_cuda_process():
    # A fresh interpreter: CUDA initialised in pytest's own process would leave the
    # launcher's later forks unable to use it.
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    done = subprocess.run([sys.executable, "-c", _ONE_PROCESS], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


def _double(x):
    return x * 2


def _clone(x):
    return x.clone()  # with autograd history: it stays behind


def _sum_parts(parts):
    return {"sum": parts["a"] + parts["b"][0], "n": parts["b"][1]}


def _devices(obj):
    return [t.device.type for t in (obj if isinstance(obj, (list, tuple)) else [obj])]


def _cuda_round_trips(world, group):
    me = world.name
    if me == "1":
        torch.cuda.init()  # a GPU member: what it gets lands on its GPU
    if me == "2":
        group.register("cpu_devices", _devices)  # never initialises CUDA
    group.register(f"double/{me}", _double)
    group.register(f"echo/{me}", _echo)
    group.barrier()
    if me == "0":
        x = torch.arange(1 << 20, dtype=torch.float32, device="cuda").reshape(1024, 1024)
        y = group.registered_sync("double/1", args=(x,))
        assert y.device == torch.device("cuda", 0) and torch.equal(y, x * 2)
        y = group.registered_async("double/1", args=(x.t(),)).wait()  # a view, not contiguous
        assert y.device.type == "cuda" and torch.equal(y, x.t() * 2)
        out = group.rpc_sync("1", _sum_parts, args=({"a": x, "b": [x, 3]},))
        assert out["n"] == 3 and out["sum"].device.type == "cuda" and torch.equal(out["sum"], x * 2)
        w = torch.ones(3, device="cuda", requires_grad=True)
        back = group.rpc_sync("1", _clone, args=(w,))
        assert back.device.type == "cuda" and back.requires_grad and back.grad_fn is None
        # A CPU-only member receives CPU tensors (and no CUDA context); its CPU reply
        # comes back as CPU tensors.
        assert group.registered_sync("cpu_devices", args=([x, x.half()],)) == ["cpu", "cpu"]
        assert group.registered_sync("double/2", args=(x,)).device.type == "cpu"
        # A module and its optimizer (objects pickled by their own __getstate__): their
        # CUDA tensors are found, arrive on the GPU (or the CPU of a CPU-only member) as
        # Parameters, and the optimizer's state stays keyed by the model's parameters.
        model = torch.nn.Linear(256, 256).cuda()
        optimizer = torch.optim.Adam(model.parameters())
        model(torch.ones(2, 256, device="cuda")).sum().backward()
        optimizer.step()
        for member, device in (("1", "cuda"), ("2", "cpu")):
            model2, optimizer2 = group.registered_sync(f"echo/{member}", args=((model, optimizer),))
            params = optimizer2.param_groups[0]["params"]
            assert all(type(p) is torch.nn.Parameter and p.device.type == device for p in params), member
            assert all(a is b for a, b in zip(model2.parameters(), params)) and all(p in optimizer2.state for p in params)
            assert torch.equal(model2.weight.cpu(), model.weight.cpu())
    group.barrier()
    if me == "2":
        assert not torch.cuda.is_initialized()
    group.destroy()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@world_test(3, timeout=120)
def test_cuda_tensors_through_a_static_group(world):
    _cuda_round_trips(world, world.create_rpc_group("cuda", ["0", "1", "2"]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@world_test(3, timeout=120, max_restarts=1)
def test_cuda_tensors_through_an_elastic_group(world):
    assert world.elastic
    world.wait_for_members(["0", "1", "2"], timeout=60)
    _cuda_round_trips(world, world.create_rpc_group("cuda", ["0", "1", "2"]))  # no device maps anywhere


def _echo(x):
    return x


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@world_test(2, timeout=120)
def test_cuda_tensors_without_a_storage_of_their_own_cross(world):
    """Compressed sparse and nested CUDA tensors are neither exported through IPC nor
    staged through pinned memory (they have no plain storage); torch's own copy takes them
    to the CPU and the RPC pickler sends them as their parts (``_transport.tensor_parts``)."""
    torch.cuda.init()
    group = world.create_rpc_group("parts", ["0", "1"])
    group.register(f"echo/{world.name}", _echo)
    group.barrier()
    if world.name == "0":
        dense = torch.eye(64, device="cuda")
        nested = torch.nested.nested_tensor([torch.ones(300, 300), torch.ones(200, 300)], device="cuda")
        for value in (dense.to_sparse_csr(), dense.to_sparse_bsc((4, 4)), nested):
            back = group.registered_sync("echo/1", args=(value,))
            assert back.device.type == "cuda" and back.layout == value.layout, (back.device, back.layout)
            if value.is_nested:
                assert all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(back.unbind(), value.unbind()))
            else:
                assert torch.equal(back.to_dense().cpu(), value.to_dense().cpu())
    group.barrier()
    group.destroy()
