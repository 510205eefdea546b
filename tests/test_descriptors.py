"""Open files (``machinlike._descriptors``): a World, a launch and a process pool raise
their process's soft limit, so that many members or workers start under a low one, and
one that may not open what they need says so with the fix.

Each runs in a fresh interpreter whose limits are set before it starts (``preexec_fn``):
the suite's own processes keep theirs.
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from machinlike import _descriptors
from proc_util import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SOFT, _HARD = resource.getrlimit(resource.RLIMIT_NOFILE)


def _limited(soft: int, hard: int):
    """A ``preexec_fn`` that sets the child's limits of open files before it starts."""
    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))

    return limit


def _run(code: str, soft: int, hard: int, timeout: float) -> subprocess.CompletedProcess:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, preexec_fn=_limited(soft, hard),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        raise AssertionError(f"overstayed {timeout} s:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _said(code: str, soft: int, hard: int, text: str, timeout: float) -> str:
    """Run ``code`` under those limits until its stderr has said ``text`` (then kill it:
    what follows is not the test's); its stderr so far, on one line."""
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT, preexec_fn=_limited(soft, hard),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    seen: list = []
    timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
    timer.start()
    try:
        assert proc.stderr is not None
        for line in proc.stderr:
            seen.append(line)
            if text in " ".join("".join(seen).split()):
                break
    finally:
        timer.cancel()
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)
    return " ".join("".join(seen).split())



def _hard_at_least(n: int) -> None:
    if _HARD != resource.RLIM_INFINITY and _HARD < n:
        pytest.skip(f"this machine's hard limit of open files is {_HARD}, under the {n} this test needs")


