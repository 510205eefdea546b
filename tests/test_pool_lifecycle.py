"""machinlike.pool lifetime and scheduling: exit, GC, orphans, stealing, torch-threaded parents."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time

import pool_targets as targets
import pytest
import torch
from proc_util import wait_for_exit

from machinlike.pool import P2PPool, Pool

WAIT = 60.0
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run_script(body: str, timeout: float = 120.0, extra_args=(), argv=()) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    return subprocess.run(
        [sys.executable, *extra_args, "-c", textwrap.dedent(body), *argv],
        capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT,
    )


pidfd_only = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux >= 5.3)")


# One interpreter serves both unclosed-pool tests (each start imports torch twice: the
# script and its pools' warm forkserver). First a pool is dropped and collected, in a
# section that reports instead of raising, so that its outcome cannot disturb the second
# part: pools left open until the interpreter exits. The exit check runs in an atexit
# handler registered before machinlike is imported, so it runs last: after the pools' own
# exit hook, before the interpreter is gone.
UNCLOSED_POOLS = """
    import atexit, gc, os, select, sys, threading, warnings
    def check():
        for pid in pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            ended = select.select([fd], [], [], 30)[0]
            os.close(fd)
            if not ended:
                print("ALIVE", pid, flush=True)
                return
        print("WORKERS-GONE", flush=True)
    atexit.register(check)
    from machinlike.pool import Pool, P2PPool

    def collect_an_unclosed_pool():
        pool = Pool(2)
        assert pool.apply(abs, (-3,)) == 3
        gc_pids = [w.pid for w in pool._backend._workers]
        with warnings.catch_warnings():
            warnings.simplefilter("always", ResourceWarning)  # what -W always::ResourceWarning sets
            del pool
            gc.collect()
        for pid in gc_pids:
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                continue
            assert select.select([fd], [], [], 30)[0], f"worker {pid} outlived its collected pool"
            os.close(fd)
        left = [t.name for t in threading.enumerate() if t.name.startswith("machinlike-pool")]
        assert not left, left

    try:
        collect_an_unclosed_pool()
        print("REAPED", flush=True)
    except BaseException as exc:
        print("GC-FAILED", repr(exc), flush=True)

    pool = Pool(2)
    busy = P2PPool(2)
    assert pool.map(lambda x: x + 1, range(10)) == list(range(1, 11))
    pending = busy.map_async(abs, range(1000))
    pids = [w.pid for w in pool._backend._workers + busy._backend._workers]
    print("PIDS", *pids, flush=True)
"""


@pytest.fixture(scope="module")
def unclosed_pools() -> subprocess.CompletedProcess:
    if not hasattr(os, "pidfd_open"):
        pytest.skip("needs pidfd_open (Linux >= 5.3)")
    return _run_script(UNCLOSED_POOLS)


@pidfd_only
def test_interpreter_exit_ends_an_unclosed_pool(unclosed_pools):
    done = unclosed_pools
    assert done.returncode == 0, done.stderr
    assert "PIDS" in done.stdout and "WORKERS-GONE" in done.stdout, (done.stdout, done.stderr)
    assert "Traceback" not in done.stderr, done.stderr


@pidfd_only
def test_garbage_collection_ends_an_unclosed_pool_and_warns(unclosed_pools):
    done = unclosed_pools
    assert "REAPED" in done.stdout, (done.stdout, done.stderr)
    assert "unclosed running pool" in done.stderr  # __del__ only warns


THREAD_POOL_AT_EXIT = """
    import sys, threading, time, torch
    from machinlike.pool import ThreadPool

    def train_step(seed):  # what MADDPG's update runs on its pool: autograd on CPU
        torch.manual_seed(seed)
        w = torch.randn(64, 64, requires_grad=True)
        (torch.tanh(torch.randn(32, 64) @ w) ** 2).sum().backward()
        return float(w.grad.abs().sum())

    def busy(seconds):  # inside torch operators (GIL released) until the interpreter exits
        a = torch.randn(300, 300)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            a @ a
        return 1

    pool = ThreadPool(2)  # never closed, as MADDPG never closes its pool
    assert len(pool.starmap(train_step, [(i,) for i in range(8)])) == 8
    if sys.argv[1] == "running":
        pool.apply_async(busy, (1.0,))
        time.sleep(0.2)  # the task is inside torch now
    print("EXITING", flush=True)
