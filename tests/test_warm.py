"""The warm forkserver's two profiles: light for processes and pools, train for ranks."""

from __future__ import annotations

import os
import sys

import machinlike
from machinlike.pool import Pool
from machinlike.process import Process


def _has_dynamo() -> bool:
    return "torch._dynamo" in sys.modules


def _rank_job(world):
    # A pool inside a rank borrows the rank's own (train) server: no third server.
    with Pool(1) as pool:
        return _has_dynamo(), pool.apply(_has_dynamo)


def test_pools_start_light_and_ranks_start_with_dynamo():
    with Pool(1) as pool:
        assert pool.apply(_has_dynamo) is False, "a pool worker should not pay for importing torch._dynamo"
    assert machinlike.launch(_rank_job, 2, timeout=120) == [(True, True), (True, True)]


def _report_env(out) -> None:
    out.put(os.environ.get("MACHINLIKE_TEST_WARM_ENV"))


def _rank_env(world):
    return os.environ.get("MACHINLIKE_TEST_WARM_ENV")


def test_children_see_the_parents_environment_of_now_not_the_servers(monkeypatch):
    # The servers are warm already (earlier starts in this process, or this one); a
    # variable set afterwards must reach the next child, as it would with spawn.
    assert machinlike.launch(_rank_env, 1, timeout=120) == [os.environ.get("MACHINLIKE_TEST_WARM_ENV")]
    monkeypatch.setenv("MACHINLIKE_TEST_WARM_ENV", "after-start")
    assert machinlike.launch(_rank_env, 1, timeout=120) == ["after-start"]
    out = machinlike.SimpleQueue()
    child = Process(target=_report_env, args=(out,))
    child.start()
    assert out.get(timeout=60) == "after-start"
    child.join(30)
    monkeypatch.delenv("MACHINLIKE_TEST_WARM_ENV")
    assert machinlike.launch(_rank_env, 1, timeout=120) == [None]


def _draws(*_):
    import time

    import numpy as np
    import torch
    time.sleep(0.2)  # hold this worker so the next task goes to another
    return os.getpid(), torch.initial_seed(), torch.rand(1).item(), float(np.random.rand())


def _rank_draws(world):
    return _draws()


def test_every_child_starts_with_its_own_random_seeds():
    # Children fork from one warm server: without fresh seeds they all carried its torch
    # generator, so every actor drew the same "random" numbers (spawn gives each its own).
    with Pool(3) as pool:
        draws = pool.map(_draws, range(6))
    out = machinlike.SimpleQueue()
    children = [Process(target=lambda q: q.put(_draws()), args=(out,)) for _ in range(2)]
    for child in children:
        child.start()
    draws += [out.get(timeout=60) for _ in children]
    for child in children:
        child.join(30)
    draws += machinlike.launch(_rank_draws, 2, timeout=120)
    by_pid = {pid: rest for pid, *rest in draws}
    assert len(by_pid) >= 5, draws  # at least two pool workers, two processes, two ranks
    for column in range(3):  # seed, torch draw, numpy draw: one per process, none shared
        values = [rest[column] for rest in by_pid.values()]
        assert len(set(values)) == len(values), (column, draws)


def _threads(*_):
    import torch
    return torch.get_num_threads()


def _rank_threads(world):
    return _threads()


def test_children_take_the_thread_count_the_parent_set_after_the_server_started(monkeypatch):
    with Pool(1) as pool:
        pool.apply(_threads)  # the light server runs, with the environment of then
    assert machinlike.launch(_rank_threads, 1, timeout=120)  # so does the train server
    # An actor script sets OMP_NUM_THREADS before it starts its workers; spawn's children
    # read it as torch loads, the warm servers' torch had read theirs already.
    wanted = 3 if os.environ.get("OMP_NUM_THREADS") != "3" else 4
    monkeypatch.setenv("OMP_NUM_THREADS", str(wanted))
    with Pool(1) as pool:
        assert pool.apply(_threads) == wanted
    out = machinlike.SimpleQueue()
    child = Process(target=lambda q: q.put(_threads()), args=(out,))
    child.start()
    assert out.get(timeout=60) == wanted
    child.join(30)
    assert machinlike.launch(_rank_threads, 1, timeout=120) == [wanted]


CTRL_C = """
import os, signal, sys, time
from machinlike import _warm
from machinlike.process import Process

server = _warm._get_server("light")
server.ensure_running()  # returns at once; the server imports torch for a second or two
pid = server._forkserver_pid
deadline = time.monotonic() + 60
while "libtorch" not in open(f"/proc/{pid}/maps").read():  # importing torch now
    assert time.monotonic() < deadline, "the server never loaded torch"
    time.sleep(0.005)
os.kill(pid, signal.SIGINT)  # a Ctrl-C reaches the whole process group
child = Process(target=os.getpid, ctx=_warm.resolve_context(None))
child.start()
child.join(60)
print("child", child.exitcode, flush=True)
"""


