"""machinlike.pool: the standard pool surface on all five pools, validation, pickling refusal."""

from __future__ import annotations

import gc
import itertools
import multiprocessing
import pickle
import threading
import time

import pool_targets as targets
import pytest

import machinlike.pickle as mlpickle
import machinlike.pool as pool_module
from machinlike.pool import (
    AsyncResult,
    CtxPool,
    CtxThreadPool,
    IMapIterator,
    IMapUnorderedIterator,
    MapResult,
    P2PPool,
    Pool,
    PoolTimeoutError,
    ThreadPool,
)

WAIT = 60.0

FACTORIES = {
    "Pool": lambda **kw: Pool(2, **kw),
    "P2PPool": lambda **kw: P2PPool(2, **kw),
    "CtxPool": lambda **kw: CtxPool(2, worker_contexts=[10, 20], **kw),
    "ThreadPool": lambda **kw: ThreadPool(2, **kw),
    "CtxThreadPool": lambda **kw: CtxThreadPool(2, worker_contexts=[10, 20], **kw),
}


@pytest.mark.parametrize("name", list(FACTORIES))
def test_standard_surface(name):
    with_context = name.startswith("Ctx")
    offset = 1000

    def f(*args):  # a local closure: travels by value to process workers
        if with_context:
            context, *args = args
            assert context in (10, 20)
        return sum(args) + offset

    with FACTORIES[name]() as pool:
        assert pool.size() == 2
        assert pool.apply(f, (1, 2)) == 1003
        assert pool.apply(f, (), {}) == 1000
        seen = []
        result = pool.apply_async(f, (5,), callback=seen.append)
        assert isinstance(result, AsyncResult) and result.get(WAIT) == 1005
        assert seen == [1005] and result.ready() and result.successful()
        assert pool.map(f, range(10)) == [x + 1000 for x in range(10)]
        assert pool.map(f, range(10), chunksize=3) == [x + 1000 for x in range(10)]
        assert pool.map(f, []) == []
        done = []
        mapped = pool.map_async(f, range(7), callback=done.append)
        assert isinstance(mapped, MapResult) and mapped.get(WAIT) == [x + 1000 for x in range(7)]
        assert done == [[x + 1000 for x in range(7)]]
        for chunksize in (1, 4):
            ordered = pool.imap(f, range(9), chunksize=chunksize)
            assert isinstance(ordered, IMapIterator)
            assert list(ordered) == [x + 1000 for x in range(9)]
            unordered = pool.imap_unordered(f, iter(range(9)), chunksize=chunksize)
            assert isinstance(unordered, IMapUnorderedIterator)
            assert sorted(unordered) == [x + 1000 for x in range(9)]
        assert pool.starmap(f, [(1, 2), (3, 4)]) == [1003, 1007]
        assert pool.starmap_async(f, [(1, 1)] * 3, chunksize=2).get(WAIT) == [1002] * 3
        errors = []
        failing = pool.apply_async(targets.ctx_raise if with_context else targets.raise_value_error,
                                   error_callback=errors.append)
        with pytest.raises(ValueError, match="boom"):
            failing.get(WAIT)
        assert not failing.successful() and errors and isinstance(errors[0], ValueError)
        with pytest.raises(ValueError, match="three"):
            pool.map(targets.ctx_fail_on_three if with_context else targets.fail_on_three, range(6), chunksize=1)


@pytest.mark.parametrize("name", ["Pool", "ThreadPool"])
def test_close_then_join_finishes_the_work(name):
    pool = FACTORIES[name]()
    results = [pool.apply_async(targets.square, (i,)) for i in range(20)]
    pool.close()
    pool.join(WAIT)
    assert [r.get(0) for r in results] == [i * i for i in range(20)]
    with pytest.raises(ValueError, match="not running"):
        pool.apply_async(targets.square, (1,))
    with pytest.raises(ValueError, match="not running"):
        pool.map(targets.square, [1])
    pool.terminate()  # idempotent after close


@pytest.mark.parametrize("name", list(FACTORIES))
def test_waiting_for_a_result_inside_a_callback_raises_instead_of_deadlocking(name):
    # ThreadPool's callbacks take turns under one lock: one that waited for another
    # result deadlocked the whole pool, every later task included (cold trial 27).
    with FACTORIES[name]() as pool:
        seen = []

        def callback(_):
            try:
                seen.append(pool.apply(abs, (-1,)))
            except RuntimeError as err:
                seen.append(str(err))

        func = (lambda context, x: abs(x)) if name.startswith("Ctx") else abs
        assert pool.apply_async(func, (-5,), callback=callback).get(WAIT) == 5
        assert len(seen) == 1 and "inside one of the pool's callbacks would deadlock" in seen[0], seen
        assert pool.apply_async(func, (-2,)).get(WAIT) == 2  # the pool goes on


