"""SIGTERM to the process running launch(): the ranks are told and get the stop grace.

A scheduler's stop or preemption sends SIGTERM to the launcher only. Before, the launcher
died at once and its ranks followed through their lifelines: a rank's SIGTERM handler
(save a checkpoint) never ran. These run a real launcher script and signal its pid.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# rank 0 saves on SIGTERM and returns; rank 1 keeps the default (dies of it); rank 2, with
# --stubborn, ignores it (the launcher must kill it after the grace). Each rank appends its
# pid to starts<rank> when it starts (a restart would add a line).
SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from machinlike import launch

    def rank(world, out, stubborn):
        with open(os.path.join(out, f"starts{world.rank}"), "a") as f:
            f.write(f"{os.getpid()}\\n")
        told = []
        if world.rank == 0:
            signal.signal(signal.SIGTERM, lambda *_: told.append(1))
        elif world.rank == 2 and stubborn:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        open(os.path.join(out, f"ready{world.rank}"), "w").close()
        deadline = time.monotonic() + 60
        while not told and time.monotonic() < deadline:
            time.sleep(0.02)
        with open(os.path.join(out, f"checkpoint{world.rank}"), "w") as f:
            f.write("saved" if told else "not told")
        return world.rank

    if __name__ == "__main__":
        out, stubborn, restarts, own = sys.argv[1], sys.argv[2] == "1", int(sys.argv[3]), sys.argv[4] == "1"
        if own:
            def mine(*_):
                open(os.path.join(out, "own-handler"), "w").close()
                sys.exit(7)
            signal.signal(signal.SIGTERM, mine)
        launch(rank, 3, (out, stubborn), timeout=90, stop_timeout=3.0, max_restarts=restarts)
        print("launch returned")
""")


def _start(tmp_path, stubborn=False, restarts=0, own=False):
    script = tmp_path / "launcher.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, str(script), str(tmp_path), "1" if stubborn else "0", str(restarts),
                             "1" if own else "0"], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"ready{r}").exists() for r in range(3)):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"the ranks never got ready: {proc.communicate()}")
        time.sleep(0.02)  # polling files another process writes
    return proc


def _rank_pids(tmp_path):
    return [int(line) for r in range(3) for line in (tmp_path / f"starts{r}").read_text().split()]


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as stream:
            return stream.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _finish(proc, timeout):
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=10)
        pytest.fail(f"the launcher still ran {timeout} s after SIGTERM:\n{err[-5000:]}")
    return out, err


def test_sigterm_reaches_the_ranks_which_may_save_before_the_launcher_ends(tmp_path):
    proc = _start(tmp_path, restarts=1)  # an elastic world: a rank that dies may be restarted
    begin = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    out, err = _finish(proc, 30)
    took = time.monotonic() - begin
    assert proc.returncode == -signal.SIGTERM, err  # ends by the signal, as before
    assert "launch: ended by SIGTERM" in err, err  # and says so (a log ending mid-run read as a crash)
    assert "launch returned" not in out
    assert (tmp_path / "checkpoint0").read_text() == "saved", err
    assert not (tmp_path / "checkpoint1").exists()  # the default action: died of it
    assert len((tmp_path / "starts1").read_text().split()) == 1  # a rank told to end is not restarted
    assert took < 3.0 + 8.0  # no rank held out: no waiting for the grace's end
    left = [pid for pid in _rank_pids(tmp_path) if _alive(pid)]
    assert not left, f"ranks outlived the launcher: {left}"


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace(tmp_path):
    proc = _start(tmp_path, stubborn=True)
    begin = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    out, err = _finish(proc, 30)
    took = time.monotonic() - begin
    assert proc.returncode == -signal.SIGTERM, err
    assert (tmp_path / "checkpoint0").read_text() == "saved"
    assert 3.0 <= took < 3.0 + 8.0, took  # stop_timeout=3 s of grace, then SIGKILL
    assert not (tmp_path / "checkpoint2").exists()
    assert not [pid for pid in _rank_pids(tmp_path) if _alive(pid)]


