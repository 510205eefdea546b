"""Pickling, queues, processes, threads and events: the toolkit under the pools and RPC.

Run it:  python docs/tutorials/code/pickling_tour.py
"""

from __future__ import annotations

import os
import signal

import torch

from machinlike.event import Event, OrEvent
from machinlike.exception import ProcessExitedError, RemoteTraceback
from machinlike.pickle import dumps, loads
from machinlike.process import Process
from machinlike.queue import SimpleQueue
from machinlike.thread import Thread


# [lambdas]
def lambdas() -> None:
    offset = 10
    add = lambda x: x + offset  # noqa: E731 - a lambda closing over a local
    clone = loads(dumps(add))  # the standard pickle refuses this; dill handles it
    assert clone(1) == 11
# [/lambdas]


# [copy-share]
def fill(tensor: torch.Tensor, value: float) -> None:
    tensor.fill_(value)  # runs in the child process


def copy_versus_share() -> None:
    # copy_tensor=True (the default of dumps): the bytes hold the data; a copy arrives.
    t = torch.zeros(3)
    copied = loads(dumps(t, copy_tensor=True))
    copied.fill_(1.0)
    assert t.sum().item() == 0.0

    # copy_tensor=False: the tensor moves to shared memory and the bytes hold a handle;
    # whoever loads them (this or another process) works on the same memory.
    shared = loads(dumps(t, copy_tensor=False))
    shared.fill_(2.0)
    assert t.sum().item() == 6.0

    # machinlike.process.Process sends its arguments shared: the child's in-place edit
    # reaches the parent.
    child = Process(target=fill, args=(t, 5.0))
    child.start()
    child.join(30)
    assert t.tolist() == [5.0, 5.0, 5.0]
# [/copy-share]


# [queues]
def producer(queue: SimpleQueue) -> None:
    for i in range(3):
        queue.put({"step": i, "obs": torch.full((2,), float(i))})
    queue.put(None)


def queues() -> None:
    queue = SimpleQueue(copy_tensor=True)  # items carry copies of their tensors
    child = Process(target=producer, args=(queue,))
    child.start()
    items = []
    while (item := queue.get(timeout=30)) is not None:
        items.append(item["obs"].sum().item())
    child.join(30)
    queue.close()
    assert items == [0.0, 2.0, 4.0]
# [/queues]


# [failures]
def fail() -> None:
    raise KeyError("no such episode")


def failures() -> None:
    # An exception in the child keeps its type; the child's traceback is its __cause__.
    child = Process(target=fail)
    child.start()
    child.join(30)
    assert isinstance(child.exception, KeyError)
    assert isinstance(child.exception.__cause__, RemoteTraceback)
    try:
        child.watch()  # re-raises it here
    except KeyError:
        pass

    # A child that dies by a signal is reported as such.
    child = Process(target=lambda: os.kill(os.getpid(), signal.SIGKILL))
    child.start()
    child.join(30)
    assert isinstance(child.exception, ProcessExitedError)
    assert child.exception.signal_name == "SIGKILL"
    print(child.exception)  # Process-... (pid ...) killed by signal SIGKILL (9)

    # A thread keeps its target's exception too (the very object, nothing pickled).
    thread = Thread(target=fail)
    thread.start()
    thread.join(30)
    assert isinstance(thread.exception, KeyError)
# [/failures]


# [events]
def events() -> None:
    done, stopped = Event(), Event()
    either = OrEvent(done, stopped)
    assert not either.wait(timeout=0.01)  # returns after at most the timeout
    setter = Thread(target=stopped.set)
    setter.start()
    assert either.wait(timeout=30)  # returns as soon as a child is set
    setter.join(30)
    assert either.wait(timeout=30)  # and at once when it already is
# [/events]


def main() -> None:
    lambdas()
    copy_versus_share()
    queues()
    failures()
    events()
    print("all checks passed")


if __name__ == "__main__":
    main()
