"""machinlike.pickle: by-value functions and classes, tensor copy vs share, real processes."""

from __future__ import annotations

import copyreg
import gc
import os
import importlib
import io
import pathlib
import pickle
import sys

import pytest

import _background
import toolkit_targets as targets
import torch
from fresh_import import import_report

from machinlike import _byvalue
from machinlike.pickle import Pickler, dumps, loads, mark_static_module
from machinlike.process import Process
from machinlike.queue import SimpleQueue

JOIN = 30.0
SCALE = 10


def run_child(target, *args):
    """Run ``target(*args)`` in a child process (warm context) and re-raise its failure."""
    p = Process(target=target, args=args)
    p.start()
    p.join(JOIN)
    assert p.exitcode is not None, "child did not finish"
    p.watch()
    assert p.exitcode == 0
    return p.pid


# ---------------------------------------------------------------- functions and classes


def test_lambda_round_trip_here_and_in_a_child():
    double = lambda x: x * 2  # noqa: E731
    assert loads(dumps(double))(21) == 42
    run_child(targets.call_loaded, dumps(double), 4, 8)


def test_closure_over_a_tensor_copy_and_share():
    t = torch.zeros(3)

    def bump():
        t.add_(1)
        return t.clone()

    copied = loads(dumps(bump, copy_tensor=True))
    assert torch.equal(copied(), torch.ones(3))
    assert torch.equal(t, torch.zeros(3)), "copy mode must not reach the original"
    shared = loads(dumps(bump, copy_tensor=False))
    shared()
    assert torch.equal(t, torch.ones(3)), "share mode must edit the original"


def test_local_class_and_its_instances():
    class Point:
        dims = 2

        def __init__(self, x, y):
            self.x, self.y = x, y

        def norm2(self):
            return self.x * self.x + self.y * self.y

    cls, p = loads(dumps((Point, Point(3, 4))))
    assert isinstance(p, cls) and p.norm2() == 25 and cls.dims == 2
    assert cls.__qualname__ == Point.__qualname__
    assert loads(dumps(Point(1, 2))).norm2() == 5


def test_closure_changes_are_not_served_from_a_stale_cache():
    x = 1
    get = lambda: x  # noqa: E731
    assert loads(dumps(get))() == 1
    x = 2  # noqa: F841 - read through the closure
    assert loads(dumps(get))() == 2
    payload = dumps(get)
    first, second = loads(payload), loads(payload)
    assert first is not second
    first.attribute = "only on the first"
    assert not hasattr(second, "attribute")


def test_recurse_captures_globals_by_value():
    global SCALE

    def scaled(v):
        return v * SCALE

    by_reference = dumps(scaled, recurse=False)
    by_value = dumps(scaled, recurse=True)
    old = SCALE
    try:
        SCALE = 100
        assert loads(by_reference)(2) == 200  # refers to this module's namespace
        assert loads(by_value)(2) == 2 * old  # carried the value it had
    finally:
        SCALE = old


def test_objects_only_dill_can_pickle():
    import threading

    assert isinstance(loads(dumps(threading.Lock())), type(threading.Lock()))
    assert loads(dumps(type(None))) is type(None)
    assert list(loads(dumps({"a": 1}.keys()))) == ["a"]


def test_unpicklable_object_raises():
    with pytest.raises((TypeError, pickle.PicklingError)):
        dumps((i for i in range(3)))


def _nested(levels):
    nested = []
    for _ in range(levels):
        nested = [nested]
    return nested


# Deeper than any interpreter lets the C pickler go: up to Python 3.11 its bound is the
# recursion limit (1000 by default); from 3.12 on it is a fixed C limit that
# sys.setrecursionlimit() does not change (about 750 levels of lists in 3.12.0-3.12.2,
# about 5000 from 3.12.3 and in 3.13): 3 x the recursion limit pickles fine there.
_TOO_DEEP = 50_000


