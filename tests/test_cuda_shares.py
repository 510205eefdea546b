"""The pool and ``Process`` give back the CUDA IPC references nobody else will
(machinlike._reductions.cuda_counters, machinlike.pool._cuda_shares).

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
import threading
import time
import weakref

import pool_targets as targets
import pytest
import torch
from torch.multiprocessing import reductions as torch_red

from machinlike.pool import Pool, WorkerLostError
from machinlike.process import Process
from machinlike._reductions import cuda_counters
from machinlike.pool import _cuda_shares
from machinlike.pool._cuda_shares import CudaCounter
from machinlike.pool._policy import Codec

WAIT = 60.0


@pytest.fixture
def counters():
    """A real file of torch's reference counted shared memory (the allocator CUDA IPC
    counters live in) and an int64 view of its data: (handle, view)."""
    storage = torch.UntypedStorage(8 * 4096)
    _manager, handle, _size = storage._share_filename_cpu_()
    view = torch.empty(0, dtype=torch.int64).set_(storage, 0, (4096,))  # type: ignore[call-overload]
    view.zero_()
    yield handle, view
    del view, storage


@pytest.fixture
def fresh_state(monkeypatch):
    """This process's layout check and counts, as at start."""
    state = cuda_counters._State()
    monkeypatch.setattr(cuda_counters, "_state", state)
    return state


def test_the_reader_finds_each_counter_after_torchs_header(counters):
    handle, view = counters
    view[:64] = torch.arange(64) * 3 + 1
    assert [_cuda_shares.read_counter(CudaCounter(handle, i)) for i in range(64)] == [3 * i + 1 for i in range(64)]
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
    assert cuda_counters.release_unheld(refs, release) == 2
    assert released == [0, 2] and view[:5].tolist() == [0, 0, 0, 1 << 40, -1]
    assert cuda_counters.stats() == {"released": 2, "already_freed": 1, "unreadable": 3}
    # again: nothing is counted any more, nothing is taken off twice
    assert cuda_counters.release_unheld(refs, release) == 0 and released == [0, 2]


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
    assert cuda_counters.counter_of(_cuda_reduction(handle, 3)) == CudaCounter(handle, 3)
    assert fresh_state.checked and not cuda_counters.disabled()
    assert cuda_counters.counter_of(_cuda_reduction(handle, 4, nbytes=0)) is None  # an empty tensor shares nothing
    assert cuda_counters.counter_of((torch_red.rebuild_tensor, ())) is None


def test_a_sparse_tensors_parts_name_their_counters(counters, fresh_state):
    """torch reduces a sparse (or nested) CUDA tensor's parts inside its own reducer: their
    reductions sit among the outer one's arguments, each as ``rebuild_cuda_tensor, args``."""
    handle, view = counters
    view[:2] = 1
    indices, values = _cuda_reduction(handle, 0), _cuda_reduction(handle, 1)
    sparse = (torch_red.rebuild_sparse_coo_tensor, (*indices, *values, torch.Size([4, 4]), True))
    assert cuda_counters.counters_of(sparse) == [CudaCounter(handle, 0), CudaCounter(handle, 1)]
    assert cuda_counters.counters_of(indices) == [CudaCounter(handle, 0)]
    assert cuda_counters.counters_of((torch_red.rebuild_tensor, (torch.Tensor, 1, 2))) == []
    with cuda_counters.collecting() as got:
        cuda_counters.note(sparse)
        with cuda_counters.collecting() as inner:
            cuda_counters.note(values)
    assert got == [CudaCounter(handle, 0), CudaCounter(handle, 1)] and inner == [CudaCounter(handle, 1)]
    cuda_counters.note(values)  # (nobody collecting: nothing recorded, nothing raised)


