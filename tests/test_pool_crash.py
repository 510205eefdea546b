"""Pool crash matrix: every way a task can take its worker down, in every phase.

Documented post-crash state: the pool keeps serving. The affected task fails with its
own exception (remote traceback as cause) or with WorkerLostError naming the exit code or
signal and the phase; the other tasks complete; a replacement worker takes the slot.
"""

from __future__ import annotations

import os
import signal
import threading
import types

import pool_targets as targets
import pytest

from machinlike.exception import RemoteTraceback, WorkerLostError
from machinlike.pool import BrokenPoolError, Pool, P2PPool, PoolTerminatedError

WAIT = 60.0

# kind -> (error type, text in str(error), remote traceback chained, worker dies)
KINDS = {
    "exception": (ValueError, "crash marker: exception", True, False),
    "sys.exit": (WorkerLostError, "exited with code 3: sys.exit(3) was called", True, True),
    "os._exit": (WorkerLostError, "exited with code 5", False, True),
    "segfault": (WorkerLostError, "killed by signal SIGSEGV (11)", False, True),
    "sigkill": (WorkerLostError, "killed by signal SIGKILL (9)", False, True),
}
# phase -> (WorkerLostError text, note on the original exception)
PHASES = {
    "unpickle": ("while loading its task", "while loading the task in the worker"),
    "run": ("while running its task", None),
    "pickle": ("while pickling its task's result", "while pickling the result in the worker"),
}


def _submit(pool, phase, kind, fifo):
    if phase == "unpickle":
        return pool.apply_async(targets.take_anything, (targets.CrashOnLoad(kind, fifo),))
    if phase == "run":
        return pool.apply_async(targets.crash, (kind, fifo))
    return pool.apply_async(targets.return_crash_on_dump, (kind, fifo))


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize("kind", list(KINDS))
def test_crash_matrix(kind, phase, tmp_path):
    kind_error, text, remote, dies = KINDS[kind]
    phase_text, note = PHASES[phase]
    announce = targets.AnnounceFifo(tmp_path / "pid")
    pool = Pool(1)  # one worker: whatever runs after a death runs on its replacement
    try:
        first_pid = pool.apply(targets.pid_of)
        doomed = _submit(pool, phase, kind, announce.path)
        bystanders = [pool.apply_async(targets.square, (i,)) for i in range(8)]
        if kind == "sigkill":  # from outside, while the worker is in that phase
            os.kill(announce.read_pid(WAIT), signal.SIGKILL)
        with pytest.raises(kind_error) as raised:
            doomed.get(WAIT)
        error = raised.value
        assert text in str(error)
        if remote:
            assert isinstance(error.__cause__, RemoteTraceback)
            assert "on pool worker" in str(error.__cause__)
        if isinstance(error, WorkerLostError):
            assert phase_text in str(error)
            assert error.pid == first_pid and error.name == "pool worker 0"
            assert error.exitcode == {"sys.exit": 3, "os._exit": 5, "segfault": -signal.SIGSEGV,
                                      "sigkill": -signal.SIGKILL}[kind]
        elif note is not None:
            assert note in error.__notes__
        # the pool keeps serving: bystanders (queued behind the crash) finish, new work runs
        assert [r.get(WAIT) for r in bystanders] == [i * i for i in range(8)]
        assert pool.map(targets.square, range(20), chunksize=3) == [i * i for i in range(20)]
        assert (pool.apply(targets.pid_of) != first_pid) == dies  # on a replacement iff it died
        pool.close()
        pool.join(WAIT)
        assert pool._backend.replaced == (1 if dies else 0)
    finally:
        pool.terminate()
        announce.close()


def test_unpicklable_argument_fails_its_task_only():
    with Pool(2) as pool:
        result = pool.apply_async(targets.take_anything, (targets.Unpicklable(),))
        with pytest.raises(TypeError, match="refuse to be pickled"):
            result.get(WAIT)
        with pytest.raises(TypeError, match="refuse to be pickled"):
            pool.map(targets.identity, [1, targets.Unpicklable(), 3], chunksize=1)
        errors = []
        pool.apply_async(targets.take_anything, (targets.Unpicklable(),), error_callback=errors.append).wait(WAIT)
        assert len(errors) == 1 and isinstance(errors[0], TypeError)
        assert pool.map(targets.square, range(5)) == [0, 1, 4, 9, 16]
        assert pool._backend.replaced == 0


