"""machinlike.process / machinlike.thread: how a child ended, cleaners, lambdas, lifelines."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
import traceback

import pytest
import toolkit_targets as targets
import torch
from proc_util import wait_for_exit

from machinlike._lifeline import PARENT_DIED_EXITCODE, THREAD_NAME
from machinlike.exception import ProcessExitedError, RemoteTraceback
from machinlike.process import Process, ProcessException
from machinlike.queue import SimpleQueue
from machinlike.thread import Thread, ThreadException

WAIT = 30.0


def own_type(error, mixin=ProcessException):
    """The child's exception type behind the ``mixin`` subclass that reports it."""
    assert isinstance(error, mixin), f"{error!r} is not catchable as {mixin.__name__}"
    return type(error).__mro__[1]


def run(target, *args, **kwargs):
    p = Process(target=target, args=args, **kwargs)
    p.start()
    p.join(WAIT)
    assert p.exitcode is not None, f"{p.name} did not end"
    return p


# ---------------------------------------------------------------- how a child ended

CRASHES = [
    # (target, args, expected type, exit code, text in str(error), text in the cause or None)
    (targets.raise_value_error, (), ValueError, 1, "boom from the child", "raise_value_error"),
    (targets.exit_with, (3,), ProcessExitedError, 3, "the target called sys.exit(3)", "exit_with"),
    (targets.exit_with, ("bye",), ProcessExitedError, 1, "sys.exit('bye')", "exit_with"),
    (targets.hard_exit, (5,), ProcessExitedError, 5, "exited with code 5", None),
    (targets.kill_self, (), ProcessExitedError, -signal.SIGKILL, "killed by signal SIGKILL (9)", None),
    (targets.segfault, (), ProcessExitedError, -signal.SIGSEGV, "killed by signal SIGSEGV (11)", None),
]


@pytest.mark.parametrize(
    "target, args, kind, exitcode, text, cause",
    CRASHES,
    ids=["exception", "sys.exit", "sys.exit-str", "os._exit", "SIGKILL", "segfault"],
)
def test_each_way_of_failing_is_reported_distinctly(target, args, kind, exitcode, text, cause):
    p = run(target, *args)
    assert p.exitcode == exitcode
    error = p.exception
    assert own_type(error) is kind and text in str(error)
    if cause is None:
        assert error.__cause__ is None
    else:
        assert isinstance(error.__cause__, RemoteTraceback)
        assert cause in str(error.__cause__) and f"on process {p.name!r}, pid {p.pid}" in str(error.__cause__)
    if isinstance(error, ProcessExitedError):
        assert error.exitcode == exitcode and error.pid == p.pid
    with pytest.raises(kind) as raised:
        p.watch()
    assert raised.value is error
    assert p.exception is error, "the outcome is settled once the child ended"
    p.close()
    assert p.exception is error, "and survives close()"


@pytest.mark.parametrize("code", [None, 0])
def test_success_and_clean_exit_report_nothing(code):
    p = run(targets.noop) if code is None else run(targets.exit_with, code)
    assert p.exitcode == 0 and p.exception is None
    p.watch()  # no-op


def test_exception_does_not_block_while_the_child_runs():
    release = SimpleQueue()
    p = Process(target=targets.wait_for_release, args=(release,))
    p.start()
    begin = time.monotonic()
    assert p.exception is None
    p.watch()
    assert time.monotonic() - begin < 1.0
    release.put("go")
    p.join(WAIT)
    assert p.exitcode == 0 and p.exception is None


def test_a_report_larger_than_the_pipe_buffer_does_not_deadlock_join():
    p = run(targets.raise_value_error, "x" * 300_000)
    assert own_type(p.exception) is ValueError and len(str(p.exception)) == 300_000


@pytest.mark.parametrize("size", [300_000, 3_000_000])
def test_a_child_with_a_large_report_ends_before_anyone_reads_it(size):
    # Cold trial 30: the child blocked writing a report larger than the pipe's buffer until
    # join() or exception read it, so is_alive() stayed True and its sentinel never fired.
    from multiprocessing import connection

    p = Process(target=targets.raise_value_error, args=("x" * size,))
    p.start()
    assert connection.wait([p.sentinel], WAIT), "the child did not end while nobody read its report"
    p.join(WAIT)
    assert own_type(p.exception).__name__ in ("ValueError", "RemoteError") and isinstance(p.exception, ValueError)
    said = str(p.exception)
    if size < 1 << 20:  # the pipe was enlarged for it: all of it came
        assert len(said) == size
    else:  # a stand-in: the type's name, the message's start, what was left out
        assert said.startswith("ValueError: xxx") and len(said) < 6000, said[-300:]
        assert "did not fit its pipe" in said and "without its attributes" in said
        assert "raise_value_error" in str(p.exception.__cause__)