"""


@pytest.mark.parametrize("at_exit", ["idle", "running"])
def test_an_open_thread_pool_whose_tasks_used_torch_exits_quietly(at_exit):
    """A thread pool left open at exit ends before the interpreter finalizes: a daemon
    thread caught inside torch then would abort the process ("terminate called without an
    active exception", exit code 134; the standard ThreadPool does)."""
    done = _run_script(THREAD_POOL_AT_EXIT, argv=(at_exit,))
    assert "EXITING" in done.stdout, done.stderr
    assert "terminate called" not in done.stderr, done.stderr
    assert done.returncode == 0, (done.returncode, done.stderr)


@pidfd_only
def test_workers_die_with_a_killed_parent():
    script = _start_script(
        """
        import sys, threading
        from machinlike.pool import Pool
        pool = Pool(2)
        pool.apply(abs, (1,))
        print(*[w.pid for w in pool._backend._workers], flush=True)
        threading.Event().wait(120)
        """
    )
    try:
        pids = [int(pid) for pid in script.stdout.readline().split()]
        assert len(pids) == 2
        script.kill()
        script.wait(WAIT)
        for pid in pids:
            assert wait_for_exit(pid, 30), f"worker {pid} outlived its SIGKILLed parent"
    finally:
        script.kill()
        script.wait(WAIT)
        script.stdout.close()


def _start_script(body: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.path.join(ROOT, "tests")]))
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(body)], stdout=subprocess.PIPE, text=True, env=env, cwd=ROOT
    )


@pidfd_only
def test_terminate_leaves_no_orphans(tmp_path):
    release = targets.ReleaseFifo(tmp_path / "go")
    pool = Pool(2)
    try:
        blocked = [pool.apply_async(targets.wait_on_fifo, (release.path,)) for _ in range(2)]
        pids = [w.pid for w in pool._backend._workers]
        pool.terminate()
        for pid in pids:
            assert wait_for_exit(pid, 0.0), f"worker {pid} survived terminate()"
        assert all(r.ready() and not r.successful() for r in blocked)
    finally:
        pool.terminate()
        release.close()


def test_join_times_out_while_a_task_runs_then_finishes(tmp_path):
    release = targets.ReleaseFifo(tmp_path / "go")
    pool = Pool(1)
    try:
        result = pool.apply_async(targets.wait_on_fifo, (release.path,))
        pool.close()
        with pytest.raises(TimeoutError, match="did not finish within"):
            pool.join(0.2)
        release.release()
        pool.join(WAIT)
        assert isinstance(result.get(0), int)
    finally:
        pool.terminate()
        release.close()


@pytest.mark.parametrize("cls", [Pool, P2PPool])
def test_close_during_a_callback_still_lets_join_finish(cls):
    """close() while the manager thread runs a callback, with every worker idle and ready:
    no event follows, so the manager must see the close itself before it sleeps (it slept
    for good, and join() hung until terminate(), before session 25)."""
    pool = cls(2)
    try:
        deadline = time.monotonic() + WAIT
        while len(set(pool.map(targets.pid_of, range(8), chunksize=1))) < 2:  # both up, both said READY
            assert time.monotonic() < deadline, "one worker never ran a task"
        in_callback, release = threading.Event(), threading.Event()
        result = pool.apply_async(targets.square, (3,), callback=lambda _: (in_callback.set(), release.wait(WAIT)))
        assert in_callback.wait(WAIT)
        pool.close()
        release.set()
        pool.join(30)
        assert result.get(0) == 9
    finally:
        pool.terminate()


@pytest.mark.parametrize("cls", [Pool, P2PPool])
def test_an_imap_input_ending_during_a_callback_after_close_still_lets_join_finish(cls):
    """The same lost wake-up through the imap feeder: after close(), the input runs out
    (no task more) while the manager runs a callback; the feed's end must still stop the
    idle workers."""
    pool = cls(2)
    more = threading.Event()

    def source():
        yield 2
        assert more.wait(WAIT)

    try:
        deadline = time.monotonic() + WAIT
        while len(set(pool.map(targets.pid_of, range(8), chunksize=1))) < 2:  # both up, both said READY
            assert time.monotonic() < deadline, "one worker never ran a task"
        results = pool.imap(targets.square, source())
        assert next(results) == 4  # (the feeder now waits inside the input)
        in_callback, release = threading.Event(), threading.Event()
        pool.apply_async(targets.square, (3,), callback=lambda _: (in_callback.set(), release.wait(WAIT)))
        assert in_callback.wait(WAIT)
        pool.close()
        more.set()
        assert list(results) == []
        while pool._backend._flags.feeds_open:  # the feed's end is counted (the feeder thread)
            assert time.monotonic() < deadline, "the imap feed never ended"
            time.sleep(0.01)
        release.set()
        pool.join(30)
    finally:
        more.set()
        pool.terminate()