def test_unpicklable_result_fails_its_task_only():
    with Pool(2) as pool:
        with pytest.raises(TypeError, match="generator") as raised:
            pool.apply(targets.make_generator)
        assert "while pickling the result in the worker" in raised.value.__notes__
        assert isinstance(raised.value.__cause__, RemoteTraceback)
        # in a chunk, only the item whose result cannot travel fails
        results = []
        for item in _drain(pool.imap(targets.generator_at, range(5), chunksize=5)):
            results.append(item if not isinstance(item, BaseException) else type(item))
        assert results == [0, 1, TypeError, 3, 4]
        assert pool.apply(targets.square, (3,)) == 9
        assert pool._backend.replaced == 0


def _drain(iterator):
    while True:
        try:
            yield iterator.next(WAIT)
        except StopIteration:
            return
        except Exception as exc:
            yield exc


def test_exception_in_a_chunk_fails_only_its_item_in_imap_and_the_map():
    with Pool(2) as pool:
        items = list(_drain(pool.imap(targets.fail_on_three, range(6), chunksize=4)))
        assert [type(x) if isinstance(x, BaseException) else x for x in items] == [0, 1, 2, ValueError, 4, 5]
        with pytest.raises(ValueError, match="three"):
            pool.map(targets.fail_on_three, range(6), chunksize=2)


@pytest.mark.parametrize("cls", [Pool, P2PPool])
def test_maxtasksperchild_recycles_under_load(cls):
    pool = cls(2, maxtasksperchild=3)
    try:
        pids = pool.map(targets.pid_of, range(60), chunksize=1)
        assert len(pids) == 60
        assert len(set(pids)) >= 60 // 3  # no worker ran more than 3 tasks
        assert max(pids.count(pid) for pid in set(pids)) <= 3
        results = [pool.apply_async(targets.square, (i,)) for i in range(30)]
        assert [r.get(WAIT) for r in results] == [i * i for i in range(30)]
        pool.close()
        pool.join(WAIT)
        assert pool._backend.replaced >= 60 // 3
    finally:
        pool.terminate()


def test_a_dead_worker_gives_back_the_tasks_it_had_not_started(tmp_path):
    # P2PPool queues many tasks per worker: killing one must lose only its running task
    announce = targets.AnnounceFifo(tmp_path / "pid")
    pool = P2PPool(2)
    try:
        doomed = pool.apply_async(targets.crash, ("sigkill", announce.path))
        queued = [pool.apply_async(targets.square, (i,)) for i in range(200)]
        os.kill(announce.read_pid(WAIT), signal.SIGKILL)
        with pytest.raises(WorkerLostError, match="SIGKILL"):
            doomed.get(WAIT)
        assert [r.get(WAIT) for r in queued] == [i * i for i in range(200)]
    finally:
        pool.terminate()
        announce.close()


def test_a_dead_forkserver_is_named_by_the_tasks_it_ended_and_the_pool_goes_on(tmp_path, capfd):
    # Its death ends the workers it forked: they said "parent process <the pool's owner>
    # is gone", of an owner alive and well, and the task failed with a bare exit code 255
    # (cold trial 27).
    announce = targets.AnnounceFifo(tmp_path / "pid")
    with Pool(1) as pool:
        running = pool.apply_async(targets.crash, ("sigkill", announce.path))  # (announces, then blocks)
        worker = announce.read_pid(WAIT)
        with open(f"/proc/{worker}/stat") as stream:
            server = int(stream.read().rsplit(")", 1)[1].split()[1])
        os.kill(server, signal.SIGKILL)
        with pytest.raises(WorkerLostError, match=rf"the warm forkserver that started it \(pid {server}\) died"):
            running.get(WAIT)
        assert pool.map(targets.square, range(4)) == [0, 1, 4, 9]  # (a new server starts the replacement)
    announce.close()
    assert f"the process server that started process {worker} (pid {server}) died" in capfd.readouterr().err


def test_failing_initializer_breaks_the_pool():
    pool = Pool(2, initializer=targets.failing_initializer)
    try:
        with pytest.raises(BrokenPoolError) as raised:  # raised by get(), or by apply_async once broken
            pool.apply_async(targets.square, (2,)).get(WAIT)
        cause = raised.value.__cause__
        assert isinstance(cause, KeyError) and "on purpose" in str(cause)
        assert isinstance(cause.__cause__, RemoteTraceback)
        with pytest.raises(BrokenPoolError):
            pool.apply_async(targets.square, (2,))
        pool.close()
        pool.join(WAIT)
    finally:
        pool.terminate()


