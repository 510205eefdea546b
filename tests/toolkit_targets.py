"""Child-process targets for the toolkit tests.

They live here, not in the test modules, because a child must import the module that
defines its target: a test module imports pytest (about 0.3 s per child), this one only
what the targets need. Closures and lambdas are built by factories here for the same
reason.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

import torch

from machinlike.pickle import loads
from machinlike.process import Process

WAIT = 30.0


def noop() -> None:
    pass


def raise_value_error(message: str = "boom from the child") -> None:
    raise ValueError(message)


def exit_with(code: object) -> None:
    sys.exit(code)


def hard_exit(code: int) -> None:
    os._exit(code)


def kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def segfault() -> None:
    ctypes.string_at(0)


def add_one(tensor: torch.Tensor) -> None:
    tensor.add_(1)


def set_index(tensor: torch.Tensor, index: int) -> None:
    tensor[index] = 1


def load_and_add(payload: bytes, times: int = 1) -> None:
    for _ in range(times):
        loads(payload).add_(1)


def call_loaded(payload: bytes, argument: object, expected: object) -> None:
    result = loads(payload)(argument)
    if result != expected:
        raise AssertionError(f"loaded function returned {result!r}, expected {expected!r}")


def adder_lambda():
    return lambda tensor, amount: tensor.add_(amount)


def closure_over(tensor: torch.Tensor):
    def bump() -> None:
        tensor.add_(1)

    return bump


def echo_incremented(inbox, outbox) -> None:
    tensor = inbox.get(WAIT)
    tensor.add_(1)
    outbox.put(tensor)


def produce(queue, producer: int, count: int) -> None:
    for k in range(count):
        # a tensor now and then: each new shared tensor costs a shared-memory segment
        queue.put((producer, k, torch.tensor([producer, k]) if k % 25 == 0 else [producer, k]))


def consume(queue, results) -> None:
    seen = []
    while True:
        item = queue.get(WAIT)
        if item is None:
            break
        producer, k, body = item
        body = body.tolist() if isinstance(body, torch.Tensor) else body
        if body != [producer, k]:
            raise AssertionError(f"item {(producer, k)} carried {body}")
        seen.append((producer, k))
    results.put(seen)


def answer_on_channel(queue, index: int) -> None:
    queue.put(index, (index, torch.full((2,), float(index))))


def channel_worker(tasks, replies, index: int) -> None:
    while (item := tasks.get(index, WAIT)) is not None:
        replies.put(index, item * 10)


def wait_for_release(queue) -> None:
    queue.get(WAIT)


def report_threads_then_block(queue) -> None:
    queue.put((os.getpid(), sorted(t.name for t in threading.enumerate())))
    threading.Event().wait()  # until the watchdog ends this process


def start_daemon_grandchild_then_die(report, go) -> None:
    child = Process(target=report_threads_then_block, args=(report,), daemon=True)
    child.start()
    go.get(WAIT)  # the test's go-ahead: the grandchild has reported
    os._exit(0)  # no cleanup, no atexit: as if killed


def add_one_to_each(queue, count: int) -> None:
    for _ in range(count):
        queue.get(WAIT).add_(1)


class WorkerWithRun(Process):
    """A subclass that overrides run() instead of passing a target."""

    def __init__(self, tensor: torch.Tensor, fail: bool, **kwargs) -> None:
        super().__init__(**kwargs)
        self.tensor, self.fail = tensor, fail
        self.step = lambda t: t.add_(1)  # only machinlike.pickle can carry this

    def run(self) -> None:
        self.step(self.tensor)
        if self.fail:
            raise KeyError("raised in run()")


def share_and_send(queue):
    """Share a fresh tensor by file descriptor, send it in share mode, and return (exit)."""
    from machinlike.pickle import dumps

    t = torch.arange(4.0)
    t.share_memory_()
    queue.put(dumps(t, copy_tensor=False))


def put_array_and_exit(queue):
    """Put a 2 MiB numpy array (Fortran order) on a share-mode queue, and return (exit)."""
    import numpy as np

    queue.put(np.asfortranarray(np.arange(1 << 18, dtype=np.float64).reshape(512, 512)))


def sum_into(array, queue) -> None:
    """Put the sum of ``array`` (a numpy array argument) on ``queue``."""
    queue.put(float(array.sum()))