def test_a_layout_that_does_not_read_1_for_a_fresh_share_turns_off_the_releases_that_need_a_read(
        counters, fresh_state, caplog):
    handle, view = counters
    view[2] = 7
    cuda_counters.counter_of(_cuda_reduction(handle, 2))
    assert cuda_counters.disabled() and "not laid out" in caplog.text
    view[2:4] = 1
    taken = []
    # delivered (a receiver may have freed it): unreadable, so kept
    assert cuda_counters.release_unheld([CudaCounter(handle, 2)], taken.append) == 0
    assert taken == [] and cuda_counters.stats()["unreadable"] == 1
    # never delivered: it still holds its one reference, given back without a read
    view[3] = 7  # (what is read does not matter any more)
    assert cuda_counters.release_unheld([CudaCounter(handle, 3)], taken.append, delivered=False) == 1
    assert taken == [CudaCounter(handle, 3)] and cuda_counters.stats()["released"] == 1
    # with a readable layout, one never delivered is still read first (nothing twice)
    fresh_state.disabled = False
    view[3] = 0
    assert cuda_counters.release_unheld([CudaCounter(handle, 3)], taken.append, delivered=False) == 0


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

    def __init__(self, cls, size, stride, offset, handle, requires_grad=False, counter=0):
        self.args = (cls, torch.Size(size), stride, offset, torch.UntypedStorage, torch.float32, 0,
                     handle, 32, 0, requires_grad, b"counter", counter, b"event", True)

    def __reduce__(self):
        return torch_red.rebuild_cuda_tensor, self.args


def test_a_result_loads_as_a_copy_that_keeps_its_views_and_parameters(monkeypatch):
    """loads_owned's copy, with torch's CUDA rebuild standing in as one that opens a CPU
    storage (the "sender's memory" here): what arrives shares nothing with it, and
    tensors that shared a storage there share one copy here."""
    sender = {b"a": torch.arange(8.0).untyped_storage(), b"b": torch.full((4,), 7.0).untyped_storage()}
    opened, events = [], []

    def rebuild(cls, size, stride, offset, _scls, dtype, _device, handle, _nbytes, _off, requires_grad, *_rest):
        opened.append(handle)
        source = torch.empty(0, dtype=dtype).set_(sender[handle], offset, size, stride)
        weakref.finalize(source, events.append, ("let go", handle))
        return source

    data = pickle.dumps([
        _Shared(torch.Tensor, [8], (1,), 0, b"a"),
        _Shared(torch.Tensor, [2, 2], (1, 2), 3, b"a", counter=1),
        _Shared(torch.nn.Parameter, [4], (1,), 0, b"b", requires_grad=True),
    ])  # (naming torch's rebuild: pickled before it is stood in for)
    monkeypatch.setattr(torch_red, "rebuild_cuda_tensor", rebuild)
    monkeypatch.setattr(_cuda_shares, "_copy_done", lambda device: events.append(("copied", device)))
    released = []
    monkeypatch.setattr(cuda_counters, "_torch_release", released.append)
    whole, view, param = _cuda_shares.loads_owned(data)
    assert opened == [b"a", b"b"]  # each sender storage opened once
    # each copy has run before its opened memory goes (torch's free closes the handle
    # before it synchronises, and frees nothing where the memory was open already)
    assert events == [("copied", 0), ("let go", b"a"), ("copied", 0), ("let go", b"b")]
    # the view's reduction, a second count on storage "a", is given back at once (the
    # opening's free gives back the first)
    assert released == [CudaCounter(b"counter", 1)]
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
        self.labels = {}
        original = Codec.dumps_tracked
        lock = threading.Lock()

        def dumps_tracked(codec, obj, multi_load=False):
            data, kept = original(codec, obj, multi_load)
            with lock:  # (callers' threads and the manager's pickle at once)
                counter = CudaCounter(handle, self.next)
                view[self.next] = 1
                # what a pool pickles: a worker's start-up, a map's function, a call or a chunk
                self.labels[self.next] = "init" if isinstance(obj, tuple) and len(obj) == 4 else \
                    "function" if multi_load else "task"
                self.next += 1
            return data, kept + [counter]

        def torch_release(counter):
            view[counter.offset] -= 1

        monkeypatch.setattr(Codec, "dumps_tracked", dumps_tracked)
        monkeypatch.setattr(cuda_counters, "_torch_release", torch_release)

    def counted(self):
        """Labels of the references still counted (handed out, not given back)."""
        return sorted(self.labels[i] for i in range(self.next) if int(self.view[i]) != 0)

    def handed(self, label):
        return sum(1 for value in self.labels.values() if value == label)