def test_exception_and_watch_before_start():
    p = Process(target=targets.noop)
    assert p.exception is None
    p.watch()
    with pytest.raises(ValueError, match="started"):
        p.join(1)


# ---------------------------------------------------------------- cleaner, targets, arguments


@pytest.mark.parametrize("fail", [False, True], ids=["target-succeeds", "target-raises"])
def test_cleaner_runs_after_the_target(fail):
    flags = torch.zeros(2)
    target = targets.raise_value_error if fail else targets.set_index
    args = () if fail else (flags, 0)
    cleaner = targets.closure_over(flags[1:])  # a closure over a shared tensor view
    p = run(target, *args, cleaner=cleaner)
    assert flags[1] == 1, "the cleaner must run"
    if fail:
        assert own_type(p.exception) is ValueError
    else:
        assert flags[0] == 1 and p.exception is None


@pytest.mark.parametrize("fail", [False, True])
def test_subclass_overriding_run_keeps_reporting_and_cleaner(fail):
    t, flags = torch.zeros(1), torch.zeros(1)
    p = targets.WorkerWithRun(t, fail, cleaner=targets.closure_over(flags))
    p.start()
    p.join(WAIT)
    assert t.item() == 1 and flags.item() == 1
    assert (own_type(p.exception) is KeyError) if fail else (p.exception is None)


def test_failing_cleaner_is_reported():
    p = run(targets.noop, cleaner=targets.raise_value_error)
    assert own_type(p.exception) is ValueError


def test_lambda_target_and_shared_tensor_arguments():
    t = torch.zeros(3)
    p = run(targets.adder_lambda(), t, 2)
    assert p.exception is None and torch.equal(t, torch.full((3,), 2.0))
    scale = 3
    p = run(lambda x: x.add_(scale), t)  # defined here: by value, closing over a local
    assert p.exception is None and torch.equal(t, torch.full((3,), 5.0))


def test_child_output_goes_to_the_parents_current_stdout(capfd):
    # A child forked by the warm server must write where its parent writes now, not
    # where the parent wrote when the server started: start it (if it is not running
    # yet) while fd 1 points elsewhere.
    saved = os.dup(1)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 1)
        try:
            warmup = Process(target=lambda: None)
            warmup.start()
            warmup.join(WAIT)
        finally:
            os.dup2(saved, 1)
            os.close(saved)
    capfd.readouterr()
    p = Process(target=lambda: print("hello from the child", flush=True))
    p.start()
    p.join(WAIT)
    assert p.exitcode == 0
    assert "hello from the child" in capfd.readouterr().out


def test_a_large_numpy_argument_leaves_no_shared_memory_behind():
    # Arguments travel in share mode: a large array is copied once into named shared
    # memory. The child ends with os._exit, past every finalizer, so unless it lets go of
    # its arguments first the segment outlived both processes (until torch's manager exited).
    import pathlib

    import numpy as np

    def ours():
        return {p.name for p in pathlib.Path("/dev/shm").glob(f"torch_{os.getpid()}_*") if p.stat().st_size > 1 << 20}

    before = ours()
    queue = SimpleQueue()
    try:
        for _ in range(3):
            p = Process(target=targets.sum_into, args=(np.ones((1024, 1024)), queue))
            p.start()
            p.join(60)
            p.watch()
            assert queue.get(timeout=60) == 1024.0 * 1024
    finally:
        queue.close()
    assert ours() - before == set()


def test_lambda_target_under_spawn():
    t = torch.zeros(1)
    p = run(targets.closure_over(t), ctx="spawn")
    assert p.exception is None and t.item() == 1


async def _coroutine():
    pass


def test_argument_validation():
    with pytest.raises(TypeError, match="target must be callable"):
        Process(target=3)
    with pytest.raises(TypeError, match="target _coroutine is an async function: it would run in the child process"):
        Process(target=_coroutine)
    with pytest.raises(TypeError, match="cleaner must be callable"):
        Process(target=targets.noop, cleaner="no")
    with pytest.raises(ValueError, match="group must be None"):
        Process(group="g")
    with pytest.raises(TypeError, match="kwargs must be a mapping"):
        Process(target=targets.noop, kwargs=[1])
    with pytest.raises(TypeError, match="args must be an iterable"):
        Process(target=targets.noop, args=3)
    with pytest.raises(ValueError, match="not a start method"):
        Process(target=targets.noop, ctx="nope")
    with pytest.raises(TypeError, match="ctx must be"):
        Process(target=targets.noop, ctx=3)


# ---------------------------------------------------------------- lifeline


@pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs pidfd_open (Linux >= 5.3)")
def test_daemon_child_ends_when_its_parent_dies():
    report, go = SimpleQueue(), SimpleQueue()
    parent = Process(target=targets.start_daemon_grandchild_then_die, args=(report, go))
    parent.start()
    grandchild_pid, thread_names = report.get(WAIT)
    try:
        assert THREAD_NAME in thread_names
        go.put("die")
        parent.join(WAIT)
        assert parent.exitcode == 0
        assert wait_for_exit(grandchild_pid, 10.0), "the daemon grandchild outlived its parent"
    finally:
        try:
            os.kill(grandchild_pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert PARENT_DIED_EXITCODE != 0


# ---------------------------------------------------------------- threads


def test_thread_exception_keeps_type_and_its_own_traceback():
    def fail():
        raise KeyError("missing")

    cleaned = []
    t = Thread(target=fail, cleaner=lambda: cleaned.append(True))
    assert t.name.startswith("machinlike-thread-")
    t.start()
    t.join(WAIT)
    assert cleaned == [True]
    error = t.exception
    assert own_type(error, ThreadException) is KeyError and error.args == ("missing",)
    frames = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
    assert "fail" in frames
    with pytest.raises(KeyError):
        t.watch()
    with pytest.raises(ThreadException):  # machin's name catches it too
        t.watch()
    assert own_type(pickle.loads(pickle.dumps(error)), ThreadException) is KeyError  # (tagged again when loaded)


def test_thread_success_exit_and_cleaner_failure():
    t = Thread(target=sys.exit, args=(0,))
    t.start()
    t.join(WAIT)
    assert t.exception is None
    t = Thread(target=sys.exit, args=(4,))
    t.start()
    t.join(WAIT)
    # (cold trial 30: watch() re-raised the SystemExit, which ended the program silently)
    assert type(t.exception) is ThreadException and "its target called sys.exit(4)" in str(t.exception)
    assert type(t.exception.__cause__) is SystemExit and t.exception.__cause__.code == 4
    done = threading.Event()
    t = Thread(target=done.set, cleaner=targets.raise_value_error)
    t.start()
    t.join(WAIT)
    assert done.is_set() and own_type(t.exception, ThreadException) is ValueError


def test_thread_target_and_cleaner_both_fail():
    def broken_cleaner():
        raise TypeError("cleaner broke")

    t = Thread(target=targets.raise_value_error, cleaner=broken_cleaner)
    t.start()
    t.join(WAIT)
    error = t.exception
    assert own_type(error, ThreadException) is ValueError
    if sys.version_info >= (3, 11):
        assert any("cleaner raised as well: TypeError" in note for note in error.__notes__)


def test_thread_argument_validation():
    with pytest.raises(TypeError, match="target must be callable"):
        Thread(target=1)
    with pytest.raises(TypeError, match="target _coroutine is an async function: it would run on the thread"):
        Thread(target=_coroutine)
    with pytest.raises(ValueError, match="group must be None"):
        Thread(group=1)


def test_public_names():
    import machinlike._lifeline as lifeline
    import machinlike.process as process
    import machinlike.thread as thread

    assert process.__all__ == ["Process", "ProcessException"] and thread.__all__ == ["Thread", "ThreadException"]
    assert callable(lifeline.watch_parent) and lifeline.THREAD_NAME.startswith("machinlike")


# ---------------------------------------------------------------- machin's ProcessException


def test_failure_is_catchable_as_process_exception_and_keeps_its_type():
    p = run(targets.raise_value_error)
    error = p.exception
    assert isinstance(error, ValueError) and isinstance(error, ProcessException)
    assert type(error).__name__ == "ValueError" and "boom from the child" in str(error)
    with pytest.raises(ProcessException):  # machin code
        p.watch()
    with pytest.raises(ValueError):  # code that catches the child's own type
        p.watch()
    again = run(targets.raise_value_error).exception
    assert type(again) is type(error), "one subclass per original type"
    loaded = pickle.loads(pickle.dumps(error))  # pickles as the plain type, tagged again
    assert type(loaded) is type(error) and str(loaded) == str(error)
    exited = run(targets.hard_exit, 5).exception
    assert isinstance(exited, ProcessExitedError) and isinstance(exited, ProcessException)
    assert exited.exitcode == 5 and pickle.loads(pickle.dumps(exited)).exitcode == 5


def test_a_childs_exception_holding_a_cuda_tensor_arrives_with_a_cpu_copy():
    """As a pool worker's: read in the parent, the report must not make a CUDA context
    (with no GPU there, the child's exception was lost to a loading error)."""
    import pool_targets

    error = run(pool_targets.raise_holding_a_cuda_tensor).exception
    assert isinstance(error, ValueError) and error.args[0] == "a bad batch"
    assert error.args[1].device.type == "cpu" and torch.equal(error.args[1], torch.arange(3.0))


def test_unsubclassable_exception_type_is_reported_unchanged():
    from machinlike.process import tag_process_exception

    class Final(Exception):
        def __init_subclass__(cls, **kwargs):
            raise TypeError("no subclasses")

    error = Final("x")
    assert tag_process_exception(error) is error
