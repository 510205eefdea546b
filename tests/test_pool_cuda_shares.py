"""The pool gives back the CUDA IPC references nobody else will (machinlike.pool._cuda_shares).

On this machine (no GPU) the parts that do not need CUDA: the counter's layout in torch's
reference counted shared memory (read here from a real CPU share of the same allocator),
the read-gated release, and the loaders that swap torch's CUDA rebuild. The end-to-end
checks on a GPU are the ``gpu`` tests at the bottom.
"""

from __future__ import annotations

import gc
import os
import pickle
import signal

import pool_targets as targets
import pytest
import torch
from torch.multiprocessing import reductions as torch_red

from machinlike.pool import Pool, WorkerLostError
from machinlike.pool import _cuda_shares
from machinlike.pool._cuda_shares import CudaCounter
from machinlike.pool._policy import Codec

WAIT = 60.0


@pytest.fixture
def counters():
    """A real file of torch's reference counted shared memory (the allocator CUDA IPC
    counters live in) and an int64 view of its data: (handle, view)."""
    storage = torch.UntypedStorage(8 * 16)
    _manager, handle, _size = storage._share_filename_cpu_()
    view = torch.empty(0, dtype=torch.int64).set_(storage, 0, (16,))  # type: ignore[call-overload]
    view.zero_()
    yield handle, view
    del view, storage


@pytest.fixture
def fresh_state(monkeypatch):
    """This process's layout check and counts, as at start."""
    state = _cuda_shares._State()
    monkeypatch.setattr(_cuda_shares, "_state", state)
    return state


def test_the_reader_finds_each_counter_after_torchs_header(counters):
    handle, view = counters
    view.copy_(torch.arange(16) * 3 + 1)
    assert [_cuda_shares.read_counter(CudaCounter(handle, i)) for i in range(16)] == [3 * i + 1 for i in range(16)]
    view[5] = -1  # a receiver that took one off too many: read as the signed int64 torch writes
    assert _cuda_shares.read_counter(CudaCounter(handle, 5)) == -1
    assert _cuda_shares.read_counter(CudaCounter(b"/torch_no_such_file_0", 0)) is None
    assert _cuda_shares.read_counter(CudaCounter(handle, 1 << 20)) is None  # past its end


def test_only_references_still_counted_are_given_back(counters, fresh_state):
    handle, view = counters
    view[:5] = torch.tensor([1, 0, 1, 1 << 40, -1])
    released = []

    def release(counter):  # what torch's release does: one off the counter
        released.append(counter.offset)
        view[counter.offset] -= 1

    refs = [CudaCounter(handle, i) for i in range(5)] + [CudaCounter(b"/torch_gone_0", 0)]
    assert _cuda_shares.release_unheld(refs, release) == 2
    assert released == [0, 2] and view[:5].tolist() == [0, 0, 0, 1 << 40, -1]
    assert _cuda_shares.stats() == {"released": 2, "already_freed": 1, "unreadable": 3}
    # again: nothing is counted any more, nothing is taken off twice
    assert _cuda_shares.release_unheld(refs, release) == 0 and released == [0, 2]


def _cuda_reduction(handle, offset, nbytes=64):
    """What torch's reduce_tensor gives for a CUDA tensor (its argument layout), naming
    ``handle``/``offset`` as its counter."""
    return (torch_red.rebuild_cuda_tensor, (
        torch.Tensor, torch.Size([16]), (1,), 0, torch.UntypedStorage, torch.float32, 0,
        b"ipc-handle", nbytes, 0, False, handle, offset, b"event", True,
    ))


class _FakeCudaTensor:
    def __init__(self, handle, offset):
        self.reduced = _cuda_reduction(handle, offset)

    def __reduce__(self):
        return self.reduced


def test_a_cuda_reduction_names_its_counter_and_the_first_one_checks_the_layout(counters, fresh_state):
    handle, view = counters
    view[3] = 1  # what a fresh share reads
    assert _cuda_shares.counter_of(_cuda_reduction(handle, 3)) == CudaCounter(handle, 3)
    assert fresh_state.checked and not _cuda_shares.disabled()
    assert _cuda_shares.counter_of(_cuda_reduction(handle, 4, nbytes=0)) is None  # an empty tensor shares nothing
    assert _cuda_shares.counter_of((torch_red.rebuild_tensor, ())) is None


def test_a_layout_that_does_not_read_1_for_a_fresh_share_turns_releasing_off(counters, fresh_state, caplog):
    handle, view = counters
    view[2] = 7
    _cuda_shares.counter_of(_cuda_reduction(handle, 2))
    assert _cuda_shares.disabled() and "not laid out" in caplog.text
    view[2] = 1
    assert _cuda_shares.release_unheld([CudaCounter(handle, 2)], lambda c: None) == 0
    assert view[2] == 1 and _cuda_shares.stats()["unreadable"] == 1


