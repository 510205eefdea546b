"""machinlike.pool tensor policies, for arguments, results, closures and contexts."""

from __future__ import annotations

import pool_targets as targets
import pytest
import torch

from machinlike import _shm
from machinlike.pool import LARGE_TENSOR_BYTES, CtxPool, P2PPool, Pool, ThreadPool

WAIT = 60.0
SMALL = 16
LARGE = LARGE_TENSOR_BYTES // 4 + 1  # float32 elements: just over the shared-memory copy threshold


@pytest.mark.parametrize("numel", [SMALL, LARGE], ids=["small", "large"])
def test_copy_mode_copies_arguments_and_results(numel):
    with Pool(2) as pool:
        t = torch.zeros(numel)
        returned = pool.apply(targets.add_one_, (t,))
        assert torch.count_nonzero(t) == 0, "the worker's edit reached the caller's tensor"
        assert torch.equal(returned, torch.ones(numel))
        assert pool.map(targets.add_one_return_sum, [t] * 4, chunksize=1) == [float(numel)] * 4
        assert torch.count_nonzero(t) == 0
        # a result is a copy too: the worker editing its own tensor later changes nothing here
        with Pool(1) as single:
            kept = single.apply(targets.keep_and_return, (numel,))
            assert single.apply(targets.edit_kept) == 7.0
            assert torch.count_nonzero(kept) == 0
        # a closure over a tensor carries a copy of it, installed on every worker of a map
        big = torch.ones(numel)
        assert pool.map(lambda i: float(big.sum()) + i, range(8), chunksize=1) == [numel + i for i in range(8)]
        edited = pool.map(lambda i: float(big.add_(1).sum()), range(2), chunksize=1)
        assert all(value >= 2 * numel for value in edited) and torch.equal(big, torch.ones(numel))


@pytest.mark.parametrize("numel", [SMALL, LARGE], ids=["small", "large"])
def test_share_mode_passes_cpu_tensors_by_reference(numel):
    with Pool(2, is_copy_tensor=False, share_method="cpu") as pool:
        t = torch.zeros(numel)
        pool.apply(targets.add_one_, (t,))
        assert torch.equal(t, torch.ones(numel)), "the worker's edit must reach the shared tensor"
        assert t.is_shared()
        # the same tensor, many times, concurrently (machin hangs on the second send);
        # each task edits its own element, since two workers' add_() on the same memory race
        sends = min(numel, 25)
        pool.starmap(targets.add_one_at_, [(t, i) for i in range(sends - 5)], chunksize=1)
        results = [pool.apply_async(targets.add_one_at_, (t, i)) for i in range(sends - 5, sends)]
        for result in results:
            result.get(WAIT)
        expected = torch.ones(numel)
        expected[:sends] += 1
        assert torch.equal(t, expected)
        made = pool.apply(targets.make_tensor, (numel, 3.0))
        assert made.is_shared() and torch.equal(made, torch.full((numel,), 3.0))
        # closures share as well
        pool.apply(lambda: t.sub_(expected))
        assert torch.count_nonzero(t) == 0


def test_share_mode_contexts_are_shared_with_the_workers():
    contexts = [torch.zeros(4), torch.zeros(4)]
    with CtxPool(2, worker_contexts=contexts, is_copy_tensor=False, share_method="cpu") as pool:
        pool.map(lambda ctx, x: ctx.add_(1), range(10), chunksize=1)
    assert float(contexts[0].sum() + contexts[1].sum()) == 40.0


def test_copy_mode_contexts_are_copies():
    contexts = [torch.zeros(4)]
    with CtxPool(1, worker_contexts=contexts) as pool:
        assert pool.map(lambda ctx, x: float(ctx.add_(1).sum()), range(3)) == [4.0, 8.0, 12.0]
    assert float(contexts[0].sum()) == 0.0


def test_thread_pools_share_everything():
    t = torch.zeros(3)
    marker = object()
    with ThreadPool(2) as pool:
        pool.apply(lambda: t.add_(1))
        pool.map(targets.add_one_, [t] * 4)
        assert torch.equal(t, torch.full((3,), 5.0))
        assert pool.apply(targets.identity, (marker,)) is marker
        assert pool.apply(targets.identity, (t,)) is t
        error = ValueError("mine")
        with pytest.raises(ValueError) as raised:
            pool.apply(_raise, (error,))
        assert raised.value is error and raised.value.__traceback__ is not None


def _raise(error):
    raise error