def test_recursion_error_becomes_pickling_error():
    with pytest.raises(pickle.PicklingError, match=r"too deeply nested to pickle \(maximum recursion depth "
                                                   r"exceeded.*\); flatten it. Raising sys.setrecursionlimit"):
        dumps(_nested(_TOO_DEEP))
    assert loads(dumps([1, [2]])) == [1, [2]], "the pickler must stay usable"
    # The same where dill meets it (in a lambda's closure: pickled by value).
    nested = _nested(_TOO_DEEP)
    with pytest.raises(pickle.PicklingError, match="too deeply nested"):
        dumps(lambda: nested)
    assert loads(dumps([1, [2]])) == [1, [2]]


def test_nesting_within_the_interpreters_limit_pickles():
    nested = _nested(400)  # within every interpreter's C pickler bound
    assert loads(dumps(nested)) == nested


def test_mark_static_module(tmp_path, monkeypatch):
    (tmp_path / "ml_static_mod.py").write_text("GEN = (i for i in range(3))\nVALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("ml_static_mod")
    try:
        with pytest.raises((TypeError, pickle.PicklingError)):
            dumps(module)  # dill pickles a module outside site-packages by value
        mark_static_module(module)
        assert loads(dumps(module)) is module
        assert loads(dumps(lambda: module.VALUE, recurse=True))() == 7
    finally:
        _byvalue.static_modules.discard("ml_static_mod")
        sys.modules.pop("ml_static_mod", None)
    with pytest.raises(TypeError, match="module must be a module"):
        mark_static_module("ml_static_mod")


# ---------------------------------------------------------------- tensors


def test_numpy_arrays_in_share_mode_travel_through_named_shared_memory_and_outlive_the_sender():
    """A queue's large numpy array went through the pipe in its pickled bytes (0.34 GB/s
    for 64 MB); in share mode it is copied once into named shared memory, as a tensor's
    storage travels, and loads after its sender exited."""
    import numpy as np

    big = np.arange(1 << 18, dtype=np.float64)
    payload = dumps(big, copy_tensor=False)
    assert len(payload) < 4096 and len(dumps(big)) > big.nbytes  # (copy mode: the bytes, as before)
    back = loads(payload)
    assert type(back) is np.ndarray and (back == big).all() and back.dtype == big.dtype
    back[0] = -1  # a copy: ours to write
    assert big[0] == 0
    for small in (np.arange(10), np.array([{"k": 1}] * (1 << 17), dtype=object)):
        assert (loads(dumps(small, copy_tensor=False)) == small).all()
    from machinlike._reductions import manager_primer

    manager_primer()  # (made once per process, for its children, and kept: not a leak)
    before = {p.name for p in pathlib.Path("/dev/shm").glob("torch_*")}
    queue = SimpleQueue()  # (share mode)
    try:
        child = run_child(targets.put_array_and_exit, queue)
        got = queue.get(timeout=JOIN)
    finally:
        queue.close()
    assert got.flags.f_contiguous and (got == np.arange(1 << 18, dtype=np.float64).reshape(512, 512)).all()
    del got
    gc.collect()
    leaked = {p.name for p in pathlib.Path("/dev/shm").glob("torch_*")} - before
    leaked = {name for name in leaked if name.split("_")[1] in (str(child), str(os.getpid()))}
    assert not leaked, f"segments left in /dev/shm: {leaked}"


@pytest.mark.parametrize("copy_tensor", [True, False], ids=["copy", "share"])
def test_in_place_edit_in_child_reaches_parent_only_when_shared(copy_tensor):
    t = torch.zeros(4)
    run_child(targets.load_and_add, dumps(t, copy_tensor=copy_tensor))
    assert torch.equal(t, torch.zeros(4) if copy_tensor else torch.ones(4))


def test_same_shared_payload_loaded_twice_in_one_process():
    t = torch.arange(4.0)
    payload = dumps(t, copy_tensor=False)
    a, b = loads(payload), loads(payload)
    a.add_(1)
    assert torch.equal(b, torch.arange(4.0) + 1) and torch.equal(t, b)


def test_shared_payload_outlives_the_sender_tensor():
    payload = dumps(torch.full((3,), 5.0), copy_tensor=False)
    gc.collect()  # the only tensor is gone: the in-transit reference keeps the memory
    a, b = loads(payload), loads(payload)
    a.add_(1)
    assert torch.equal(b, torch.full((3,), 6.0))


def test_same_shared_payload_loaded_twice_in_another_process():
    t = torch.zeros(2)
    payload = dumps(t, copy_tensor=False)
    run_child(targets.load_and_add, payload, 2)
    assert torch.equal(t, torch.full((2,), 2.0))
    assert torch.equal(loads(payload), t), "the parent can still load it too"


def test_tensor_shared_to_two_children():
    t = torch.zeros(3)
    payload = dumps(t, copy_tensor=False)
    children = [Process(target=targets.load_and_add, args=(payload,)) for _ in range(2)]
    children += [Process(target=targets.adder_lambda(), args=(t, 1)) for _ in range(2)]
    for p in children:  # one at a time: an in-place add from two processes at once loses one
        p.start()       # (a clean-clone CI run read [4, 4, 3])
        p.join(JOIN)
        p.watch()
    assert torch.equal(t, torch.full((3,), 4.0))


def test_payload_loaded_in_two_processes_leaves_the_sender_able_to_share():
    # Each child maps, releases and exits in turn: had both released the in-transit
    # reference, the segment's name would be gone although the sender still holds it.
    t = torch.zeros(3)
    payload = dumps(t, copy_tensor=False)
    for _ in range(2):
        run_child(targets.load_and_add, payload)
    run_child(targets.load_and_add, dumps(t, copy_tensor=False))
    assert torch.equal(t, torch.full((3,), 3.0))


def test_storage_already_shared_by_file_descriptor_keeps_its_backing():
    from multiprocessing.reduction import ForkingPickler

    t = torch.zeros(3)
    t.share_memory_()  # torch's default strategy: fd-backed
    ForkingPickler.dumps(t)  # handed out through torch's own reducer: others may use it now
    address = t.data_ptr()
    payload = dumps(t, copy_tensor=False)
    assert t.data_ptr() == address, "the storage must not be moved"
    run_child(targets.load_and_add, payload)
    assert torch.equal(t, torch.ones(3))
    again = dumps(t, copy_tensor=False)
    assert loads(again).data_ptr() == address and loads(again).data_ptr() == address


def test_fd_shared_payload_loads_after_the_sender_exited():
    """machin's case: a child shares a tensor (share_memory_()), pickles it in share mode,
    sends it and exits; the parent loads it afterwards. The child's storage was private,
    so it moved to named shared memory, which outlives the child."""
    before = {p.name for p in pathlib.Path("/dev/shm").glob("torch_*")}
    queue = SimpleQueue(copy_tensor=True)
    try:
        child = run_child(targets.share_and_send, queue)
        t = loads(queue.get(timeout=JOIN))
    finally:
        queue.close()
    assert torch.equal(t, torch.arange(4.0)) and t.is_shared()
    t.add_(1)  # the memory is ours now, and writable
    del t
    gc.collect()
    # (only the child's and ours: tests run alongside under xdist make and drop their own)
    leaked = {p.name for p in pathlib.Path("/dev/shm").glob("torch_*")} - before
    leaked = {name for name in leaked if name.split("_")[1] in (str(child), str(os.getpid()))}
    assert not leaked, f"segments left in /dev/shm: {leaked}"


@pytest.mark.parametrize("copy_tensor", [True, False], ids=["copy", "share"])
def test_parameter_keeps_its_type_and_grad_flag(copy_tensor):
    p = torch.nn.Parameter(torch.ones(2, 2))
    q = loads(dumps(p, copy_tensor=copy_tensor))
    assert type(q) is torch.nn.Parameter and q.requires_grad and torch.equal(q, p)
    frozen = loads(dumps(torch.ones(2, requires_grad=False), copy_tensor=copy_tensor))
    assert not frozen.requires_grad


DTYPES = [torch.bool, torch.uint8, torch.int64, torch.bfloat16, torch.float64, torch.complex64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_round_trip_of_dtypes(dtype):
    t = torch.arange(12).reshape(3, 4).to(dtype)
    u = loads(dumps(t))
    assert u.dtype == dtype and torch.equal(u, t)
    u.view(-1)[0] = t.view(-1)[-1]  # writable, and a copy
    assert torch.equal(t, torch.arange(12).reshape(3, 4).to(dtype))


def test_copy_of_a_view_carries_only_the_view():
    big = torch.zeros(1_000_000)
    view = big[10:20]
    assert len(dumps(view)) < 1000
    transposed = torch.arange(6.0).reshape(2, 3).t()
    assert torch.equal(loads(dumps(transposed)), transposed)
    empty = torch.zeros(0, 3)
    assert loads(dumps(empty)).shape == (0, 3)
    assert loads(dumps(torch.tensor(3.5))).item() == 3.5


@pytest.mark.parametrize("make", [lambda: torch.tensor(5).expand(1), lambda: torch.zeros(2).expand(3, 2)],
                         ids=["one-element-stride-0", "expanded"])
def test_copy_of_a_tensor_with_stride_0(make):
    # A one-element expanded tensor counts as contiguous with stride 0: its byte view
    # needs a copy first (it failed with "self.stride(-1) must be 1").
    tensor = make()
    back = loads(dumps(tensor))
    assert back.shape == tensor.shape and torch.equal(back, tensor)


def test_non_leaf_tensor_copies_but_does_not_share():
    x = torch.ones(2, requires_grad=True)
    y = x * 2
    assert torch.equal(loads(dumps(y)).detach(), torch.full((2,), 2.0))
    with pytest.raises(RuntimeError, match="non-leaf"):
        dumps(y, copy_tensor=False)


def test_storages_copy_and_share():
    t = torch.arange(4.0)
    storage = t.untyped_storage()
    copied = loads(dumps(storage))
    assert copied.nbytes() == storage.nbytes() and copied.data_ptr() != storage.data_ptr()
    shared = loads(dumps(storage, copy_tensor=False))
    assert shared.data_ptr() == t.untyped_storage().data_ptr()


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensor_shared_with_a_child_through_ipc():
    t = torch.zeros(4, device="cuda")
    run_child(targets.load_and_add, dumps(t, copy_tensor=False))
    torch.cuda.synchronize()
    assert torch.equal(t.cpu(), torch.ones(4))


@pytest.mark.gpu
@needs_cuda
def test_cuda_tensor_copy_round_trip():
    t = torch.arange(4.0, device="cuda")
    u = loads(dumps(t))
    assert u.device == t.device and torch.equal(u, t) and u.data_ptr() != t.data_ptr()


# ---------------------------------------------------------------- the pickler itself


def test_pickler_writes_one_self_contained_pickle_per_dump():
    stream = io.BytesIO()
    pickler = Pickler(stream, copy_tensor=True)
    pickler.dump(lambda: "first")
    pickler.dump(torch.ones(2))
    stream.seek(0)
    assert pickle.load(stream)() == "first"
    assert torch.equal(pickle.load(stream), torch.ones(2))


def test_dispatch_table_is_layered_over_copyreg():
    class Odd:
        pass

    copyreg.pickle(Odd, lambda obj: (str, ("reduced by copyreg",)))
    try:
        assert loads(dumps(Odd())) == "reduced by copyreg"
    finally:
        del copyreg.dispatch_table[Odd]


def test_argument_validation():
    with pytest.raises(TypeError, match="copy_tensor must be a bool"):
        dumps(1, copy_tensor="yes")
    with pytest.raises(TypeError, match="recurse must be a bool"):
        dumps(1, recurse=1)
    with pytest.raises(TypeError, match="data must be bytes-like"):
        loads("not bytes")
    with pytest.raises(TypeError, match="write"):
        Pickler(object())


def test_import_changes_no_process_wide_setting():
    # A fresh interpreter with torch, dill and torch.multiprocessing imported: importing
    # machinlike's pickling, queue, process, thread and event modules changes none of the
    # sharing strategy, copyreg, ForkingPickler's reducers, dill's settings, pickle's
    # dispatch table or the start method.
    assert import_report()["pickle_settings_changed"] == []  # one probe, shared with test_exports


def test_local_module_subclass_round_trip():
    class TwoLayer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(3, 2)

        def forward(self, x):
            return self.fc(x) * 2

    net, x = TwoLayer(), torch.ones(1, 3)
    for copy_tensor in (True, False):
        clone = loads(dumps(net, copy_tensor=copy_tensor))
        assert type(clone).__name__ == "TwoLayer" and torch.allclose(clone(x), net(x))


def test_public_names():
    import machinlike.pickle as module

    assert sorted(module.__all__) == ["Pickler", "dumps", "loads", "mark_static_module"]
    for name in module.__all__:
        assert getattr(module, name) is not None


@pytest.mark.parametrize("copy", [True, False])
def test_an_expanded_tensor_pickles_as_its_distinct_elements(copy):
    big = torch.arange(3.0).reshape(3, 1).expand(3, 4_000_000)
    data = dumps(big, copy_tensor=copy)
    assert len(data) < 4096  # (48 MB element by element)
    back = loads(data)
    assert back.stride() == (1, 0) and torch.equal(back, big)
    grad = torch.zeros(1, requires_grad=True).detach().expand(5).requires_grad_()  # a leaf that requires grad
    again = loads(dumps(grad, copy_tensor=copy))
    assert again.requires_grad and again.grad_fn is None and torch.equal(again, grad)


_FILELESS = """
from machinlike import launch
from machinlike.pool import Pool

SCALE = 10

def helper(x):
    return x * SCALE

def outer(x):
    return helper(x) + 1

def body(world):
    return outer(world.rank)

with Pool(2) as pool:
    print("pool", pool.map(outer, range(3)), pool.map(lambda x: helper(x) - 1, range(3)))
print("launch", launch(body, 2, timeout=60))
"""


_RANK_HELPER = """
import machinlike
from machinlike.pool import Pool

OFFSET = 100


def collect(n):
    with Pool(1) as pool:
        return pool.map(lambda x: x * x + OFFSET, range(n))


def rank(world):
    return collect(3)


if __name__ == "__main__":
    print("ranks", machinlike.launch(rank, 1, timeout=60))
"""


def test_a_launched_ranks_helper_sends_a_lambda_to_a_pool(tmp_path):
    # Cold trial 13: the rank's function arrives with a copy of the script's namespace; a
    # lambda made in a helper of it took that whole copy along, with the module machinlike
    # (by value: not under site-packages here) and failed: "cannot pickle '_Ledger' object".
    import subprocess

    script = tmp_path / "rollouts.py"
    script.write_text(_RANK_HELPER)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         cwd=str(tmp_path), env=_background.checkout_env())
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ranks [[100, 101, 104]]" in run.stdout, run.stdout


def test_a_notebooks_functions_take_the_globals_they_use_along():
    # A notebook's (or ``python -c``'s) __main__ has no file: no worker can import it, so a
    # function of it that called another one of it failed there with a NameError.
    import subprocess

    run = subprocess.run([sys.executable, "-c", _FILELESS], capture_output=True, text=True, timeout=120,
                         cwd=str(pathlib.Path(__file__).resolve().parent.parent))
    assert run.returncode == 0, run.stderr[-3000:]
    assert "pool [1, 11, 21] [-1, 9, 19]" in run.stdout and "launch [1, 11]" in run.stdout, run.stdout