def test_the_sender_loads_its_own_payload_with_cuda_tensors_as_none():
    """Discarding a task loads its payload (that gives back its CPU shares); CUDA refuses
    to open a process's own IPC handles, so torch's rebuild is not called for them."""
    codec = Codec(False, frozenset({"cpu", "cuda"}), True)
    shared = torch.full((300_000,), 2.0)
    data, kept = codec.dumps_tracked((lambda x: x + 1, (shared, _FakeCudaTensor(b"/torch_x_0", 0)), None))
    assert kept  # the CPU share is tracked
    func, (tensor, fake), kwds = codec.loads_here(data)
    assert fake is None and kwds is None and torch.equal(func(tensor), torch.full((300_000,), 3.0))
    with pytest.raises((RuntimeError, AssertionError, AttributeError)):  # torch's own rebuild needs CUDA
        pickle.loads(data)
    # a result without CUDA tensors loads as it always did
    assert codec.loads_result(codec.dumps([1, shared[:4]]))[1].tolist() == [2.0] * 4


class _Shared:
    """Pickles as torch's CUDA tensor reduction naming a storage ``handle``."""

    def __init__(self, cls, size, stride, offset, handle, requires_grad=False):
        self.args = (cls, torch.Size(size), stride, offset, torch.UntypedStorage, torch.float32, 0,
                     handle, 32, 0, requires_grad, b"counter", 0, b"event", True)

    def __reduce__(self):
        return torch_red.rebuild_cuda_tensor, self.args


def test_a_result_loads_as_a_copy_that_keeps_its_views_and_parameters(monkeypatch):
    """loads_owned's copy, with torch's CUDA rebuild standing in as one that opens a CPU
    storage (the "sender's memory" here): what arrives shares nothing with it, and
    tensors that shared a storage there share one copy here."""
    sender = {b"a": torch.arange(8.0).untyped_storage(), b"b": torch.full((4,), 7.0).untyped_storage()}
    opened = []

    def rebuild(cls, size, stride, offset, _scls, dtype, _device, handle, _nbytes, _off, requires_grad, *_rest):
        opened.append(handle)
        return torch.empty(0, dtype=dtype).set_(sender[handle], offset, size, stride)

    data = pickle.dumps([
        _Shared(torch.Tensor, [8], (1,), 0, b"a"),
        _Shared(torch.Tensor, [2, 2], (1, 2), 3, b"a"),
        _Shared(torch.nn.Parameter, [4], (1,), 0, b"b", requires_grad=True),
    ])  # (naming torch's rebuild: pickled before it is stood in for)
    monkeypatch.setattr(torch_red, "rebuild_cuda_tensor", rebuild)
    whole, view, param = _cuda_shares.loads_owned(data)
    assert opened == [b"a", b"b"]  # each sender storage opened once
    assert whole.tolist() == list(range(8)) and view.tolist() == [[3.0, 5.0], [4.0, 6.0]]
    assert isinstance(param, torch.nn.Parameter) and param.requires_grad and param.tolist() == [7.0] * 4
    assert whole.untyped_storage().data_ptr() == view.untyped_storage().data_ptr()  # views stay views
    assert whole.untyped_storage().data_ptr() != sender[b"a"].data_ptr()  # a copy, the caller's
    whole.add_(1)
    assert view.tolist() == [[4.0, 6.0], [5.0, 7.0]] and sender[b"a"][0] == 0


class _Handout:
    """Stands in for CUDA shares on this machine: each payload a pool pickles hands out one
    reference of a real counter file, set to 1 (what torch sets); torch's release takes
    one off. No worker ever gives one back (they hold no CUDA memory), so what reads 0 in
    the end is exactly what the pool gave back in their stead."""

    def __init__(self, handle, view, monkeypatch) -> None:
        self.handle, self.view, self.next = handle, view, 0
        self.multi_load = []
        original = Codec.dumps_tracked

        def dumps_tracked(codec, obj, multi_load=False):
            data, kept = original(codec, obj, multi_load)
            counter = CudaCounter(handle, self.next)
            view[self.next] = 1
            self.next += 1
            if multi_load:
                self.multi_load.append(counter.offset)
            return data, kept + [counter]

        def torch_release(counter):
            view[counter.offset] -= 1

        monkeypatch.setattr(Codec, "dumps_tracked", dumps_tracked)
        monkeypatch.setattr(_cuda_shares, "_torch_release", torch_release)

    def counted(self):
        """Offsets still counted (handed out, not given back)."""
        return [i for i in range(self.next) if int(self.view[i]) != 0]