def test_tensor_parameters_and_dtypes_survive_both_policies():
    values = [
        torch.nn.Parameter(torch.ones(2, 3)),
        torch.arange(LARGE, dtype=torch.int64),
        torch.ones(5, dtype=torch.bfloat16),
        torch.zeros(0),
        torch.arange(12.0).reshape(3, 4).t(),  # not contiguous
        torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),  # keeps its strides
        torch.randn(LARGE // 60 + 1, 3, 4, 5).to(memory_format=torch.channels_last),
        torch.eye(3).to_sparse(),  # no nbytes: the policy once asked for it and raised
    ]
    for pool in (Pool(1), Pool(1, is_copy_tensor=False, share_method="cpu")):
        with pool:
            for value in values:
                back = pool.apply(targets.identity, (value,))
                assert type(back) is type(value) and back.dtype == value.dtype and back.layout == value.layout
                assert torch.equal(back.detach().to_dense(), value.detach().to_dense())
                if value.layout == torch.strided and value.numel() > 1:
                    assert back.stride() == value.stride(), (value.shape, value.stride(), back.stride())


def _large_result(i):
    import numpy as np

    return torch.full((LARGE,), float(i)), np.full(LARGE, i)


def test_a_worker_retiring_after_its_task_lets_the_pool_load_its_large_results_first():
    """maxtasksperchild=1: a worker is told to stop right after its task, and its results'
    segments closed with it before the pool had opened them ("cannot reach the shared
    memory of process ...: the sender is gone", for every tensor of 1 MiB or more)."""
    with Pool(2, maxtasksperchild=1) as pool:
        out = pool.map(_large_result, range(6), chunksize=1)
    assert [(float(t[0]), int(a[0])) for t, a in out] == [(float(i), i) for i in range(6)]
    assert all(t.shape == (LARGE,) and a.shape == (LARGE,) for t, a in out)


@pytest.mark.parametrize("cls", [Pool, P2PPool])
def test_a_worker_retiring_after_its_task_lets_the_pool_load_its_shared_results_first(cls):
    """Share mode: a result's tensors travel as the worker's descriptors, which closed when
    it retired after its task before the pool had loaded them, and every result of a
    maxtasksperchild=1 map was lost (cold trial 27). The worker waits for the pool's word."""
    with cls(2, maxtasksperchild=1, is_copy_tensor=False, share_method="cpu") as pool:
        out = pool.starmap(targets.make_tensor, [(1000, float(i)) for i in range(8)], chunksize=1)
    assert [float(t[0]) for t in out] == [float(i) for i in range(8)]


def _reader_of(array):
    return lambda i: int(array.reshape(-1)[i])


def _add_one_to_array(array):
    array += 1
    return array


