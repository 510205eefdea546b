"""Pools over same-host shared memory: recycled segments in copy mode, mappings kept in
share mode, and nothing left behind when a worker is SIGKILLed holding a lent segment."""

from __future__ import annotations

import os

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


def test_worker_killed_holding_a_lent_segment():
    with Pool(1) as pool:
        t = torch.full((2 * MB,), 5.0)
        with pytest.raises(WorkerLostError):
            pool.apply(targets.kill_self_holding, (t,))
        reclaimed = _shm.cache().stats["reclaimed"]
        assert pool.apply(targets.tensor_sum, (t,)) == 5.0 * 2 * MB  # the replacement worker
        assert _shm.cache().stats["reclaimed"] == reclaimed + 1  # the dead worker's lease came back
