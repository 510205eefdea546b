"""Pools over same-host shared memory: recycled segments in copy mode, mappings kept in
share mode, and nothing left behind when a worker is SIGKILLed holding a lent segment."""

from __future__ import annotations

import os
import time

import pool_targets as targets
import pytest
import torch

from machinlike import _shm
from machinlike.exception import WorkerLostError
from machinlike.pool import Pool

MB = 1 << 20


def test_copy_mode_recycles_segments_both_ways():
    before = set(os.listdir("/dev/shm"))
    with Pool(1) as pool:
        t = torch.arange(MB, dtype=torch.float32)
        created = _shm.cache().stats["created"]
        for i in range(20):
            t[0] = i
            back = pool.apply(targets.reverse_copy, (t,))
            assert float(back[-1]) == i and torch.equal(back.flip(0), t)
            del back
        # At most two segments lent 20 times: the worker drops a task's arguments after
        # sending its result, so the next task may find the first one still lent.
        assert _shm.cache().stats["created"] - created <= 2
        worker = pool.apply(targets.shm_stats)
        assert worker["leases"] >= 20 and worker["created"] <= 2  # results: the worker's segments
        # dtypes and views through a worker
        base = torch.randn(512, 1024, dtype=torch.float64)
        for case in (base.t(), base[::3, 2::2], base.to(torch.bfloat16), base > 0):
            got = pool.apply(targets.identity, (case,))
            assert got.dtype == case.dtype and torch.equal(got, case)
        pids = {os.getpid(), pool.apply(targets.pid_of)}
    # Names carry their maker's pid (torch_<pid>_..., machinlike_claim_<pid>_...): only this
    # process's and its worker's count (tests run alongside under xdist make their own).
    new = set(os.listdir("/dev/shm")) - before
    ours = [n for n in new if (n.startswith("torch_") or "machinlike" in n)
            and any(f"_{pid}_" in n for pid in pids)]
    assert not ours, new


def test_share_mode_maps_each_storage_once_per_worker():
    with Pool(1, is_copy_tensor=False, share_method="cpu") as pool:
        t = torch.zeros(4 * MB)
        first = pool.apply(targets.mappings_of, (t,))
        for _ in range(10):
            pool.apply(targets.add_one_at_, (t, 0))
        assert pool.apply(targets.mappings_of, (t,)) == first  # no new mapping per trip
        assert float(t[0]) == 10.0


@pytest.mark.parametrize("packed", [False, True])
def test_worker_killed_holding_a_lent_segment(packed):
    # 8 MB of 5.0: one tensor (a segment of its own) or 128 of 64 KB (one packed segment)
    t = [torch.full((16384,), 5.0) for _ in range(128)] if packed else torch.full((2 * MB,), 5.0)
    with Pool(1) as pool:
        with pytest.raises(WorkerLostError):
            pool.apply(targets.kill_self_holding, (t,))
        reclaimed = _shm.cache().stats["reclaimed"]
        assert pool.apply(targets.tensor_sum, (t,)) == 5.0 * 2 * MB  # the replacement worker
        assert _shm.cache().stats["reclaimed"] == reclaimed + 1  # the dead worker's lease came back


def test_copy_mode_packs_many_medium_tensors_into_one_segment_both_ways():
    import numpy as np

    frames = [torch.rand(16384) for _ in range(64)] + [np.random.rand(2048) for _ in range(8)]  # 64 KB, 16 KB
    steps = [torch.rand(8) for _ in range(20)]  # small: bundled
    items = frames + steps
    originals = [x.clone() if isinstance(x, torch.Tensor) else x.copy() for x in items]
    with Pool(1) as pool:
        before = _shm.cache().stats["leases"]
        worker_before = pool.apply(targets.shm_stats)["leases"]
        back = pool.apply(targets.add_one_to_each, (items,))
        assert _shm.cache().stats["leases"] == before + 1  # the task's 64 + 8 medium items: one segment
        assert pool.apply(targets.shm_stats)["leases"] == worker_before + 1  # and the result's
        for sent, original, got in zip(items, originals, back):
            assert type(got) is type(sent)
            if isinstance(sent, np.ndarray):
                assert (got == original + 1).all() and (sent == original).all()  # copies both ways
            else:
                assert torch.equal(got, original + 1) and torch.equal(sent, original)
    with Pool(2) as pool:
        # A map's chunks are packed too; a function's closure (loaded by every worker) is not.
        weights = [torch.full((16384,), 2.0) for _ in range(32)]
        sums = pool.map(lambda k: float(sum(w.sum() for w in weights)) + k, range(8), chunksize=1)
        assert sums == [32 * 16384 * 2.0 + k for k in range(8)]
        chunks = pool.map(targets.add_one_to_each, [[torch.zeros(16384) for _ in range(20)] for _ in range(4)])
        assert all(float(t.sum()) == 16384.0 for chunk in chunks for t in chunk)


def test_a_chunk_that_fails_to_pickle_hands_its_packed_segment_back():
    # The worker pickles a chunk's results at once (its frames packed into one lent
    # segment); one of them cannot be pickled, so it pickles them one by one: the first
    # segment, never sent, must come back, or every such chunk would keep one for good.
    with Pool(1) as pool:
        with pytest.raises(TypeError, match="cannot pickle 'generator' object"):
            pool.map(targets.frames_or_generator, range(4), chunksize=4)
        # The results pickled one by one were sent; their segments come back once this
        # process has loaded and dropped them (its result thread may still be at it).
        deadline = time.monotonic() + 20
        while pool.apply(targets.lent_segments):
            assert time.monotonic() < deadline, "a segment the worker never sent stayed lent"
            time.sleep(0.05)