def test_a_ctrl_c_while_the_server_preloads_is_left_to_the_parent():
    # It used to kill the server with a page of KeyboardInterrupt traceback (the parent's
    # own Ctrl-C handling then came second, and the next child found no server).
    import subprocess

    proc = subprocess.run([sys.executable, "-c", CTRL_C], capture_output=True, text=True, timeout=120,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0 and "child 0" in proc.stdout, proc.stdout + proc.stderr
    assert "KeyboardInterrupt" not in proc.stderr, proc.stderr


HOLDER = """
import sys, time
import machinlike
from machinlike.process import Process

def hold():
    time.sleep(2)  # (a child outlives a parent killed; the server ends after both)

if __name__ == "__main__":
    child = Process(target=hold)
    child.start()
    print("started", flush=True)
    time.sleep(60)
"""


def test_a_parent_ended_by_a_signal_leaves_nothing_in_the_temporary_folder(tmp_path, request):
    # The warm server's socket used to sit in multiprocessing's folder (/tmp/pymp-*), which
    # only a clean exit of the parent removes: a launcher SIGKILLed, or a job whose every
    # process got SIGTERM from its scheduler, left one behind each time.
    import signal
    import subprocess
    import time

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    script = tmp_path / "holder.py"
    script.write_text(HOLDER)
    import pathlib
    import shutil
    import tempfile

    for how in ("SIGKILL the parent", "SIGTERM the group"):
        tmp = pathlib.Path(tempfile.mkdtemp(prefix="mlk-tmp-"))  # (short: a socket's path has 107 bytes at most)
        request.addfinalizer(lambda tmp=tmp: shutil.rmtree(tmp, ignore_errors=True))
        env = {**os.environ, "TMPDIR": str(tmp), "PYTHONPATH": root}
        proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, env=env,
                                start_new_session=True)
        try:
            assert proc.stdout.readline().strip() == "started"
            assert any(tmp.iterdir()), "the server's socket is not in TMPDIR"
            if how == "SIGKILL the parent":
                proc.kill()
            else:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(30)
            deadline = time.monotonic() + 30  # the child ends, then the server (its last client)
            while any(tmp.iterdir()) and time.monotonic() < deadline:
                time.sleep(0.05)  # polling the folder that processes we do not own clean up
            assert not any(tmp.iterdir()), (how, list(tmp.iterdir()))
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.stdout.close()


def _sigterm_is_default(out) -> None:
    import signal
    out.put(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL)


def test_children_get_the_default_sigterm_not_the_servers():
    # The server ends its loop on SIGTERM (to remove its socket folder); a child forked
    # from it must die by the signal as a spawned one does.
    out = machinlike.SimpleQueue()
    child = Process(target=_sigterm_is_default, args=(out,))
    child.start()
    assert out.get(timeout=60) is True
    child.join(30)


def test_a_child_terminated_as_it_starts_dies_of_the_signal_and_the_server_serves_on():
    # The server handles SIGTERM (to remove its socket folder). A child signalled while it
    # still had that handler either lost the signal (caught before the interpreter's
    # after-fork code, which clears caught signals: it slept on) or raised the server's
    # SystemExit inside the server's loop, which removed the folder of a server that lived
    # on: every later start in that process failed with FileNotFoundError (a CI run).
    import signal
    import time

    from machinlike import _warm

    for attempt in range(30):
        child = Process(target=time.sleep, args=(60,))
        child.start()
        child.terminate()
        child.join(20)
        assert child.exitcode == -signal.SIGTERM, (attempt, child.exitcode)
        for server in _warm._servers.values():
            assert server._forkserver_address is None or os.path.exists(server._forkserver_address), attempt


def test_a_server_whose_socket_was_removed_is_replaced_and_still_reports_its_children(caplog):
    # A /tmp cleaner (or a user's rm) removing the socket used to fail every later start
    # in the process with FileNotFoundError; the old server still owes its live children
    # their exit codes, so it is left to end by itself.
    import shutil
    import signal
    import time

    from machinlike import _warm

    first = Process(target=time.sleep, args=(60,))
    first.start()
    server = _warm._servers["light"]
    old_pid = server._forkserver_pid
    shutil.rmtree(os.path.dirname(server._forkserver_address))
    second = Process(target=time.sleep, args=(60,))
    second.start()  # (raised FileNotFoundError)
    assert server._forkserver_pid != old_pid and os.path.exists(server._forkserver_address)
    assert "was removed; starting another server" in caplog.text
    for child in (first, second):
        child.terminate()
        child.join(20)
        assert child.exitcode == -signal.SIGTERM, child  # (255 had the old server gone first)
    deadline = time.monotonic() + 30  # the old server ends once its last child did
    while server._retired and time.monotonic() < deadline:
        time.sleep(0.05)  # (polled: each start lets it go, then reaps it)
        child = Process(target=int)
        child.start()
        child.join(20)
    assert not server._retired and not os.path.exists(f"/proc/{old_pid}")