def test_results_time_out_and_report_their_state(tmp_path):
    release = targets.ReleaseFifo(tmp_path / "go")
    with Pool(1) as pool:
        blocked = pool.apply_async(targets.wait_on_fifo, (release.path,))
        assert not blocked.ready()
        with pytest.raises(ValueError, match="not ready"):
            blocked.successful()
        with pytest.raises(PoolTimeoutError) as raised:
            blocked.get(0.05)
        assert isinstance(raised.value, multiprocessing.TimeoutError) and isinstance(raised.value, TimeoutError)
        blocked.wait(0.01)
        assert not blocked.ready()
        iterator = pool.imap(targets.square, range(3))
        with pytest.raises(TimeoutError):
            iterator.next(0.05)  # the worker is still blocked
        release.release()
        assert isinstance(blocked.get(WAIT), int)
        assert [iterator.next(WAIT) for _ in range(3)] == [0, 1, 4]
        with pytest.raises(StopIteration):
            iterator.next(WAIT)
    release.close()


def test_the_function_of_a_map_is_pickled_once():
    targets.CountingCallable.pickles = 0
    with Pool(2) as pool:
        assert pool.map(targets.CountingCallable(), range(40), chunksize=1) == list(range(1, 41))
        assert targets.CountingCallable.pickles == 1
        assert list(pool.imap(targets.CountingCallable(), range(40))) == list(range(1, 41))
        assert targets.CountingCallable.pickles == 2


