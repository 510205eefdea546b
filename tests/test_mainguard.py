"""A script that starts processes at import time, without ``if __name__ == "__main__":``.

Each new process of the spawn and forkserver start methods imports the script again; the
child that reaches a Pool, a Process, ``launch`` or a World there is stopped with exit code
``_mainguard.EXIT_CODE`` and a message naming the call, and the parent's error says the fix
at once: a pool breaks at its first such worker (not after three), ``launch`` does not
restart the rank. Real scripts, run as a user runs them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from machinlike import _mainguard
from machinlike.exception import ProcessExitedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPTS = {
    "process": """
from machinlike.process import Process
p = Process(target=print, args=("the target ran",))
p.start()
p.join(60)
p.watch()
""",
    "pool": """
from machinlike.pool import Pool
with Pool(2) as pool:
    print(pool.map(abs, [-1, -2]))
""",
    "launch": """
import logging
logging.basicConfig(level=logging.WARNING)
from machinlike import launch
print(launch(lambda world: world.rank, 2, max_restarts=2, timeout=60))
""",
    "world_then_pool": """
from machinlike import World
from machinlike.pool import P2PPool
world = World(name="learner", rank=0, world_size=1)
try:
    with P2PPool(1) as pool:
        print(pool.map(abs, [-1]))
finally:
    world.stop()
""",
}

CALL = {"process": "Process.start()", "pool": "Pool(...)", "launch": "launch(...)", "world_then_pool": "World(...)"}


@pytest.mark.parametrize("kind", sorted(SCRIPTS))
def test_an_unguarded_script_fails_at_once_saying_the_fix(tmp_path, kind):
    script = tmp_path / f"unguarded_{kind}.py"
    script.write_text(SCRIPTS[kind])
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=150)
    took = time.monotonic() - started
    assert done.returncode != 0, done.stdout
    err = done.stderr
    # The parent's error: the exit code, what happened, the fix.
    assert f"exited with code {_mainguard.EXIT_CODE}: it stopped before it ran anything of yours" in err, err
    assert 'under `if __name__ == "__main__":`' in err
    # The child's own line names the call it reached; multiprocessing's RuntimeError is gone.
    assert f"machinlike: {CALL[kind]} was called while this process" in err, err
    assert "bootstrapping phase" not in err
    assert "the target ran" not in done.stdout
    if kind in ("pool", "world_then_pool"):
        assert "third time" not in err  # broken at the first stopped worker
    if kind == "launch":
        assert "restarting rank" not in err  # a restart would only stop again
    assert took < 60, f"{kind}: {took:.1f} s"


THREADS_AT_IMPORT = """
from machinlike.pool import Pool, ThreadPool
helpers = ThreadPool(1)  # at import time, in every child too: harmless (no process starts)
if __name__ == "__main__":
    with Pool(2) as pool:
        print(pool.map(abs, [-1, -2]))
    helpers.close()
"""


def _run_script(tmp_path, name: str, text: str) -> subprocess.CompletedProcess:
    script = tmp_path / name
    script.write_text(text)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=150)


def test_a_thread_pool_made_at_import_time_does_not_stop_the_children(tmp_path):
    done = _run_script(tmp_path, "threads_at_import.py", THREADS_AT_IMPORT)
    assert done.returncode == 0 and done.stdout.strip() == "[1, 2]", done.stderr[-3000:]


def test_a_guarded_process_is_never_stopped_and_the_check_is_a_no_op_here():
    assert not _mainguard.starting()
    _mainguard.check("Pool(...)")  # returns: this process is not being started
    assert _mainguard.explain(_mainguard.EXIT_CODE) == _mainguard.EXPLANATION
    assert _mainguard.explain(1) == "" and _mainguard.explain(None) == ""
    err = ProcessExitedError("rank 0", 123, _mainguard.EXIT_CODE, _mainguard.explain(_mainguard.EXIT_CODE))
    assert str(err).startswith(f"rank 0 (pid 123) exited with code {_mainguard.EXIT_CODE}: it stopped before")


@pytest.mark.parametrize("kind", ["process", "pool", "launch"])
def test_a_script_read_from_stdin_is_told_to_be_a_file_before_anything_starts(tmp_path, kind):
    # spawn and forkserver run the main module again by its path: "<stdin>" has none, and
    # each child failed to start ("exited with code 1", a pool broken after three tries).
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-"], input=SCRIPTS[kind], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=150)
    assert done.returncode != 0 and "the target ran" not in done.stdout
    assert (f"RuntimeError: {CALL[kind]} cannot start processes from this script: the 'forkserver' start method "
            f"runs its main module again") in done.stderr, done.stderr
    assert "save the script to a file and run `python script.py`" in done.stderr
    assert "FileNotFoundError" not in done.stderr  # (no child was started)
    assert time.monotonic() - started < 30


def test_a_script_given_with_dash_c_still_starts_processes(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    code = ("from machinlike.pool import Pool\n"
            "if __name__ == '__main__':\n"
            "    with Pool(1) as pool:\n"
            "        print(pool.map(abs, [-3]))\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=150)
    assert done.returncode == 0 and done.stdout.strip() == "[3]", done.stderr



GUARDED_GLOBALS = """
from machinlike import launch
from machinlike.pool import Pool


