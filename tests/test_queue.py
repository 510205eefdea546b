"""machinlike.queue across real processes: tensors in both modes, fan-in/fan-out, timeouts."""

from __future__ import annotations

import pickle
import time

import pytest
import toolkit_targets as targets
import torch

from machinlike.process import Process
from machinlike.queue import MultiP2PQueue, SimpleP2PQueue, SimpleQueue

WAIT = 30.0


def start(target, *args):
    p = Process(target=target, args=args)
    p.start()
    return p


def finish(*processes):
    for p in processes:
        p.join(WAIT)
        assert p.exitcode is not None, f"{p.name} did not finish"
        p.watch()


@pytest.mark.parametrize("queue_type", ["simple", "p2p"])
@pytest.mark.parametrize("copy_tensor", [True, False], ids=["copy", "share"])
def test_tensor_round_trip_through_a_child(queue_type, copy_tensor):
    make = SimpleQueue if queue_type == "simple" else SimpleP2PQueue
    inbox, outbox = make(copy_tensor=copy_tensor), make(copy_tensor=copy_tensor)
    child = start(targets.echo_incremented, inbox, outbox)
    t = torch.zeros(3)
    inbox.put(t)
    back = outbox.get(WAIT)
    finish(child)
    assert torch.equal(back, torch.ones(3))
    # only a shared tensor is the parent's own memory
    assert torch.equal(t, torch.zeros(3) if copy_tensor else torch.ones(3))


@pytest.mark.parametrize("pre_shared", [False, True], ids=["plain", "share_memory_"])
def test_same_tensor_put_twice_reaches_the_child_twice(pre_shared):
    # machin mapped typed storages to the wrong reducer: a tensor fed twice hung a pool
    t = torch.zeros(2)
    if pre_shared:
        t.share_memory_()  # fd-backed under torch's default strategy
    queue = SimpleQueue()
    child = start(targets.add_one_to_each, queue, 2)
    queue.put(t)
    queue.put(t)
    finish(child)
    assert torch.equal(t, torch.full((2,), 2.0))


def test_many_producers_many_consumers():
    producers, consumers, per_producer = 3, 2, 150
    work, results = SimpleQueue(), SimpleQueue()
    makers = [start(targets.produce, work, i, per_producer) for i in range(producers)]
    takers = [start(targets.consume, work, results) for _ in range(consumers)]
    finish(*makers)
    for _ in range(consumers):
        work.put(None)
    collected = [item for _ in range(consumers) for item in results.get(WAIT)]
    finish(*takers)
    expected = [(i, k) for i in range(producers) for k in range(per_producer)]
    assert sorted(collected) == expected, "every item exactly once"


@pytest.mark.parametrize("make", [SimpleQueue, SimpleP2PQueue], ids=["simple", "p2p"])
def test_get_timeout_is_bounded_and_says_how_long(make):
    queue = make()
    begin = time.monotonic()
    with pytest.raises(TimeoutError, match=r"after waiting 0\.3 s"):
        queue.get(timeout=0.3)
    elapsed = time.monotonic() - begin
    assert 0.29 <= elapsed < 2.0
    queue.put("ready")
    assert not queue.empty()
    assert queue.get(timeout=0) == "ready"
    assert queue.empty()
    queue.close()
    queue.close()  # idempotent


def test_put_of_an_unpicklable_item_leaves_the_queue_usable():
    queue = SimpleQueue()
    with pytest.raises((TypeError, pickle.PicklingError)):
        queue.put((i for i in range(3)))
    queue.put(lambda: "fine")
    assert queue.get(WAIT)() == "fine"


def test_put_timeout_when_the_write_lock_is_held():
    queue = SimpleQueue()
    queue._wlock.acquire()  # stands in for a producer stuck writing a huge item
    try:
        with pytest.raises(TimeoutError, match="write lock"):
            queue.put(torch.ones(2), timeout=0.2)
    finally:
        queue._wlock.release()
    assert queue.empty()


def test_get_timeout_when_another_consumer_holds_the_read_lock():
    queue = SimpleQueue()
    queue._rlock.acquire()
    try:
        begin = time.monotonic()
        with pytest.raises(TimeoutError, match="waiting 0.2 s for an item$"):
            queue.get(timeout=0.2)
        assert time.monotonic() - begin < 2.0
    finally:
        queue._rlock.release()


def test_a_consumer_killed_in_get_is_told_apart_from_an_empty_queue():
    # Cold trial 30: every later get() said it waited "for an item" while one was waiting.
    import os
    import signal

    queue = SimpleQueue()
    consumer = Process(target=targets.wait_for_release, args=(queue,))  # (waits in get())
    consumer.start()
    deadline = time.monotonic() + 30
    while queue._rlock.acquire(False):  # until the consumer waits in get(), holding the lock
        queue._rlock.release()
        assert time.monotonic() < deadline and consumer.is_alive(), "the consumer never reached get()"
        time.sleep(0.01)
    os.kill(consumer.pid, signal.SIGKILL)
    consumer.join(30)
    queue.put("waiting")
    with pytest.raises(TimeoutError, match="for the read lock while an item is waiting: another consumer holds "
                                           "the lock .* died while reading.* make a new queue"):
        queue.get(timeout=0.2)