def test_numpy_arrays_cross_through_lent_segments_under_both_policies():
    """A large numpy array (an observation batch) crosses through a lent segment, as a
    tensor does (pickled through the pipe it moved at 0.4 GB/s, 15 times slower), and
    arrives as an array the receiver owns; small and object arrays are pickled as before."""
    import numpy as np

    rng = np.random.default_rng(0)
    values = [
        rng.integers(0, 255, size=(64, 4, 84, 84), dtype=np.uint8),  # 1.8 MB
        np.asfortranarray(rng.random((512, 512))),
        rng.random((1024, 512))[::2, ::-1],  # strided
        rng.random(LARGE).astype(">f8"),
        np.zeros(LARGE // 4, dtype=[("obs", np.float32, (4,)), ("done", np.bool_)]),
        rng.random(10),
        np.array([{"k": i} for i in range(LARGE // 8)], dtype=object),
    ]
    for pool in (Pool(2), Pool(2, is_copy_tensor=False, share_method="cpu")):
        with pool:
            for value in values:
                leases = _shm.cache().stats["leases"]
                back = pool.apply(targets.identity, (value,))
                assert type(back) is np.ndarray and back.dtype == value.dtype and back.shape == value.shape
                assert (back == value).all()
                assert back.flags.f_contiguous == value.flags.f_contiguous or not value.flags.f_contiguous
                lent = _shm.cache().stats["leases"] > leases  # the argument went through a segment of ours
                assert lent == (value.nbytes >= LARGE_TENSOR_BYTES and not value.dtype.hasobject), value.dtype
            frames = values[0]
            edited = pool.apply(_add_one_to_array, (frames,))
            assert (edited == frames + 1).all()  # the worker edited its own copy, not ours
            assert pool.map(len, [frames] * 6, chunksize=1) == [64] * 6
            # A map's function over a large array (every worker loads it): through named
            # shared memory, as a tensor's; dill had pickled it into each pipe.
            assert pool.map(_reader_of(frames), range(3), chunksize=1) == [int(frames.reshape(-1)[i]) for i in range(3)]
    from machinlike.pool._policy import Codec

    payload, _ = Codec(True, frozenset(), False).dumps_tracked(_reader_of(values[0]), multi_load=True)
    assert len(payload) < 4096, len(payload)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_share_mode_passes_cuda_tensors_by_reference():
    with Pool(1, is_copy_tensor=False, share_method="cuda") as pool:
        t = torch.zeros(8, device="cuda")
        pool.apply(targets.add_one_, (t,))
        torch.cuda.synchronize()
        assert torch.equal(t.cpu(), torch.ones(8))
    with Pool(1) as pool:
        t = torch.zeros(8, device="cuda")
        back = pool.apply(targets.add_one_, (t,))
        assert back.device.type == "cuda" and torch.count_nonzero(t) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_share_mode_returns_the_tensors_it_received():
    """A worker returning the CUDA tensors it was given (torch refuses to re-export
    imported CUDA memory): they come back as device copies, alongside its own by IPC."""
    with Pool(2, is_copy_tensor=False, share_method="cuda") as pool:
        t = torch.zeros(8, device="cuda")
        param = torch.nn.Parameter(torch.full((3,), 5.0, device="cuda"))
        for _ in range(3):  # the same tensors again: every round trip works
            same, view, back_param, made = pool.apply(targets.cuda_views, (t, param))
            torch.cuda.synchronize()
        assert torch.equal(t.cpu(), torch.full((8,), 3.0))  # the worker's edits reached t
        assert same.device.type == view.device.type == made.device.type == "cuda"
        assert same.tolist() == [3.0] * 8 and view.tolist() == [3.0] * 4 and made.tolist() == [6.0] * 8
        assert isinstance(back_param, torch.nn.Parameter) and back_param.requires_grad
        assert back_param.tolist() == [5.0] * 3
        results = pool.map(targets.add_one_, [torch.zeros(4, device="cuda") for _ in range(4)])
        assert [r.tolist() for r in results] == [[1.0] * 4] * 4


@pytest.mark.parametrize("policy", [{"is_copy_tensor": True}, {"is_copy_tensor": False, "share_method": "cpu"}])
def test_expanded_tensors_cross_as_their_distinct_elements(policy):
    # torch.zeros(1).expand(10**7) is 40 MB element by element; pickle and torch RPC send
    # its one element and its strides, and so do the pools (before: 40 MB each way).
    large = torch.arange(3.0).reshape(3, 1).expand(3, 4_000_000)  # 48 MB, 12 bytes distinct
    small = torch.rand(1, 8).expand(16, 8)
    with Pool(1, **policy) as pool:
        for sent in (large, small):
            strides, nbytes, total, back = pool.apply(targets.layout_of, (sent,))
            assert strides == sent.stride() and nbytes == sent.untyped_storage().nbytes()
            assert total == pytest.approx(float(sent.sum()))
            assert back.stride() == sent.stride() and torch.equal(back, sent)


@pytest.mark.parametrize("method", ["apply", "map"])
def test_a_workers_exception_holding_a_cuda_tensor_arrives_with_a_cpu_copy(method):
    """A worker on a GPU raised an exception holding a CUDA tensor: the parent rebuilt it on
    the GPU (a CUDA context in a process that may have no GPU, and no more forked workers
    that use CUDA); without CUDA, loading failed and the user's exception was lost."""
    with Pool(1) as pool:
        with pytest.raises(ValueError, match="a bad batch") as caught:
            if method == "apply":
                pool.apply(targets.raise_holding_a_cuda_tensor)
            else:
                pool.map(targets.raise_holding_a_cuda_tensor, [1], chunksize=1)
    message, tensor = caught.value.args
    assert tensor.device.type == "cpu" and torch.equal(tensor, torch.arange(3.0))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("policy", [{}, {"is_copy_tensor": False, "share_method": "cuda"}], ids=["copy", "share"])
def test_a_workers_exception_holding_a_real_cuda_tensor_arrives_with_a_cpu_copy(policy):
    with Pool(1, **policy) as pool:
        with pytest.raises(ValueError, match="a bad batch") as caught:
            pool.apply(targets.raise_with_a_real_cuda_tensor)
        assert pool.apply(targets.square, (3,)) == 9  # the worker lives on
    tensor = caught.value.args[1]
    assert tensor.device.type == "cpu" and torch.equal(tensor, torch.arange(3.0))