def rank_body(world):
    group = world.create_rpc_group("g", world.get_members())
    if world.rank == 1:
        try:
            group.rpc_sync("0", lambda: LIMIT + 1)
        except NameError as exc:
            print("rpc:", exc.__notes__[0])
    group.barrier()
    return LIMIT


if __name__ == "__main__":
    LIMIT = 10
    with Pool(1) as pool:
        try:
            pool.map(lambda i: i + LIMIT, range(2))
        except NameError as exc:
            print("pool:", exc.__notes__[0])
    with Pool(1, is_recursive=True) as pool:
        print("recursive:", pool.map(lambda i: i + LIMIT, range(2)))
    try:
        launch(rank_body, 2, timeout=60)
    except NameError as exc:
        print("launch:", exc.__notes__[0])
"""


def test_a_name_defined_under_the_main_guard_is_explained_where_a_child_misses_it(tmp_path):
    # A lambda or body using a global the script sets under its main guard: a spawned
    # child imports the script as __mp_main__, skips the block, and raised a bare NameError.
    done = _run_script(tmp_path, "guarded_globals.py", GUARDED_GLOBALS)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in done.stdout.splitlines() if ": " in line)
    note = ("'LIMIT' is defined under the script's `if __name__ == \"__main__\":` block, which this process (pid ")
    for where in ("pool", "rpc", "launch"):
        assert lines.get(where, "").startswith(note), done.stdout
        fix = "Pass it as an argument (launch(fn, n, args=(...)) gives it to every rank) or define it at module level"
        assert fix in lines[where]
    assert lines["recursive"] == "[10, 11]"


def test_the_names_a_script_binds_under_its_main_guard(tmp_path):
    script = tmp_path / "names.py"
    script.write_text(
        "import os\n"
        "top = 1\n"
        "if '__main__' == __name__:\n"
        "    import numpy as np, torch.nn\n"
        "    from math import pi as PI\n"
        "    a, (b, c) = 1, (2, 3)\n"
        "    for i in range(3):\n"
        "        with open(__file__) as fh:\n"
        "            total: int = 0\n"
        "    def helper(inner=1):\n"
        "        local = 2\n"
        "    class Box:\n"
        "        field = 3\n"
        "    squares = [k * k for k in range(3)]\n"
        "    f = lambda q: q\n"
        "if __name__ != '__main__':\n"
        "    elsewhere = 1\n")
    names = _mainguard._guarded_names(str(script))
    assert names == {"np", "torch", "PI", "a", "b", "c", "i", "fh", "total", "helper", "Box", "squares", "f"}
    broken = tmp_path / "broken.py"
    broken.write_text("if __name__ == '__main__':\n    x = (\n")
    assert _mainguard._guarded_names(str(broken)) == frozenset()
    assert _mainguard._guarded_names(str(tmp_path / "absent.py")) == frozenset()
    error = NameError("name 'a' is not defined", name="a")
    _mainguard.note_guarded_name(error)  # this process is no spawned child: nothing to explain
    assert not hasattr(error, "__notes__")