def test_a_second_sigterm_ends_the_launcher_at_once(tmp_path):
    proc = _start(tmp_path, stubborn=True)
    os.kill(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 20
    while not (tmp_path / "checkpoint0").exists() and time.monotonic() < deadline:
        time.sleep(0.02)  # the first one reached the ranks
    begin = time.monotonic()
    os.kill(proc.pid, signal.SIGTERM)
    _, err = _finish(proc, 30)
    assert proc.returncode == -signal.SIGTERM, err
    assert time.monotonic() - begin < 2.5  # not the 3 s grace
    deadline = time.monotonic() + 10
    while [pid for pid in _rank_pids(tmp_path) if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)  # the ranks follow through their lifelines
    assert not [pid for pid in _rank_pids(tmp_path) if _alive(pid)]


def test_a_launcher_with_its_own_sigterm_handler_keeps_it(tmp_path):
    proc = _start(tmp_path, own=True)
    os.kill(proc.pid, signal.SIGTERM)
    _, err = _finish(proc, 30)
    assert proc.returncode == 7, err  # the program's handler ran, as without launch
    assert (tmp_path / "own-handler").exists()
    deadline = time.monotonic() + 10
    while [pid for pid in _rank_pids(tmp_path) if _alive(pid)] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [pid for pid in _rank_pids(tmp_path) if _alive(pid)]


@pytest.fixture
def python_sigint():
    """Python's own Ctrl-C handler for the test: a process started in the background of a
    non-interactive shell (``cmd &``) inherits SIGINT ignored, and Python then leaves it so."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_a_ctrl_c_during_a_ranks_start_waits_for_the_start_to_end(python_sigint):
    # Interrupted while it wrote a rank's start-up data, the launcher left the forkserver's
    # child printing an UnpicklingError traceback under the example's "interrupted" line.
    import os
    import signal
    import threading
    import time

    from machinlike.distributed._launch.termination import deferred

    steps = []
    with pytest.raises(KeyboardInterrupt):
        with deferred():
            steps.append("start")
            # process-directed, from another thread (as a terminal's Ctrl-C may land there)
            sender = threading.Thread(target=os.kill, args=(os.getpid(), signal.SIGINT))
            sender.start()
            sender.join()
            # Bytecodes and sleeps on which KeyboardInterrupt would have been raised (the
            # sleeps: under load the kernel may hand the signal to a thread that runs later).
            for _ in range(200):
                steps.append("written")
                time.sleep(0.001)
            steps.append("recorded")
    assert steps[0] == "start" and steps[-1] == "recorded" and len(steps) == 202
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with deferred():  # an ignored Ctrl-C stays ignored
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)


def test_a_second_ctrl_c_during_a_deferred_start_is_not_held_back(python_sigint):
    # (a start that hangs, the warm forkserver's first import of torch, stays interruptible)
    import signal

    from machinlike.distributed._launch.termination import deferred

    steps = []
    with pytest.raises(KeyboardInterrupt):
        with deferred():
            signal.raise_signal(signal.SIGINT)
            steps.append("noted")
            signal.raise_signal(signal.SIGINT)
            steps.append("not reached")
    assert steps == ["noted"] and signal.getsignal(signal.SIGINT) is signal.default_int_handler


def _returns_with_a_sigterm_handler(world, directory):
    from multiprocessing import util

    if world.rank == 0:  # the recipe of a rank that saves on SIGTERM (clusters.rst)
        signal.signal(signal.SIGTERM, lambda *_: None)
    # (run as the process ends by itself, after its World.stop: not on a signal's default, nor SIGKILL)
    util.Finalize(None, open, args=(os.path.join(directory, f"ended-{world.rank}"), "w"), exitpriority=0)
    return world.rank


def test_after_a_clean_run_the_ranks_end_by_themselves_handler_or_not(tmp_path):
    # The launcher SIGTERMed every rank the moment the last result came in: their World.stop
    # was cut short, and a rank whose function handled SIGTERM held launch() up for its
    # 2 s grace before a SIGKILL.
    from machinlike import launch

    (tmp_path / "warm").mkdir()
    launch(_returns_with_a_sigterm_handler, 1, args=(str(tmp_path / "warm"),), timeout=60)  # (the forkserver's start)
    started = time.monotonic()
    assert launch(_returns_with_a_sigterm_handler, 3, args=(str(tmp_path),), timeout=60) == [0, 1, 2]
    took = time.monotonic() - started
    # Each rank ended by itself: a rank SIGTERMed (default action) or SIGKILLed after the
    # grace runs no finalizer and writes no file. (Not a time bound: 0.6 s idle, but on a
    # loaded 2-core box a clean run of three ranks can take longer than the 2 s grace.)
    assert sorted(p for p in os.listdir(tmp_path) if p.startswith("ended")) == ["ended-0", "ended-1", "ended-2"]
    assert took < 30, took
