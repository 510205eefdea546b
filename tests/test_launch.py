"""The local launcher and the pytest helper: results, failures, deaths and hangs."""

from __future__ import annotations

import faulthandler
import os
import re
import signal
import sys
import threading
import time

import pytest
import torch

from machinlike import launch
from machinlike.exception import NoCollectivesError, ProcessExitedError, RemoteTraceback
from machinlike.testing import run_world, world_test


class Refused(Exception):
    pass


def _rank_and_name(world, base, *, scale=1):
    return (world.rank, world.name, base * scale)


def _fail_on_rank_1_others_block(world):
    if world.rank == 1:
        raise Refused("rank 1 refuses")
    threading.Event().wait(120)  # would block for two minutes: the launcher must kill it


def _exit_on_rank_2(world, how):
    if world.rank == 2:
        if how == "os._exit":
            os._exit(3)
        if how == "abort":
            faulthandler.disable()  # (its dump of the stacks is not the test's)
            os.abort()
        os.kill(os.getpid(), signal.SIGKILL)
    threading.Event().wait(120)


def _hang(world):
    threading.Event().wait(120)


def _unpicklable(world):
    return (i for i in range(3))  # generators cannot be pickled, even by dill


def test_results_in_rank_order_with_args_and_names():
    results = launch(_rank_and_name, 3, args=(10,), kwargs={"scale": 2}, names=["a", "b", "c"], timeout=60)
    assert results == [(0, "a", 20), (1, "b", 20), (2, "c", 20)]


def test_lambdas_and_tensors_travel():
    base = torch.arange(3)
    results = launch(lambda world, t: (t + world.rank).tolist(), 2, args=(base,), timeout=60)
    assert results == [[0, 1, 2], [1, 2, 3]]


def test_first_failure_is_raised_with_remote_traceback_and_others_killed():
    start = time.monotonic()
    with pytest.raises(Refused, match="rank 1 refuses") as info:
        launch(_fail_on_rank_1_others_block, 3, timeout=100)
    assert time.monotonic() - start < 30  # not the 100 s timeout, nor the 120 s block
    cause = info.value.__cause__
    assert isinstance(cause, RemoteTraceback) and "on rank 1 ('1')" in str(cause)
    assert "_fail_on_rank_1_others_block" in str(cause)


@pytest.mark.parametrize("how, text", [
    ("os._exit", "exited with code 3: it ended without reporting a result$"),
    ("SIGKILL", "killed by signal SIGKILL \\(9\\): it ended without reporting a result$"),
    # (torch's C++ code that throws where nothing catches: TensorPipe out of descriptors)
    ("abort", "killed by signal SIGABRT \\(6\\): it ended without reporting a result \\(a C\\+\\+ abort: its "
              "message, such as TensorPipe's 'too many open files', is on the rank's standard error just before\\)"),
])
def test_rank_death_is_named(how, text):
    with pytest.raises(ProcessExitedError, match=rf"rank 2 \('2'\) \(pid \d+\) {text}") as info:
        launch(_exit_on_rank_2, 3, args=(how,), timeout=100)
    assert info.value.exitcode == {"os._exit": 3, "SIGKILL": -signal.SIGKILL, "abort": -signal.SIGABRT}[how]


def _sys_exit_on_rank_1(world, code):
    if world.rank == 1:
        if code is None:
            raise KeyboardInterrupt("raised by a library in the rank")
        sys.exit(code)
    return world.rank


def test_sys_exit_in_a_rank_is_its_outcome_never_the_launchers_exit():
    # It was re-raised in the launcher as SystemExit: the launching script ended in
    # silence with the rank's code (0: a failed job that read as success; cold trial 28).
    assert launch(_sys_exit_on_rank_1, 2, args=(0,), timeout=60) == [0, None]
    with pytest.raises(ProcessExitedError, match=r"rank 1 \('1'\) \(pid \d+\) exited with code 3: fn called "
                                                 r"sys.exit\(3\)$") as info:
        launch(_sys_exit_on_rank_1, 2, args=(3,), timeout=60)
    assert info.value.exitcode == 3 and "_sys_exit_on_rank_1" in str(info.value.__cause__)
    # A KeyboardInterrupt of the rank's code read as the launcher's own Ctrl-C, past `except Exception`.
    with pytest.raises(RuntimeError, match=r"rank 1 \('1'\): fn raised KeyboardInterrupt \(its own code did"):
        launch(_sys_exit_on_rank_1, 2, args=(None,), timeout=60)


def _hang_but_rank_0(world):
    if world.rank != 0:
        _hang(world)