def test_multi_p2p_get_any_reports_the_channel():
    channels = 3
    queue = MultiP2PQueue(channels)
    children = [start(targets.answer_on_channel, queue, i) for i in range(channels)]
    got = {}
    for _ in range(channels):
        index, (sent_index, tensor) = queue.get_any(WAIT)
        assert index == sent_index and torch.equal(tensor, torch.full((2,), float(index)))
        got[index] = True
    finish(*children)
    assert sorted(got) == list(range(channels))
    begin = time.monotonic()
    with pytest.raises(TimeoutError, match="get_any"):
        queue.get_any(timeout=0.2)
    assert time.monotonic() - begin < 2.0


def test_multi_p2p_fan_out_to_workers():
    tasks, replies = MultiP2PQueue(2, copy_tensor=True), MultiP2PQueue(2)
    children = [start(targets.channel_worker, tasks, replies, i) for i in range(2)]
    for value in range(4):
        tasks.put(value % 2, value)
    assert [replies.get(0, WAIT), replies.get(0, WAIT)] == [0, 20]
    assert [replies.get(1, WAIT), replies.get(1, WAIT)] == [10, 30]
    for i in range(2):
        tasks.put(i, None)
    finish(*children)


def test_multi_p2p_get_any_serves_ready_channels_in_turn():
    queue = MultiP2PQueue(2)
    for k in range(3):
        queue.put(0, ("a", k))
        queue.put(1, ("b", k))
    order = [queue.get_any(WAIT)[0] for _ in range(6)]
    assert order == [0, 1, 0, 1, 0, 1]


def test_machins_quick_put_and_quick_get_keep_their_meaning():
    # machin's MultiP2PQueue had only these: quick_put round robin, quick_get from any.
    queue = MultiP2PQueue(3)
    for k in range(6):
        queue.quick_put(k)
    assert [queue.get(i, WAIT) for i in (0, 0, 1, 1, 2, 2)] == [0, 3, 1, 4, 2, 5]
    queue.quick_put("x")  # (channel 0 again)
    assert queue.quick_get(WAIT) == "x"
    with pytest.raises(TimeoutError):
        queue.quick_get(timeout=0.05)
    with pytest.raises(TypeError, match=r"put\(index, obj\) takes the channel first.*quick_put\(obj\)"):
        queue.put("x")  # machin's put(obj)
    simple = SimpleQueue()
    simple.quick_put([1, 2])
    assert simple.quick_get(WAIT) == [1, 2]


def test_multi_p2p_argument_validation():
    with pytest.raises(ValueError, match="queue_num must be >= 1"):
        MultiP2PQueue(0)
    with pytest.raises(TypeError, match="queue_num must be an int"):
        MultiP2PQueue(2.0)
    queue = MultiP2PQueue(2)
    assert len(queue) == 2 and queue.get_sub_queue(1) is queue[1]
    with pytest.raises(IndexError, match="out of range for 2 channels"):
        queue.put(2, "x")
    with pytest.raises(ValueError, match=r"timeout=-[0-9.]* must be a number of seconds >= 0 \(finite\)"):
        queue.get(0, timeout=-1)


def test_queues_travel_only_as_process_arguments():
    for queue in (SimpleQueue(), SimpleP2PQueue(), MultiP2PQueue(1)):
        with pytest.raises(RuntimeError, match="inheritance"):
            pickle.dumps(queue)


def test_simple_queue_argument_validation():
    with pytest.raises(TypeError, match="copy_tensor must be a bool"):
        SimpleQueue(copy_tensor=1)
    with pytest.raises(ValueError, match="not a start method"):
        SimpleQueue(ctx="no-such-method")
    with pytest.raises(TypeError, match="timeout=.* must be a number of seconds, not"):
        SimpleQueue().get(timeout="1")


def test_public_names():
    import machinlike.queue as module

    assert sorted(module.__all__) == ["MultiP2PQueue", "SimpleP2PQueue", "SimpleQueue", "TimeoutError"]


def test_timeout_error_is_machins_name_and_both_kinds():
    import builtins
    import multiprocessing

    from machinlike.queue import TimeoutError as QueueTimeoutError

    assert issubclass(QueueTimeoutError, multiprocessing.TimeoutError)
    assert issubclass(QueueTimeoutError, builtins.TimeoutError)
    queue = SimpleQueue()
    try:
        with pytest.raises(QueueTimeoutError):  # what machin's gym wrappers catch
            queue.get(timeout=0.05)
        with pytest.raises(multiprocessing.TimeoutError):
            queue.get(timeout=0.05)
    finally:
        queue.close()


def _put_bytes(queue, size):
    queue.put(b"x" * size)


@pytest.mark.parametrize("make", [SimpleQueue, SimpleP2PQueue, lambda: MultiP2PQueue(1)[0]],
                         ids=["simple", "p2p", "multi-channel"])
def test_a_writer_stopped_or_killed_mid_item_does_not_hold_get_past_its_timeout(make):
    # Cold trial 26: get(timeout=1) was still blocked after 5 s (poll, then an unbounded
    # recv_bytes); a stopped writer's item is now kept and finished by the next get.
    import os
    import signal

    queue, size = make(), 8 << 20
    for sig in (signal.SIGSTOP, signal.SIGKILL):
        writer = Process(target=_put_bytes, args=(queue, size))
        writer.start()
        deadline = time.monotonic() + 30
        while queue.empty() and time.monotonic() < deadline:
            time.sleep(0.01)  # (until its bytes begin to arrive)
        os.kill(writer.pid, sig)
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="in the middle of an item"):
            queue.get(timeout=0.5)
        assert time.monotonic() - start < 2.0
        if sig == signal.SIGSTOP:
            os.kill(writer.pid, signal.SIGCONT)
            assert len(queue.get(timeout=30)) == size  # the same item, whole
        writer.join(30)