def test_the_pool_gives_back_what_dead_workers_held_and_what_nobody_ran(counters, fresh_state, monkeypatch, tmp_path):
    """Real workers, a real SIGKILL; the references stand in for CUDA ones (see _Handout)."""
    handout = _Handout(*counters, monkeypatch)
    started = targets.AnnounceFifo(tmp_path / "started")
    release = targets.ReleaseFifo(tmp_path / "go")
    pool = Pool(2, is_copy_tensor=False, share_method="cuda")
    try:
        assert pool.apply(targets.square, (3,)) == 9
        assert handout.counted() == ["init", "init", "task"]  # the workers hold them while they live
        doomed = pool.apply_async(targets.crash, ("sigkill", started.path))
        os.kill(started.read_pid(WAIT), signal.SIGKILL)
        with pytest.raises(WorkerLostError):
            doomed.get(WAIT)
        # the dead worker's start-up and task (and the first task, if it ran there) are
        # back; its replacement's start-up is handed out
        deadline = time.monotonic() + WAIT
        while handout.handed("init") < 3 and time.monotonic() < deadline:
            time.sleep(0.01)  # (the manager starts it on its own; nothing to wait on here)
        assert pool.map(targets.pid_of, range(2), chunksize=1)
        assert handout.counted().count("init") == 2
        # A map's function: one pickle per worker it is installed on (torch counts one
        # receiver per pickle), the first one included
        before = handout.handed("function")
        assert pool.map(targets.square, range(8), chunksize=1) == [i * i for i in range(8)]
        assert 1 <= handout.handed("function") - before <= 2
        blocker = pool.apply_async(targets.announce_then_wait, (started.path, release.path))
        started.read_pid(WAIT)
        queued = [pool.apply_async(targets.square, (i,)) for i in range(6)]  # not all run before terminate
    finally:
        pool.terminate()
        started.close()
        release.close()
    assert handout.counted() == [] and handout.next >= 14
    assert not blocker.ready() or not blocker.successful()
    assert all(r.ready() for r in queued)  # (each ended: run, or failed by terminate())
    assert cuda_counters.stats()["released"] == handout.next


def test_a_function_that_cannot_be_pickled_again_fails_its_map_alone(counters, fresh_state, monkeypatch):
    """A map's function holding CUDA tensors is pickled again for each worker it is
    installed on: when that fails, the chunk sent there fails its map with the error, and
    the pool goes on serving (it broke the pool, or left an unrelated caller holding it)."""
    handout = _Handout(*counters, monkeypatch)
    with_counters = Codec.dumps_tracked
    pickles = []

    def dumps_tracked(codec, obj, multi_load=False):
        if multi_load and obj is targets.square:
            pickles.append(obj)
            if len(pickles) > 1:
                raise pickle.PicklingError("the closure changed under the map")
        return with_counters(codec, obj, multi_load)

    monkeypatch.setattr(Codec, "dumps_tracked", dumps_tracked)
    with Pool(2, is_copy_tensor=False, share_method="cuda") as pool:
        deadline = time.monotonic() + WAIT
        while len(set(pool.map(targets.pid_of, range(4), chunksize=1))) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)  # both workers up: the map below is installed on both
        with pytest.raises(pickle.PicklingError, match="changed under the map"):
            pool.map(targets.square, range(16), chunksize=1)
        assert pool.apply(targets.square, (4,)) == 16
    assert handout.counted() == []