@pytest.mark.parametrize("cls", [Pool, P2PPool])
def test_no_worker_idles_while_another_has_a_backlog(cls, tmp_path):
    """One long task and many short ones queued behind it: every short task must run on
    the other worker while the long one still runs (they are taken back from its
    channel), however deep the channel is."""
    started = targets.AnnounceFifo(tmp_path / "started")
    release = targets.ReleaseFifo(tmp_path / "go")
    pool = cls(2)
    try:
        pool.map(targets.square, range(4), chunksize=1)  # both workers up
        long = pool.apply_async(targets.announce_then_wait, (started.path, release.path))
        long_pid = started.read_pid(WAIT)
        short = [pool.apply_async(targets.pid_of) for _ in range(3 * pool._window)]
        pids = [r.get(WAIT) for r in short]  # would time out if one waited behind the long task
        assert long_pid not in pids and not long.ready()
        release.release()
        assert long.get(WAIT) == long_pid
    finally:
        pool.terminate()
        started.close()
        release.close()


def _settled(read, deadline_s: float = WAIT):
    """``read()`` once it has stopped changing for 0.3 s (the manager thread pumps the
    backlog on its own: what it holds is read when it is done)."""
    end = time.monotonic() + deadline_s
    last, since = read(), time.monotonic()
    while time.monotonic() < end:
        time.sleep(0.02)
        now = read()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= 0.3:
            return now
    raise AssertionError(f"still changing after {deadline_s} s: {last}")


def test_a_pool_sends_single_calls_two_at_a_time_and_a_maps_chunks_thirty_two(tmp_path):
    """Pool's window is 2 for single calls (they start in submission order) and 32 for a
    map's chunks (at 2, imap at chunksize 64 ran at 0.42 of the standard spawn pool);
    a map submitted behind waiting calls waits behind them."""
    started = targets.AnnounceFifo(tmp_path / "started")
    release = targets.ReleaseFifo(tmp_path / "go")
    pool = Pool(1)
    try:
        engine = pool._backend
        worker, dispatch = engine._workers[0], engine._dispatch
        held = lambda: (len(worker.inflight), len(dispatch.backlog))  # noqa: E731
        assert engine.ahead() == 33  # (an imap's read-ahead, in chunks, as imap's docstring says)
        long = pool.apply_async(targets.announce_then_wait, (started.path, release.path))
        started.read_pid(WAIT)
        calls = [pool.apply_async(targets.pid_of) for _ in range(4)]
        chunks = pool.map_async(targets.square, range(50), chunksize=1)
        assert _settled(held) == (2, 3 + 50)  # the long call and the next; the rest wait in order
        release.release()
        assert long.get(WAIT) and len({c.get(WAIT) for c in calls}) == 1
        assert chunks.get(WAIT) == [k * k for k in range(50)]
        long = pool.apply_async(targets.announce_then_wait, (started.path, release.path))
        started.read_pid(WAIT)
        chunks = pool.map_async(targets.square, range(50), chunksize=1)
        assert _settled(held) == (32, 50 - 31)  # the long call and 31 chunks
        release.release()
        assert chunks.get(WAIT) == [k * k for k in range(50)] and long.get(WAIT)
    finally:
        pool.terminate()
        started.close()
        release.close()


@pytest.mark.parametrize("cls", [Pool, P2PPool])
def test_a_task_larger_than_the_pipe_runs_and_is_not_passed_between_idle_workers(cls):
    """A task whose frame takes many writes (8 MB through a 64 KB pipe) is unstarted until
    its worker has read it all. An idle worker stole it, then the first one stole it
    back, and so on for good: Pool(2).apply with a 4 MB argument hung (1,570 take-backs
    in 5 s)."""
    payload = bytes(8 << 20)
    pool = cls(2)
    try:
        pool.map(targets.square, range(4), chunksize=1)  # both workers up
        for _ in range(3):
            assert pool.apply_async(len, (payload,)).get(20) == len(payload)
        assert pool.map(len, [payload, payload[:5]], chunksize=1) == [len(payload), 5]
    finally:
        pool.terminate()


def test_a_pool_starts_safely_from_a_parent_running_torch_threads():
    torch.set_num_threads(2)
    product = torch.ones(300, 300) @ torch.ones(300, 300)  # starts torch's intra-op threads
    assert float(product[0, 0]) == 300.0
    with Pool(2) as pool:
        assert pool.map(targets.torch_work, [200, 200], chunksize=1) == [200.0 ** 3] * 2


ENDED_BY_A_SIGNAL = """
import os, signal
from machinlike.pool import Pool
if __name__ == "__main__":
    with Pool(2) as pool:
        print(pool.map(abs, [-1, -2, 3]), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
"""


def test_a_closed_pool_holds_no_semaphore_when_its_parent_is_then_ended_by_a_signal(tmp_path):
    # (trial 8: a launcher SIGTERMed after a with-Pool block printed the resource
    # tracker's "There appear to be 2 leaked semaphore objects": each worker's ledger lock,
    # held by the closed pool's handles until the process exited)
    script = tmp_path / "ended.py"
    script.write_text(ENDED_BY_A_SIGNAL)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == -15 and "[1, 2, 3]" in done.stdout, (done.returncode, done.stdout, done.stderr)
    assert "leaked semaphore" not in done.stderr, done.stderr