def test_terminate_fails_pending_results_and_leaves_no_worker(tmp_path):
    release = targets.ReleaseFifo(tmp_path / "go")
    pool = Pool(2)
    try:
        running = [pool.apply_async(targets.wait_on_fifo, (release.path,)) for _ in range(2)]
        queued = pool.map_async(targets.square, range(10))
        lazy = pool.imap(targets.square, iter(range(10 ** 9)))
        processes = [w.process for w in pool._backend._workers]
        pool.terminate()
        for result in running + [queued]:
            with pytest.raises(PoolTerminatedError):
                result.get(WAIT)
        with pytest.raises(PoolTerminatedError):
            for _ in range(10 ** 6):
                lazy.next(WAIT)
        assert all(p._closed or p.exitcode is not None for p in processes)
        pool.join(WAIT)
        with pytest.raises(ValueError, match="not running"):
            pool.apply_async(targets.square, (1,))
    finally:
        pool.terminate()
        release.close()


_BAD_CALLBACKS = """
from machinlike.pool import Pool, ThreadPool
def sq(x):
    return x * x
if __name__ == "__main__":
    for P in (Pool, ThreadPool):
        with P(2) as pool:
            for i in range(3):
                r = pool.apply_async(sq, (i,), callback=lambda v: 1 / 0)
                assert r.get(10) == i * i and r.ready()
            assert pool.map_async(sq, [1, 2], callback=lambda v: 1 / 0).get(10) == [1, 4]
            e = pool.apply_async(int, ("x",), error_callback=lambda e: 1 / 0)
            try:
                e.get(10)
            except ValueError:
                pass
            assert pool.map(sq, range(4)) == [0, 1, 4, 9]  # (a thread pool's workers all live)
        print(P.__name__, "ok", flush=True)
"""


def test_callback_errors_under_pythons_own_unraisablehook_settle_and_are_printed(tmp_path):
    # Cold trial 26: Python's hook refused the record (TypeError): the result never became
    # ready (get() without a timeout waited for good) and a ThreadPool's worker thread died.
    import subprocess
    import sys

    script = tmp_path / "bad_callbacks.py"
    script.write_text(_BAD_CALLBACKS)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Pool", "ok", "ThreadPool", "ok"], done.stdout
    assert done.stderr.count("Exception ignored in a pool result callback") == 10, done.stderr
    assert "ZeroDivisionError" in done.stderr and "UnraisableHookArgs" not in done.stderr


def test_callback_errors_are_reported_and_do_not_stop_the_pool(monkeypatch):
    reported = []
    monkeypatch.setattr("sys.unraisablehook", reported.append)

    def bad_callback(value):
        raise RuntimeError(f"callback saw {value}")

    with Pool(1) as pool:
        first = pool.apply_async(targets.square, (3,), callback=bad_callback)
        assert first.get(WAIT) == 9
        assert pool.apply(targets.square, (4,)) == 16
    assert len(reported) == 1 and "callback saw 9" in str(reported[0].exc_value)


def test_announce_fifo_reads_through_wake_ups_without_data(tmp_path, monkeypatch):
    """select() said readable, read() said EAGAIN (a flake of test_crash_matrix): a writer
    that came and went leaves the FIFO at end of file, and one that opens right after the
    select makes the read find a writer and no data. Both must mean "wait on"."""
    announce = targets.AnnounceFifo(tmp_path / "pid")
    writer = []
    real_select = targets.select.select

    def select_then_a_writer_opens(*args):
        ready = real_select(*args)
        if not writer:  # between this select and the read, as under load
            writer.append(os.open(announce.path, os.O_WRONLY | os.O_NONBLOCK))
            threading.Timer(0.2, lambda: (os.write(writer[0], b"4242"), os.close(writer[0]))).start()
        return ready

    try:
        os.close(os.open(announce.path, os.O_WRONLY | os.O_NONBLOCK))  # came and went: end of file
        assert real_select([announce._fd], [], [], 0)[0], "the FIFO should poll readable at end of file"
        # only pool_targets' own view of select: nothing else in the process is touched
        monkeypatch.setattr(targets, "select", types.SimpleNamespace(select=select_then_a_writer_opens))
        assert announce.read_pid(10) == 4242
        assert writer, "the test did not provoke the race"
    finally:
        announce.close()