def test_imap_is_lazy_for_every_chunksize():
    closed = threading.Event()
    pulled = itertools.count()

    def endless():
        try:
            for k in itertools.count():
                next(pulled)
                yield k
        finally:
            closed.set()

    with Pool(2) as pool:
        for chunksize in (1, 5):
            iterator = pool.imap(targets.square, endless(), chunksize=chunksize)
            assert [iterator.next(WAIT) for _ in range(10)] == [k * k for k in range(10)]
            # bounded read-ahead: the feed's window (the pool's, in chunks; 256 items at
            # least, rounded up to whole chunks)
            assert iterator._feed.ahead == max(pool._backend.ahead(), -(-256 // chunksize)) * chunksize
            assert next(pulled) < 10 + iterator._feed.ahead + chunksize + 1
            pulled = itertools.count()
            del iterator
            gc.collect()
            assert closed.wait(WAIT), "an abandoned imap must stop reading and close its input"
            closed.clear()


def test_imap_of_a_list_hands_many_chunks_at_once_and_keeps_its_window():
    """An input in memory (a list's, a tuple's or a range's iterator) is pulled several
    chunks a round (a P2PPool's imap at chunksize=1 ran at a third of multiprocessing.Pool's
    rate, one engine wake-up an item); the results and the read-ahead bound are unchanged."""
    from machinlike.pool import _feed

    items = list(range(3000))
    with P2PPool(2) as pool:
        for chunksize in (1, 7):
            assert list(pool.imap(targets.square, items, chunksize=chunksize)) == [k * k for k in items]
            assert sorted(pool.imap_unordered(targets.square, tuple(items), chunksize=chunksize)) == \
                [k * k for k in items]
        iterator = iter(range(10_000))
        results = pool.imap(targets.square, iterator, chunksize=2)
        assert [results.next(WAIT) for _ in range(5)] == [k * k for k in range(5)]
        time.sleep(0.2)  # (give the feeder time to over-read, if it would: it must not)
        assert next(iterator) < 5 + results._feed.ahead + 2 + 1
        del results
    assert type(iter(range(1))) in _feed._NEVER_BLOCKS and type(iter(x for x in ())) not in _feed._NEVER_BLOCKS


def test_an_error_of_the_input_iterable_ends_imap_at_its_position():
    def broken():
        yield 1
        yield 2
        raise KeyError("the input broke")

    with Pool(1) as pool:
        iterator = pool.imap(targets.square, broken())
        assert iterator.next(WAIT) == 1 and iterator.next(WAIT) == 4
        with pytest.raises(KeyError, match="the input broke"):
            iterator.next(WAIT)
        with pytest.raises(StopIteration):
            iterator.next(WAIT)


def test_initializer_and_contexts():
    with Pool(2, initializer=targets.remember, initargs=("hello",)) as pool:
        assert pool.map(targets.recall, range(4), chunksize=1) == ["hello"] * 4
    with CtxPool(2, worker_contexts=[100, 200]) as pool:
        assert pool.apply(targets.ctx_add, (5,)) in (105, 205)
        results = pool.map(targets.ctx_and_pid, range(6), chunksize=1)
        assert {c for c, _, _ in results} <= {100, 200} and [x for _, _, x in results] == list(range(6))
        assert pool.starmap(targets.ctx_add, [(1,), (2,)]) in ([101, 102], [101, 202], [201, 102], [201, 202])
    counter = targets.Counter()
    with CtxThreadPool(1, worker_contexts=[counter]) as pool:
        assert pool.map(targets.count_call, range(3)) == [1, 2, 3]
    assert counter.calls == 3  # a thread's context is the object itself
    with CtxPool(1) as pool:  # no contexts: None
        assert pool.apply(targets.ctx_and_pid)[0] is None


def test_a_replacement_worker_gets_the_context_of_the_one_it_replaces():
    with CtxPool(2, worker_contexts=["first", "second"], maxtasksperchild=1) as pool:
        by_context = {}
        for context, pid, _ in pool.map(targets.ctx_and_pid, range(12), chunksize=1):
            by_context.setdefault(context, set()).add(pid)
        assert set(by_context) <= {"first", "second"}
        assert sum(len(pids) for pids in by_context.values()) == 12  # each task on a fresh worker


def test_nested_pools_need_non_daemon_workers():
    with Pool(1, is_daemon=False) as pool:
        assert pool.apply(targets.make_nested_pool_and_map, (4,)) == [0, 1, 4, 9]


def test_pools_refuse_to_be_pickled():
    with Pool(1) as pool, ThreadPool(1) as threads:
        for candidate in (pool, threads):
            with pytest.raises(TypeError, match="cannot be passed between processes or pickled"):
                pickle.dumps(candidate)
            with pytest.raises(NotImplementedError, match="cannot be passed"):  # machin's type and phrase
                pickle.dumps(candidate)
            with pytest.raises(TypeError, match="or pickled"):
                mlpickle.dumps(candidate)
        with pytest.raises(TypeError, match="or pickled"):
            pool.apply(lambda: pool.size())  # a closure over the pool cannot travel
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(pool.apply_async(targets.square, (1,)))


async def _coroutine(x):
    return x


def test_argument_validation():
    bad_constructors = [
        (lambda: Pool(0), ValueError, "processes must be >= 1"),
        (lambda: Pool("2"), TypeError, "processes must be an int"),
        (lambda: Pool(1, initializer=3), TypeError, "initializer must be callable"),
        (lambda: Pool(1, initargs=5), TypeError, "initargs must be a tuple"),
        (lambda: Pool(1, maxtasksperchild=0), ValueError, "maxtasksperchild must be None"),
        (lambda: Pool(1, is_copy_tensor=False), ValueError, "needs share_method='cpu'"),
        (lambda: Pool(1, is_copy_tensor=False, share_method="gpu"), ValueError, "unknown method"),
        (lambda: Pool(1, share_method=3), TypeError, "share_method must be"),
        (lambda: Pool(1, is_copy_tensor="yes"), TypeError, "is_copy_tensor must be a bool"),
        (lambda: Pool(1, ctx="nope"), ValueError, "not a start method"),
        # a worker forked once this process shared a CUDA tensor could not use CUDA
        (lambda: Pool(1, is_copy_tensor=False, share_method="cuda", ctx="fork"), ValueError,
         r"share_method='cuda' with ctx='fork'.* Use ctx=None \(the warm forkserver\), 'forkserver' or 'spawn'"),
        (lambda: CtxPool(1, worker_contexts=[1], is_copy_tensor=False, share_method=("cpu", "cuda"), ctx="fork"), ValueError,
         "cannot use CUDA"),
        (lambda: CtxPool(2, worker_contexts=[1]), ValueError, "1 context.* but processes=2"),
        (lambda: CtxPool(None), TypeError, "processes must be an int"),
        (lambda: CtxThreadPool(2, worker_contexts=[1, 2, 3]), ValueError, "3 context"),
        (lambda: CtxPool(3, worker_contexts=[1]), ValueError, "not equal to the number"),  # machin's phrase
        (lambda: CtxThreadPool(1, worker_contexts=[1, 2]), ValueError, "not equal to the number"),
        (lambda: ThreadPool(-1), ValueError, "processes must be >= 1"),
    ]
    for make, kind, message in bad_constructors:
        with pytest.raises(kind, match=message):
            make()
    with ThreadPool(1) as pool:
        bad_calls = [
            (lambda: pool.apply(3), TypeError, "func must be callable"),
            (lambda: pool.map(_coroutine, range(3)), TypeError,
             r"func _coroutine is an async function: it would run in a pool worker without an event loop and "
             r"return an unawaited coroutine; pass a plain function, such as lambda \*args: "
             r"asyncio.run\(_coroutine\(\*args\)\)"),
            (lambda: pool.apply_async(targets.square, (1,), callback=_coroutine), TypeError,
             "callback _coroutine is an async function: it would run when its task ends"),
            (lambda: pool.apply(targets.square, 3), TypeError, "args must be a tuple"),
            (lambda: pool.apply(targets.square, "ab"), TypeError, r"write \('ab',\)"),
            (lambda: pool.apply(targets.square, (1,), [1]), TypeError, "kwds must be a mapping"),
            (lambda: pool.apply_async(targets.square, (1,), callback=1), TypeError, "callback must be callable"),
            (lambda: pool.map(targets.square, range(3), chunksize=0), ValueError, "chunksize must be >= 1"),
            (lambda: pool.map(targets.square, 5), TypeError, "iterable must be iterable"),
            (lambda: pool.imap(targets.square, range(3), chunksize=None), TypeError, "chunksize must be an int"),
            (lambda: pool.apply_async(targets.square, (1,)).get(-1), ValueError,
             "timeout=-1 must be a number of seconds >= 0"),
            (lambda: pool.join(), ValueError, "still running"),
        ]
        for call, kind, message in bad_calls:
            with pytest.raises(kind, match=message):
                call()


def test_public_names():
    assert set(pool_module.__all__) >= {
        "Pool", "P2PPool", "CtxPool", "ThreadPool", "CtxThreadPool", "AsyncResult", "IMapIterator",
        "MapResult", "IMapUnorderedIterator", "BrokenPoolError", "PoolTerminatedError", "PoolTimeoutError",
    }
    for name in pool_module.__all__:
        assert getattr(pool_module, name) is not None
    assert issubclass(P2PPool, Pool) and issubclass(CtxPool, Pool) and issubclass(CtxThreadPool, ThreadPool)
    for module in ("_api", "_core", "_errors", "_feed", "_policy", "_result", "_thread", "_wire", "_worker"):
        assert hasattr(__import__(f"machinlike.pool.{module}", fromlist=["__all__"]), "__all__")


def _start_a_child():
    ctx = multiprocessing.get_context("spawn")
    child = ctx.Process(target=print)
    child.start()
    child.join(30)
    return child.exitcode


def test_a_task_that_starts_a_process_in_a_daemon_worker_is_told_the_fix():
    # What a vectorised environment (gymnasium's AsyncVectorEnv) in an actor task meets.
    with Pool(1) as pool:
        with pytest.raises(AssertionError, match="daemonic processes") as info:
            pool.apply(_start_a_child)
        assert any("Pool(..., is_daemon=False)" in note for note in info.value.__notes__)
    with Pool(1, is_daemon=False) as pool:
        assert pool.apply(_start_a_child) == 0


def test_results_are_awaitable_while_the_event_loop_runs_on():
    import asyncio

    gate = threading.Event()

    async def opener():
        await asyncio.sleep(0)  # runs only if the other await let the loop go on
        gate.set()

    async def main(process_pool, thread_pool):
        # An await that held the loop would leave the gate shut: the task would wait its
        # 20 s out and give False.
        held = thread_pool.apply_async(gate.wait, (20,))
        assert await asyncio.gather(held, opener()) == [True, None]
        assert await process_pool.apply_async(targets.square, (7,)) == 49
        assert await process_pool.map_async(targets.square, range(6)) == [0, 1, 4, 9, 16, 25]
        with pytest.raises(ValueError, match="boom from the task"):
            await process_pool.apply_async(targets.raise_value_error)
        done = process_pool.apply_async(targets.square, (3,))
        done.wait(30)
        assert await done == 9  # (settled already: at once)

    with Pool(2) as process_pool, ThreadPool(2) as thread_pool:
        asyncio.run(main(process_pool, thread_pool))


def test_threads_sharing_one_imap_get_every_result_once():
    """Items are handed out without a lock (a chunk at a time is moved under it): threads
    that share one iterator still see each result exactly once, in order per thread."""
    with Pool(2) as pool:
        for cls_name in ("imap", "imap_unordered"):
            iterator = getattr(pool, cls_name)(targets.square, range(20_000), chunksize=7)
            seen: list = [[] for _ in range(4)]

            def drain(bucket: list) -> None:
                for value in iterator:
                    bucket.append(value)

            threads = [threading.Thread(target=drain, args=(bucket,)) for bucket in seen]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(WAIT)
            assert not any(thread.is_alive() for thread in threads)
            assert sorted(v for bucket in seen for v in bucket) == [k * k for k in range(20_000)]
            if cls_name == "imap":
                assert all(bucket == sorted(bucket) for bucket in seen)