class _FreesOnLoad:
    """Loads in a worker by taking one off its counter (what a CUDA receiver's free does),
    as the integer ``offset``."""

    def __init__(self, handle, offset):
        self.handle, self.offset = handle, offset

    def __reduce__(self):
        return targets.free_counter, (self.handle, self.offset)


def test_what_a_worker_holds_stays_bounded_while_it_frees_what_it_got(counters, fresh_state, monkeypatch):
    """A long run of tasks whose references the workers give back themselves (as their
    frees do): the pool's books of what each worker holds stay bounded, and the pool
    gives back none of them a second time."""
    handle, view = counters
    n = 600
    view[:n] = 1
    original = Codec.dumps_tracked

    def dumps_tracked(codec, obj, multi_load=False):
        data, kept = original(codec, obj, multi_load)
        if isinstance(obj, tuple) and len(obj) == 3 and obj[1] and isinstance(obj[1][0], _FreesOnLoad):
            kept = kept + [CudaCounter(handle, obj[1][0].offset)]
        return data, kept

    monkeypatch.setattr(Codec, "dumps_tracked", dumps_tracked)
    monkeypatch.setattr(cuda_counters, "_torch_release", lambda c: view.__setitem__(c.offset, view[c.offset] - 1))
    with Pool(2, is_copy_tensor=False, share_method="cuda") as pool:
        results = [pool.apply_async(targets.identity, (_FreesOnLoad(handle, i),)) for i in range(n)]
        assert [r.get(WAIT) for r in results] == list(range(n))
        held = [len(w.cuda_held) for w in pool._backend._dispatch.workers]
        assert held and max(held) < 64 + 8, held  # (pruned from 64 on: what reads 0 is forgotten)
    assert view[:n].tolist() == [0] * n
    assert cuda_counters.stats()["released"] == 0


class _HandsOutACounter:
    """Pickles as 0, handing out ``counter`` as a CUDA tensor's reduction would."""

    def __init__(self, counter):
        self.counter = counter

    def __reduce__(self):
        cuda_counters.record(self.counter)
        return int, (0,)


@pytest.mark.parametrize("end", ["returns", "SIGKILL"])
def test_a_process_gives_back_what_its_child_was_sent_once_the_child_ended(counters, fresh_state, monkeypatch, end, tmp_path):
    """A real child, a real SIGKILL; the reference stands in for a CUDA tensor's (the child
    never gives one back here, so all that reads 0 is what the parent gave back)."""
    handle, view = counters
    view[0] = 1
    monkeypatch.setattr(cuda_counters, "_torch_release", lambda c: view.__setitem__(c.offset, view[c.offset] - 1))
    held = _HandsOutACounter(CudaCounter(handle, 0))
    if end == "returns":
        process = Process(target=targets.take_anything, args=(held,))
        process.start()
        process.join(WAIT)
    else:
        started = targets.AnnounceFifo(tmp_path / "started")
        process = Process(target=targets.announce_then_block, args=(started.path, held))
        process.start()
        os.kill(started.read_pid(WAIT), signal.SIGKILL)
        started.close()
        process.join(WAIT)
        assert isinstance(process.exception, Exception)
    assert not process.is_alive() and int(view[0]) == 0
    process.close()
    assert cuda_counters.stats()["released"] == 1


def test_a_running_child_keeps_what_it_was_sent(counters, fresh_state, monkeypatch, tmp_path):
    handle, view = counters
    view[0] = 1
    monkeypatch.setattr(cuda_counters, "_torch_release", lambda c: view.__setitem__(c.offset, view[c.offset] - 1))
    started = targets.AnnounceFifo(tmp_path / "started")
    process = Process(target=targets.announce_then_block, args=(started.path, _HandsOutACounter(CudaCounter(handle, 0))))
    process.start()
    pid = started.read_pid(WAIT)
    try:
        process.join(0.05)
        assert process.exception is None and int(view[0]) == 1  # alive: it may still free it itself
    finally:
        os.kill(pid, signal.SIGKILL)
        started.close()
        process.join(WAIT)
    assert int(view[0]) == 0