def test_timeout_names_the_stuck_ranks(capfd):
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"rank 0 \('0'\), rank 1 \('1'\) did not finish within 3 s"):
        launch(_hang, 2, timeout=3)
    assert time.monotonic() - start < 20
    err = capfd.readouterr().err
    # Each rank's stacks whole, under a header naming it (they used to come interleaved).
    parts = re.split(r"===== launch: (rank \d) \('\d'\), pid \d+: still running the function; its threads: =====",
                     err)
    assert [parts[1], parts[3]] == ["rank 0", "rank 1"], err[-3000:]
    assert all("_hang" in part and part.count("Current thread") + part.count("Thread 0x") >= 1
               for part in (parts[2], parts[4])), err[-3000:]
    # A rank that returned and waits in World.stop is told apart from one still running.
    with pytest.raises(TimeoutError, match=r"launch: rank 1 \('1'\) did not finish within 8 s \(1 of 2 ranks "
                                           r"reported; rank 0 \('0'\) returned and waited in World.stop\)"):
        launch(_hang_but_rank_0, 2, timeout=8)
    assert "rank 0 ('0'), pid" in capfd.readouterr().err


def _fail_or_return(world):
    if world.rank == 0:
        raise Refused("only rank 0")
    return world.rank


def test_return_exceptions_collects_every_outcome():
    results = launch(_fail_or_return, 3, timeout=60, return_exceptions=True)
    assert isinstance(results[0], Refused) and results[1:] == [1, 2]


def test_unpicklable_result_is_a_clear_error():
    with pytest.raises(TypeError, match="rank 0 returned a result that cannot be pickled"):
        launch(_unpicklable, 1, timeout=60)


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(world_size=0), ValueError, "world_size=0 must be a positive int"),
        (dict(world_size=2, timeout=0), ValueError, "timeout=0 must be a positive"),
        (dict(world_size=2, names=["a"]), ValueError, "names has 1 entries; world_size is 2"),
        (dict(world_size=2, rank=1), TypeError, r"launch\(\) sets \['rank'\] itself"),
    ],
)
def test_launch_validates(kwargs, error, match):
    with pytest.raises(error, match=match):
        launch(_rank_and_name, **kwargs)


async def _async_body(world, offset):
    import asyncio

    group = world.create_rpc_group("aio", world.get_members())
    group.register(f"add{world.rank}", _add_in_a_coroutine)
    group.barrier()
    other = 1 - world.rank
    got = await asyncio.gather(*(group.registered_async(f"add{other}", args=(i, offset)) for i in range(4)))
    group.barrier()
    return got


async def _add_in_a_coroutine(x, y):
    return x + y


async def _async_generator_body(world):
    yield world.rank


def test_an_async_rank_function_runs_in_an_event_loop_of_its_rank():
    assert launch(_async_body, 2, args=(10,), timeout=60) == [[10, 11, 12, 13]] * 2


def test_launch_refuses_an_async_generator_before_starting_anything():
    with pytest.raises(TypeError, match=r"fn _async_generator_body is an async generator function"):
        launch(_async_generator_body, world_size=2)


def test_run_world_needs_a_timeout():
    with pytest.raises(ValueError, match="timeout=None must be a positive number"):
        run_world(_rank_and_name, 2, timeout=None)


@world_test(2, timeout=60)
@pytest.mark.parametrize("n", [1, 2])
def test_world_test_passes_parameters_and_fixtures(world, n, tmp_path):
    assert n in (1, 2) and tmp_path.is_dir()
    (tmp_path / f"rank{world.rank}").write_text(str(n))


def _rank(world):
    return world.rank


def test_the_stack_folders_are_removed_also_those_of_a_killed_launcher(tmp_path):
    import fcntl
    import shutil
    import tempfile

    orphan = tempfile.mkdtemp(prefix="machinlike-stacks-")  # a launcher SIGKILLed before its clean-up
    open(os.path.join(orphan, "launcher.lock"), "w").close()
    alive = tempfile.mkdtemp(prefix="machinlike-stacks-")  # a launcher that lives (its lock held)
    held = os.open(os.path.join(alive, "launcher.lock"), os.O_CREAT | os.O_RDWR)
    fcntl.flock(held, fcntl.LOCK_EX)
    try:
        before = set(os.listdir(tempfile.gettempdir()))
        assert launch(_rank, 2, timeout=60) == [0, 1]
        assert not os.path.exists(orphan) and os.path.exists(alive)
        # its own: removed at the end (a folder whose lock is held is a live launcher's: a
        # test running beside this one in another worker)
        def unheld(name):
            try:
                fd = os.open(os.path.join(tempfile.gettempdir(), name, "launcher.lock"), os.O_RDWR)
            except OSError:  # gone meanwhile
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                return False
            finally:
                os.close(fd)

        assert not [n for n in set(os.listdir(tempfile.gettempdir())) - before
                    if n.startswith("machinlike-stacks-") and unheld(n)]
    finally:
        os.close(held)
        shutil.rmtree(alive, ignore_errors=True)


def _kills_the_forkserver(world):
    if world.rank == 1:
        os.kill(os.getppid(), signal.SIGKILL)  # (a rank's parent is the warm forkserver: the OOM killer's pick)
    time.sleep(30)