def test_a_world_raises_the_soft_limit_up_to_the_hard_one():
    _hard_at_least(4096)
    result = _run("""
        import resource, machinlike
        with machinlike.World(name="a", rank=0, world_size=1, init_method="tcp://127.0.0.1:0"):
            print("soft", resource.getrlimit(resource.RLIMIT_NOFILE)[0])
    """, 256, 4096, 120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "soft 4096" in result.stdout
    assert "ulimit" not in result.stderr  # a World of one needs far fewer: nothing said


def test_raise_limit_stops_at_its_target_and_never_lowers():
    _hard_at_least(8000)
    result = _run("""
        import resource
        from machinlike import _descriptors
        print("first", _descriptors.raise_limit(4000))  # 1,000 -> the target, under the hard limit
        resource.setrlimit(resource.RLIMIT_NOFILE, (8000, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        print("second", _descriptors.raise_limit(4000))  # above the target already: kept
        print("third", _descriptors.raise_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[1])
    """, 1000, _HARD, 60)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "first 4000" in result.stdout and "second 8000" in result.stdout
    third = result.stdout.split("third ")[1].split()
    hard = int(third[1])
    assert int(third[0]) == (_descriptors.TARGET if hard == resource.RLIM_INFINITY else min(hard, _descriptors.TARGET))


def test_fourteen_ranks_calling_rank_0_survive_a_soft_limit_of_160():
    # Without the raises, launch()'s process (about 190 descriptors: it hosts the store)
    # and rank 0 (about 260 with fourteen members calling it) run out: the store's
    # connections break, or rank 0's RPC agent aborts it or fails its calls.
    _hard_at_least(1024)
    result = _run("""
        import machinlike

        def member(world):
            group = world.create_rpc_group("g", world.get_members())
            group.register("f" + world.name, lambda: world.name)
            group.barrier()
            if world.name == "0":  # the store's host calls every member, so each has a pipe to it
                assert [group.registered_sync("f" + m) for m in world.get_members()] == world.get_members()
            group.barrier()
            return world.name

        if __name__ == "__main__":
            print("done", machinlike.launch(member, 14, timeout=120))
    """, 160, _HARD, 150)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"done {[str(r) for r in range(14)]}" in result.stdout


def test_a_store_host_that_may_not_open_enough_says_so_with_the_fix():
    text = ("World '0': this process may open 256 files (ulimit -n; hard limit 256) and 64 members need about 1480 "
            "here (200 to start, about 20 a member: it hosts the store")
    err = _said(f"""
        import machinlike
        machinlike.World(name="0", rank=0, world_size=64, init_method="tcp://127.0.0.1:{free_port()}")
    """, 256, 256, text, 60)
    assert text in err, err[-3000:]
    assert "SIGABRT" in err and "LimitNOFILE=" in err


def test_a_launch_whose_ranks_need_more_than_the_hard_limit_is_refused_before_any_starts():
    # 10 ranks need about 140 descriptors in launch()'s own process, where at most 100 may
    # be opened: such a job cannot run, so nothing starts (a launch of 10**6 ranks warned,
    # then started hundreds, each warning, until killed minutes on: cold trial 20).
    text = ("ValueError: world_size=10: 10 ranks need about 140 open files in this process (20 to start, about 12 a "
            "rank: it hosts their store), and it may open at most 100 (the hard limit, ulimit -Hn). Fix: fewer ranks")
    err = _said("""
        import machinlike
        if __name__ == "__main__":
            machinlike.launch(lambda world: None, 10, timeout=30)
    """, 100, 100, text, 60)
    assert text in err, err[-3000:]


def test_a_pool_too_large_for_the_hard_limit_is_refused_before_any_worker_starts():
    import resource

    from machinlike.pool import Pool

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        pytest.skip("no hard limit on open files here")
    start = time.monotonic()
    with pytest.raises(ValueError, match=r"processes=\d[\d,]*: \d[\d,]* workers need about .* open files in this "
                                         r"process .*Fix: fewer workers, or raise the hard limit"):
        Pool(hard)  # (it ran for minutes and leaked thousands of semaphores)
    assert time.monotonic() - start < 5


def test_a_pool_of_sixty_workers_starts_under_a_soft_limit_of_200():
    # Its owner keeps about 4 descriptors a worker: without the raise, starting the
    # workers fails ("OSError: [Errno 24] Too many open files").
    _hard_at_least(1024)
    result = _run("""
        from machinlike.pool import Pool
        if __name__ == "__main__":
            with Pool(60) as pool:
                print("sum", sum(pool.map(lambda x: x, range(120))))
    """, 200, _HARD, 120)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "sum 7140" in result.stdout


def _comm(task: str) -> str:
    try:
        with open(f"/proc/self/task/{task}/comm") as f:
            return f.read().strip()
    except (FileNotFoundError, ProcessLookupError):
        # A short-lived thread (a store connection's) ended meanwhile: before the open
        # (no such file), or between the open and the read (ESRCH, once in CI at -n 3).
        return ""


def _threads_and_descriptors(world):
    loops = sum(1 for task in os.listdir("/proc/self/task") if _comm(task) == "TP_UV_loop")
    return loops, len(os.listdir("/proc/self/fd"))


def test_a_static_world_on_one_host_keeps_no_multi_lane_channel():
    # torch's default channel list adds mpt_uv, whose lanes carried nothing on one host
    # (cma outranks it; the lane and shared memory carry the calls) and cost each process
    # 16 event-loop threads and about 110 descriptors (155 at rank 1 of 4, now about 45).
    from machinlike import launch

    for loops, descriptors in launch(_threads_and_descriptors, 2, timeout=60):
        assert loops == 1 and descriptors < 120, (loops, descriptors)


def test_a_static_world_across_hosts_keeps_torchs_default_channels():
    # The multi-host tests run in network namespaces of one machine (one host to /proc):
    # the other branch of the choice, checked on its own.
    from types import SimpleNamespace

    from machinlike.distributed._world.session import _static_channels

    def members(remote):
        return SimpleNamespace(roster=SimpleNamespace(on_this_host=lambda name: name not in remote))

    assert _static_channels(members(set()), ["0", "1", "2"]) == ["cma", "basic"]
    assert _static_channels(members({"2"}), ["0", "1", "2"]) is None


def test_an_elastic_budget_counts_joins_and_departures_and_warns_once(caplog):
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        pytest.skip("no limit of open files here")
    budget = _descriptors.Budget("World 'learner'", _descriptors.PER_MEMBER_HOST, role="it hosts the store")
    fits = (soft - _descriptors.BASE) // _descriptors.PER_MEMBER_HOST  # members that fit this soft limit
    with caplog.at_level(logging.WARNING, logger="machinlike"):
        for _ in range(fits):
            budget.joined(1)
        budget.joined(-1)
        budget.joined(1)
        assert not caplog.records  # at the limit, not past it
        budget.joined(1)
        budget.joined(1)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and f"{fits + 1} members need about" in warnings[0], warnings
    assert "World 'learner': this process may open" in warnings[0] and "it hosts the store)" in warnings[0]
    assert not _descriptors.Budget("World 'actor'", _descriptors.PER_MEMBER).check(fits + 1)  # others need less