class _Holder:
    def __init__(self, dead=False):
        self.dead = dead

    def is_dead(self):
        return self.dead


def test_a_dropped_function_gives_back_the_installs_no_task_ran_on(counters, fresh_state, monkeypatch):
    """A worker loads a map's function only for a task of it (a DROP discards the bytes
    unread): an install whose tasks were all taken by other workers is given back at the
    drop; a dead holder's went at its death; one never installed anywhere too."""
    from machinlike.pool._task import Function

    handle, view = counters
    view[:4] = 1
    given = []
    monkeypatch.setattr(cuda_counters, "_torch_release", lambda c: given.append(c.offset))
    made = iter([(b"second", [CudaCounter(handle, 1)]), (b"third", [CudaCounter(handle, 2)])])
    codec = Codec(False, frozenset({"cuda"}), False)
    function = Function(1, pickle.dumps("first"), [], lambda: next(made), (CudaCounter(handle, 0),))
    ran, idle, dead = _Holder(), _Holder(), _Holder()
    assert function.install_payload(ran) == (pickle.dumps("first"), (CudaCounter(handle, 0),))
    assert function.install_payload(idle) == (b"second", (CudaCounter(handle, 1),))
    function.install_payload(dead)
    function.ran_on(ran)
    dead.dead = True
    function.release_unloaded(codec)
    assert given == [1]
    never = Function(2, pickle.dumps("only"), [], lambda: next(made), (CudaCounter(handle, 3),))
    never.release_unloaded(codec)
    assert given == [1, 3]


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


def _back_to(baseline, within=WAIT):
    """This process's allocated GPU memory once it is at ``baseline`` or under (an earlier
    test's memory left in torch's limbo may be freed meanwhile), or at the deadline."""
    deadline = time.monotonic() + within
    while True:
        now = _settle_memory()
        if now <= baseline or time.monotonic() >= deadline:
            return now
        time.sleep(0.05)  # (torch frees limbo memory only when asked: nothing to wait on)


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
    tensors = []
    try:
        pool.apply_async(targets.announce_then_wait, (started.path, release.path))
        started.read_pid(WAIT)
        tensors = [torch.full((16 * MB,), 5.0, device="cuda") for _ in range(4)]
        for tensor in tensors:
            pool.apply_async(targets.tensor_sum, (tensor,))
    finally:
        pool.terminate()
        started.close()
        release.close()
    del tensors[:]
    assert _back_to(baseline) <= baseline


@pytest.mark.gpu
@needs_cuda
def test_a_killed_worker_gives_back_the_gpu_memory_it_held():
    baseline = _settle_memory()
    with Pool(1, is_copy_tensor=False, share_method="cuda") as pool:
        t = torch.full((16 * MB,), 5.0, device="cuda")
        with pytest.raises(WorkerLostError):
            pool.apply(targets.kill_self_holding, (t,))
        del t
        assert _back_to(baseline) <= baseline
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
    assert _back_to(baseline) <= baseline


@pytest.mark.gpu
@needs_cuda
def test_a_killed_child_gives_back_the_gpu_memory_it_was_sent(tmp_path):
    baseline = _settle_memory()
    started = targets.AnnounceFifo(tmp_path / "started")
    t = torch.full((16 * MB,), 5.0, device="cuda")
    process = Process(target=targets.announce_then_block, args=(started.path, t))
    process.start()
    try:
        os.kill(started.read_pid(WAIT), signal.SIGKILL)  # (it announces once it loaded t)
        process.join(WAIT)
    finally:
        started.close()
        if process.is_alive():  # (it never announced: do not leave it blocking for minutes)
            process.kill()
            process.join(WAIT)
    del t
    assert _back_to(baseline) <= baseline
