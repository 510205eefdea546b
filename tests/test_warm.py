"""The warm forkserver's two profiles: light for processes and pools, train for ranks."""

from __future__ import annotations

import os
import sys

import machinlike
from machinlike.pool import Pool
from machinlike.process import Process


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


def _report_env(out) -> None:
    out.put(os.environ.get("MACHINLIKE_TEST_WARM_ENV"))


def _rank_env(world):
    return os.environ.get("MACHINLIKE_TEST_WARM_ENV")


def test_children_see_the_parents_environment_of_now_not_the_servers(monkeypatch):
    # The servers are warm already (earlier starts in this process, or this one); a
    # variable set afterwards must reach the next child, as it would with spawn.
    assert machinlike.launch(_rank_env, 1, timeout=120) == [os.environ.get("MACHINLIKE_TEST_WARM_ENV")]
    monkeypatch.setenv("MACHINLIKE_TEST_WARM_ENV", "after-start")
    assert machinlike.launch(_rank_env, 1, timeout=120) == ["after-start"]
    out = machinlike.SimpleQueue()
    child = Process(target=_report_env, args=(out,))
    child.start()
    assert out.get(timeout=60) == "after-start"
    child.join(30)
    monkeypatch.delenv("MACHINLIKE_TEST_WARM_ENV")
    assert machinlike.launch(_rank_env, 1, timeout=120) == [None]
