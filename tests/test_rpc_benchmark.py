"""``benchmarks/rpc.py``'s "own Python" row times the caller's side alone: its stub is the
call a group's blocking call sends with, so no call reaches the callee while it is timed.

Why a test: a group's call moved from ``rpc_sync`` to ``rpc_async`` plus a liveness wait,
the benchmark went on stubbing ``rpc_sync``, and its row timed whole calls over TCP as
"own Python" (484 µs where the caller's part is about 15 µs) without anything failing.
"""

from __future__ import annotations

import os
import sys

from machinlike.testing import run_world

BENCHMARKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def _never(*args):
    raise AssertionError("a call reached the callee while the caller's own Python was timed")


def _timed_calls_never_leave(world):
    group = world.create_rpc_group("bench", world.get_members())
    if world.rank == 1:
        group.register("never", _never)
    group.barrier(timeout=30)
    sent = []
    if world.rank == 0:
        sys.path.insert(0, BENCHMARKS)
        import rpc as bench  # (benchmarks/rpc.py)

        answered = bench._answered

        def counted(*args, **kwargs):
            sent.append(args[0])
            return answered(*args, **kwargs)

        bench._answered = counted
        per_call = bench._own_cost(lambda: group.registered_sync("never", timeout=10), 10)
        assert per_call > 0
        # And the stub is gone afterwards: a real call reaches the callee and fails there.
        try:
            group.registered_sync("never", timeout=10)
        except AssertionError as err:
            sent.append(f"after: {err}")
    group.barrier(timeout=30)
    return sent


def test_the_own_python_row_stubs_the_call_groups_send_with():
    sent, _ = run_world(_timed_calls_never_leave, world_size=2, timeout=60)
    assert sent[:-1] == ["1"] * 50, sent  # 5 blocks of 10 calls, each stopped at the stub
    assert sent[-1].startswith("after: a call reached the callee"), sent[-1]