def test_a_dead_forkserver_is_named_rather_than_a_rank_that_may_still_run():
    # Every rank's sentinel is a pipe of the forkserver: its death read as "rank 3 exited
    # with code 255", blaming a rank that was still running.
    with pytest.raises(ProcessExitedError, match=r"exited with code 255: the forkserver that started the ranks "
                                                 r"\(pid \d+\) died, so this rank's own end is unknown"):
        launch(_kills_the_forkserver, 2, timeout=60)
    assert launch(lambda world: world.rank, 2, timeout=60) == [0, 1]  # (a new server starts for the next run)


def _threads(world):
    return torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")


def test_ranks_share_the_cores_unless_omp_num_threads_is_set(monkeypatch):
    # torch's default (a thread per core in every rank) made N ranks on C cores run N*C
    # threads: a trial's learner made a twentieth of its updates.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cores = len(os.sched_getaffinity(0))
    each = max(1, cores // 3)
    assert launch(_threads, 3) == [(each, str(each))] * 3
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch(_threads, 2) == [(3, "3")] * 2


def _no_world():
    return 1


def _takes_a(world, a):
    return a


@pytest.mark.parametrize("fn, args, kwargs, match", [
    (_no_world, (), {}, r"_no_world\(\) cannot be called as fn\(world, \*args, \*\*kwargs\).*with its World first"),
    (_takes_a, (), {}, "missing a required argument: 'a'"),
    (_takes_a, (1,), {"liveness_s": 3}, r"unexpected keyword argument 'liveness_s'.*did you mean liveness=\?"),
    (_takes_a, (1,), {"name": "x"}, r"launch\(\) sets \['name'\] itself"),
])
def test_launch_refuses_what_no_rank_could_run_before_starting_any(fn, args, kwargs, match):
    started = time.monotonic()
    with pytest.raises(TypeError, match=match):
        launch(fn, 2, args=args, **kwargs)
    assert time.monotonic() - started < 1.0  # (no rank was started)


@pytest.mark.parametrize("kwargs, error, match", [
    # (trial 10: the first two were said by every rank, as "timeout", and launch returned;
    # the third raised a bare TypeError from a comparison; the last two came after ~4 s)
    ({"stop_timeout": -1}, ValueError, "stop_timeout=-1 must be a positive number of seconds"),
    ({"stop_timeout": "5"}, TypeError, "stop_timeout='5' must be a number of seconds"),
    ({"return_exceptions": "x"}, TypeError, r"return_exceptions must be a bool \(True or False\), not str"),
    ({"rpc_timeout": -5}, ValueError, "rpc_timeout=-5 must be a positive number of seconds"),
    ({"names": ["a", "a"]}, ValueError, r"holds \['a'\] more than once: each rank needs its own member name"),
    ({"names": ["a", "b c"]}, ValueError, r"names\[1\]='b c' is not a valid member name"),
    ({"names": "ab"}, TypeError, "must be a sequence of names, one per rank, not one str"),
])
def test_launch_refuses_bad_settings_before_starting_any_rank(kwargs, error, match):
    started = time.monotonic()
    with pytest.raises(error, match=match):
        launch(_takes_a, 2, args=(1,), **kwargs)
    assert time.monotonic() - started < 1.0  # (no rank was started)


def _makes_a_collective_group(world):
    return world.create_collective_group([0, 1])


@pytest.mark.timeout(60)
def test_a_collective_group_refused_by_a_restartable_world_ends_the_run_without_restarts(caplog):
    # (trial 10: max_restarts=2 added to a static trainer restarted every rank twice into
    # secondary errors; launch raised one of those after 64 s, the cause only in the logs)
    with caplog.at_level("WARNING", logger="machinlike"):
        with pytest.raises(NoCollectivesError, match=r"elastic .*launch\(max_restarts=\.\.\.\) makes its ranks"):
            launch(_makes_a_collective_group, 2, max_restarts=2)
    assert not [r for r in caplog.records if "restarting rank" in r.getMessage()], caplog.text


def test_a_ranks_dump_shows_the_main_thread_first_and_the_librarys_threads_in_a_line_each():
    # (trial 8: about 110 lines of machinlike's own threads per rank, the user's frame
    # somewhere among them)
    import os
    import threading as _threading

    from machinlike.distributed._launch.stacks import condense

    lib = os.path.dirname(os.path.abspath(__import__("machinlike").__file__))
    boot = f'  File "{_threading.__file__}", line 1002 in _bootstrap'
    dump = "\n\n".join([
        f'Thread 0x01 (most recent call first):\n  File "{lib}/distributed/_membership/bell.py", line 361 in _serve\n'
        f'  File "{lib}/distributed/_membership/bell.py", line 330 in _run\n{boot}',
        f'Thread 0x02 (most recent call first):\n  File "/home/me/train.py", line 40 in loader\n{boot}',
        'Current thread 0x03 (most recent call first):\n  File "/home/me/train.py", line 12 in rank_body\n'
        '  File "<string>", line 16 in <module>',
    ])
    out = condense(dump)
    assert out.index("Current thread 0x03") < out.index("Thread 0x02 (most") < out.index("1 thread of machinlike")
    assert "Thread 0x01: _serve (bell.py:361), its loop _run (bell.py)" in out
    assert "train.py\", line 40 in loader" in out and "line 330 in _run" not in out
