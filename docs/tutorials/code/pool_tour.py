"""Pools: the standard pool API for PyTorch code, with lambdas, tensor policies and
workers that may die.

Run it:  python docs/tutorials/code/pool_tour.py
"""

from __future__ import annotations

import os

import torch

from machinlike.exception import WorkerLostError
from machinlike.pool import CtxPool, Pool, ThreadPool


# [basics]
def basics() -> None:
    scale = 3
    with Pool(processes=2) as pool:  # workers start from the warm forkserver
        assert pool.map(lambda x: x * scale, range(5)) == [0, 3, 6, 9, 12]  # a closure
        assert pool.starmap(pow, [(2, 3), (3, 2)]) == [8, 9]
        result = pool.apply_async(sum, ([1, 2, 3],), callback=print)
        assert result.get(timeout=30) == 6
        assert sorted(pool.imap_unordered(abs, [-1, -2, -3])) == [1, 2, 3]
# [/basics]


# [tensors]
def fill(tensor: torch.Tensor) -> torch.Tensor:
    tensor.fill_(1.0)  # an in-place edit, in the worker
    return tensor


def tensors() -> None:
    t = torch.zeros(4)
    # is_copy_tensor=True (the default): arguments and results are copies.
    with Pool(processes=1) as pool:
        assert pool.apply(fill, (t,)).sum().item() == 4.0
    assert t.sum().item() == 0.0  # the worker edited its own copy

    # is_copy_tensor=False, share_method="cpu": tensors travel by reference through
    # shared memory; the worker's in-place edit is the caller's tensor's.
    with Pool(processes=1, is_copy_tensor=False, share_method="cpu") as pool:
        pool.apply(fill, (t,))
    assert t.sum().item() == 4.0

    # Threads share everything: nothing is pickled, a closure edits the tensor itself.
    u = torch.zeros(2)
    with ThreadPool(processes=2) as pool:
        pool.map(lambda i: u.__setitem__(i, i + 1.0), range(2))
    assert u.tolist() == [1.0, 2.0]
# [/tensors]


# [contexts]
def contexts() -> None:
    # Worker i calls func(worker_contexts[i], *args): a per-worker environment, model,
    # or device, set up once.
    with CtxPool(processes=2, worker_contexts=[{"id": 0}, {"id": 1}]) as pool:
        ids = pool.map(lambda ctx, x: (ctx["id"], x), range(4))
    assert sorted(x for _, x in ids) == [0, 1, 2, 3]
    assert {i for i, _ in ids} <= {0, 1}
# [/contexts]


# [crash]
def crash(code: int) -> None:
    os._exit(code)  # the worker process dies in the middle of the task


def crashes() -> None:
    with Pool(processes=2) as pool:
        try:
            pool.apply(crash, (7,))
        except WorkerLostError as err:
            print(err)  # names the worker, its pid and "exited with code 7"
            assert err.exitcode == 7
        # The task failed, not the pool: a replacement worker takes the dead one's place.
        assert pool.map(abs, [-1, -2]) == [1, 2]
# [/crash]


def main() -> None:
    basics()
    tensors()
    contexts()
    crashes()
    print("all checks passed")


if __name__ == "__main__":
    main()
