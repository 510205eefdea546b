"""Pools: the standard pool API for PyTorch code, with lambdas, tensor policies, worker
contexts, and workers that may die.

Run it:  python docs/tutorials/code/pool_tour.py
"""

from __future__ import annotations

import os
import time

import torch

from machinlike.exception import RemoteTraceback, WorkerLostError
from machinlike.pool import CtxPool, CtxThreadPool, Pool, PoolTerminatedError, PoolTimeoutError, ThreadPool


# [basics]
def basics() -> None:
    scale = 3
    with Pool(processes=2) as pool:  # workers start from the warm forkserver
        assert pool.map(lambda x: x * scale, range(5)) == [0, 3, 6, 9, 12]  # a closure
        assert pool.starmap(pow, [(2, 3), (3, 2)]) == [8, 9]
        result = pool.apply_async(sum, ([1, 2, 3],), callback=print)
        assert result.get(timeout=30) == 6
        assert sorted(pool.imap_unordered(abs, [-1, -2, -3])) == [1, 2, 3]
        assert pool.size() == 2
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
    # or device, sent once when the worker starts.
    with CtxPool(processes=2, worker_contexts=[{"id": 0}, {"id": 1}]) as pool:
        ids = pool.map(lambda ctx, x: (ctx["id"], x), range(4))
    assert sorted(x for _, x in ids) == [0, 1, 2, 3]
    assert {i for i, _ in ids} <= {0, 1}

    # Contexts follow the tensor policy: shared here, so the workers' in-place updates
    # are the caller's tensors.
    counters = [torch.zeros(1), torch.zeros(1)]
    with CtxPool(processes=2, worker_contexts=counters, is_copy_tensor=False, share_method="cpu") as pool:
        pool.map(lambda counter, x: counter.add_(1), range(10), chunksize=1)
    assert sum(c.item() for c in counters) == 10.0

    # A thread's context is the caller's object itself.
    seen: list = [[], []]
    with CtxThreadPool(processes=2, worker_contexts=seen) as pool:
        pool.map(lambda mine, x: mine.append(x), range(6))
    assert sorted(seen[0] + seen[1]) == [0, 1, 2, 3, 4, 5]
# [/contexts]


# [errors]
def check_positive(x: int) -> int:
    if x < 0:
        raise ValueError(f"{x} is negative")
    return x


def crash(code: int) -> None:
    os._exit(code)  # the worker process dies in the middle of the task


def errors() -> None:
    with Pool(processes=2) as pool:
        # A task's exception keeps its type; the worker's traceback is its __cause__.
        try:
            pool.map(check_positive, [1, -2, 3])
        except ValueError as err:
            assert str(err) == "-2 is negative"
            assert isinstance(err.__cause__, RemoteTraceback)
        else:
            raise AssertionError("the map should have raised")

        # A worker that dies fails the task it was running, with WorkerLostError.
        failures: list = []
        lost = pool.apply_async(crash, (7,), error_callback=failures.append)
        try:
            lost.get(timeout=30)
        except WorkerLostError as err:
            # e.g. "pool worker 0 (pid 4242) exited with code 7: while running its task"
            print(err)
            assert err.exitcode == 7 and "exited with code 7" in str(err)
            assert failures == [err]  # error_callback saw the same exception
        else:
            raise AssertionError("the task should have failed")
        # The task failed, not the pool: a replacement worker takes the dead one's place.
        assert pool.map(abs, [-1, -2]) == [1, 2]
# [/errors]


# [lifetime]
def lifetime() -> None:
    # close(): no new work; join() waits (at most `timeout` seconds) until all of it is done.
    pool = Pool(processes=2)
    pending = [pool.apply_async(abs, (-i,)) for i in range(8)]
    pool.close()
    pool.join(timeout=60)
    assert [r.get(timeout=0) for r in pending] == list(range(8))

    # terminate(): stop now. Results still pending fail with PoolTerminatedError and the
    # workers are ended (SIGTERM, then SIGKILL after a grace period).
    pool = Pool(processes=1)
    long_task = pool.apply_async(time.sleep, (60,))
    queued = pool.apply_async(abs, (-1,))
    try:
        long_task.get(timeout=0.05)
    except PoolTimeoutError:  # also a TimeoutError and a multiprocessing.TimeoutError
        pass
    else:
        raise AssertionError("a 60 s task cannot be done after 0.05 s")
    pool.terminate()
    for result in (long_task, queued):
        try:
            result.get(timeout=30)
        except PoolTerminatedError:
            pass
        else:
            raise AssertionError("terminate() fails every pending result")
    pool.join(timeout=30)
    # Leaving a `with Pool(...)` block calls terminate() too, like the standard pool:
    # get every result inside the block.
# [/lifetime]


def main() -> None:
    basics()
    tensors()
    contexts()
    errors()
    lifetime()
    print("all checks passed")


if __name__ == "__main__":
    main()