def test_the_pool_gives_back_what_a_killed_worker_held_what_nobody_ran_and_a_maps_installs(
    counters, fresh_state, monkeypatch, tmp_path,
):
    """Real workers, a real SIGKILL; the references stand in for CUDA ones (see _Handout)."""
    handout = _Handout(*counters, monkeypatch)
    started = targets.AnnounceFifo(tmp_path / "started")
    release = targets.ReleaseFifo(tmp_path / "go")
    pool = Pool(1, is_copy_tensor=False, share_method="cuda")
    try:
        assert pool.apply(targets.square, (3,)) == 9  # reference 0: the worker holds it while it lives
        assert handout.counted() == [0]
        doomed = pool.apply_async(targets.crash, ("sigkill", started.path))  # 1
        os.kill(started.read_pid(WAIT), signal.SIGKILL)
        with pytest.raises(WorkerLostError):
            doomed.get(WAIT)
        assert handout.counted() == []  # what it ran and what it was running: both back
        # A map's function is pickled once per worker it is installed on (2, 3: the first
        # pickle, never sent, is given back at once; then one per install).
        assert pool.map(targets.square, range(4), chunksize=2) == [0, 1, 4, 9]
        assert handout.multi_load and handout.multi_load[0] not in handout.counted()
        held = handout.counted()
        blocker = pool.apply_async(targets.announce_then_wait, (started.path, release.path))
        started.read_pid(WAIT)
        queued = [pool.apply_async(targets.square, (i,)) for i in range(3)]  # nobody runs these
        assert set(handout.counted()) >= set(held)
    finally:
        pool.terminate()
        started.close()
        release.close()
    assert handout.counted() == [] and handout.next >= 10
    assert not blocker.ready() or not blocker.successful()
    assert all(not r.successful() for r in queued)
    assert _cuda_shares.stats()["released"] == handout.next


# ------------------------------------------------------------------- on a GPU

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MB = 1 << 20


def _sum_plus(tensor):
    """A map's function closing over ``tensor`` (installed on every worker)."""
    return lambda i: float(tensor.sum()) + i


def _settle_memory():
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    return torch.cuda.memory_allocated()


@pytest.mark.gpu
@needs_cuda
def test_a_result_outlives_the_worker_that_made_it():
    """Each worker exits after one task (maxtasksperchild=1): the results it shared name
    memory that went with it, so the pool copies them on arrival."""
    with Pool(1, is_copy_tensor=False, share_method="cuda", maxtasksperchild=1) as pool:
        results = [pool.apply(targets.make_cuda_tensor, (4 * MB, float(v))) for v in range(3)]
        pids = {pool.apply(targets.pid_of) for _ in range(2)}
        assert len(pids) == 2
    torch.cuda.synchronize()
    for v, result in enumerate(results):
        assert result.is_cuda and float(result.sum()) == v * 4 * MB


@pytest.mark.gpu
@needs_cuda
def test_terminate_gives_back_the_gpu_memory_of_tasks_nobody_ran(tmp_path):
    started = targets.AnnounceFifo(tmp_path / "started")
    release = targets.ReleaseFifo(tmp_path / "go")
    baseline = _settle_memory()
    pool = Pool(1, is_copy_tensor=False, share_method="cuda")
    try:
        pool.apply_async(targets.announce_then_wait, (started.path, release.path))
        started.read_pid(WAIT)
        tensors = [torch.full((16 * MB,), 5.0, device="cuda") for _ in range(4)]
        for t in tensors:
            pool.apply_async(targets.tensor_sum, (t,))
    finally:
        pool.terminate()
        started.close()
        release.close()
    del tensors, t
    assert _settle_memory() == baseline


@pytest.mark.gpu
@needs_cuda
def test_a_killed_worker_gives_back_the_gpu_memory_it_held():
    baseline = _settle_memory()
    with Pool(1, is_copy_tensor=False, share_method="cuda") as pool:
        t = torch.full((16 * MB,), 5.0, device="cuda")
        with pytest.raises(WorkerLostError):
            pool.apply(targets.kill_self_holding, (t,))
        del t
        assert _settle_memory() == baseline
        assert pool.apply(targets.square, (3,)) == 9


@pytest.mark.gpu
@needs_cuda
def test_a_map_function_holding_a_cuda_tensor_gives_each_worker_its_own_reference():
    baseline = _settle_memory()
    with Pool(2, is_copy_tensor=False, share_method="cuda") as pool:
        big = torch.full((4 * MB,), 1.0, device="cuda")
        for _ in range(3):
            assert pool.map(_sum_plus(big), range(8), chunksize=1) == [4 * MB + i for i in range(8)]
        del big
    assert _settle_memory() == baseline
