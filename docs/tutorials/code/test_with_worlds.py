"""Testing distributed code with machinlike.testing.

Run it:  python -m pytest docs/tutorials/code/test_with_worlds.py
"""

from __future__ import annotations

import pytest
import torch

from machinlike.testing import run_world, world_test


# [world-test]
@world_test(world_size=3, timeout=60)
def test_every_member_serves(world):
    group = world.create_rpc_group("g", world.get_members())
    group.register(f"rank-of/{world.name}", lambda: world.rank)
    group.barrier()
    ranks = [group.registered_sync(f"rank-of/{m}") for m in group.get_group_members()]
    assert ranks == [0, 1, 2]
    group.barrier()
    group.destroy()
# [/world-test]


# [parametrized]
@world_test(world_size=2, timeout=60)
@pytest.mark.parametrize("op", ["SUM", "MAX"])
def test_all_reduce(world, op, tmp_path):  # pytest fills op and tmp_path as usual
    group = world.create_collective_group([0, 1])
    t = torch.tensor([world.rank + 1.0])
    group.all_reduce(t, op=getattr(torch.distributed.ReduceOp, op))
    assert t.item() == {"SUM": 3.0, "MAX": 2.0}[op]
    (tmp_path / f"rank{world.rank}").write_text(op)  # every rank sees the same tmp_path
    group.destroy()
# [/parametrized]


# [run-world]
def square_rank(world):
    return world.rank ** 2


def fail_on_rank_one(world):
    if world.rank == 1:
        raise ValueError("rank 1 disagrees")
    return "ok"


def test_results_per_rank():
    assert run_world(square_rank, 3, timeout=60) == [0, 1, 4]


def test_a_failing_rank_fails_the_test():
    with pytest.raises(ValueError, match="rank 1 disagrees") as info:
        run_world(fail_on_rank_one, 2, timeout=60)
    assert "rank 1" in str(info.value.__cause__)  # the remote traceback names the rank
# [/run-world]
