"""The warm forkserver's two profiles: light for processes and pools, train for ranks."""

from __future__ import annotations

import sys

import machinlike
from machinlike.pool import Pool


def _has_dynamo() -> bool:
    return "torch._dynamo" in sys.modules


def _rank_job(world):
    # A pool inside a rank borrows the rank's own (train) server: no third server.
    with Pool(1) as pool:
        return _has_dynamo(), pool.apply(_has_dynamo)


def test_pools_start_light_and_ranks_start_with_dynamo():
    with Pool(1) as pool:
        assert pool.apply(_has_dynamo) is False, "a pool worker should not pay for importing torch._dynamo"
    assert machinlike.launch(_rank_job, 2, timeout=120) == [(True, True), (True, True)]
