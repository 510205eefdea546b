"""Project-wide test fixtures: leak checks after every test; the read-only checks (mypy,
the Sphinx build) started beside the suite (see ``_background``); the ``serial`` mark.

The README's test command runs the suite in two parts: every test not marked ``serial``
three at a time (``-n 3``, pytest-xdist), then the ``serial`` ones two files at a time
(``-n 2 --dist loadfile``: their tests mostly wait on liveness bounds and peers, 50 s of
CPU in 200 s alone; two at a time took 126 s with the box still a third idle, and each
file's tests still run one after another). Why two parts: a serial run left this 2-core
box idle 43% of its 12 minutes (processes starting, peers waiting out timeouts). On a slow
box (session 51) the first part took 600 s two at a time, 402-451 s three at a time (the
box 5% idle), 450 s four at a time (and more tests raced); in session 103, 471 s
three at a time, 492 s four at a time, with no CPU left idle. ``serial`` marks the files
whose tests hold a measured bound only on a quiet machine (see ``SERIAL``), and the tests
that collect the background checks (``CHECKS``); ``python -m pytest`` alone still runs
everything, one test at a time.
"""

from __future__ import annotations

import compileall
import importlib.util
import multiprocessing
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

import _background

# Every new store connection makes torch look up the peer's host name (getnameinfo); this
# machine's resolver leaves about one query in thirty unanswered, and the look-up then
# stalls for the resolver's timeout: 5 s by default, 200 connections took 35 s. One try
# of 1 s bounds it (200 took 1 s), but a stall of 1 s still failed a timed test now and
# then (a departure seen 1.004 s late, a 1 s start-up's own connection timed out: stop
# 101's CI). Over TCP (use-vc) no query is lost: here the resolver refuses TCP, and each
# look-up fails in about a millisecond (2,000 in a row, none slow; over UDP 3 in 200 took
# 1 s). TCP is taken only where a probe shows it quick: a resolver that drops TCP instead
# would stall every look-up. glibc reads this when a process first resolves, so it is
# set before any test runs; the processes the tests start inherit it.
_UDP_RES, _TCP_RES = "timeout:1 attempts:1", "use-vc timeout:1 attempts:1"
_PROBE_RES = """import socket, time
t = time.monotonic()
for a in ("::ffff:127.0.0.1", "::1", "::ffff:127.0.0.1"):
    try:
        socket.getnameinfo((a, 1, 0, 0), socket.NI_NUMERICSERV)
    except OSError:
        pass
print(time.monotonic() - t)
"""


def _res_options() -> str:
    """TCP look-ups where three of them take under 0.3 s in all; else one UDP try of 1 s."""
    try:
        done = subprocess.run([sys.executable, "-I", "-S", "-c", _PROBE_RES], capture_output=True, text=True,
                              timeout=5, env=dict(os.environ, RES_OPTIONS=_TCP_RES))
        return _TCP_RES if done.returncode == 0 and float(done.stdout) < 0.3 else _UDP_RES
    except (OSError, ValueError, subprocess.SubprocessError):
        return _UDP_RES


if "RES_OPTIONS" not in os.environ:
    os.environ["RES_OPTIONS"] = _res_options()

def pytest_configure(config):
    """Compile the project's sources to bytecode once, before any test starts a process.

    Why: where ``PYTHONDONTWRITEBYTECODE`` is set (this sandbox and its CI set it), no
    interpreter writes ``__pycache__``, so every process the suite starts (hundreds:
    ranks, pool workers, scripts) compiled all of machinlike again: 0.36 s of a 3 s
    ``import machinlike``. An explicit compile still writes (the interpreters then only
    read), next to the sources as Python itself would (``__pycache__`` is ignored by git).
    Not in an xdist worker: the controller has done it before they start.
    """
    if not sys.dont_write_bytecode or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    root = Path(__file__).resolve().parent.parent
    for folder in ("machinlike", "tests", "examples", "benchmarks"):
        if (root / folder).is_dir():
            compileall.compile_dir(root / folder, quiet=2)


# Threads machinlike starts are all named with this prefix, so a leak check can tell
# ours from the interpreter's and torch's own long-lived helpers.
OUR_THREAD_PREFIX = "machinlike"


def _wait_gone(items, alive, deadline):
    while True:
        left = [x for x in items if alive(x)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.01)  # polling a teardown condition, not synchronising the test


@pytest.fixture(autouse=True)
def no_leaked_workers():
    """Fail a test that leaves child processes or machinlike threads running."""
    before_threads = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    children = _wait_gone(multiprocessing.active_children(), lambda p: p.is_alive(), deadline)
    ours = [
        t for t in threading.enumerate()
        if t not in before_threads and t.name.startswith(OUR_THREAD_PREFIX)
    ]
    ours = _wait_gone(ours, lambda t: t.is_alive(), deadline)
    for p in children:  # do not let one leak cascade into every later test
        p.kill()
        p.join(5)
    assert not children, f"leaked child processes: {children}"
    assert not ours, f"leaked machinlike threads: {[t.name for t in ours]}"


#: Test files run apart from the busy part (``-m serial``), and the bound each holds only on
#: a quiet machine.
SERIAL = {
    "test_bounded_stop.py": "stops within a few seconds while a service blocks",
    "test_liveness_scale.py": "store requests per member, detection and starvation within bounds",
    "test_liveness_wake.py": "a heartbeat thread never starved past a 0.625 s silence bound (liveness=1)",
    "test_ray.py": "every Ray actor started (a new interpreter) within a 10 s launch timeout",
    "test_samehost.py": "shared-memory segments recycled as fast as the receiver frees them",
    "test_scale.py": "16 member processes name their dead within 2.5 s p50, 4 s p99",
}


#: Tests that only collect a background check's outcome (``_background``): marked
#: ``serial`` too, and run last, so that mypy and Sphinx run at nice 19 in the idle time
#: the serial tests leave. In an xdist worker no check starts in the background, and
#: each of these would run its check itself (mypy 52 s, Sphinx 37 s in CI).
CHECKS = {
    "test_types.py::test_mypy_finds_no_errors": "mypy",
    "test_docs.py::test_sphinx_build_has_no_warnings": "sphinx",
    "test_docs.py::test_api_reference_documents_every_public_name": "sphinx",
}


def _check_of(item: pytest.Item) -> str | None:
    """The background check ``item`` collects (a ``CHECKS`` value), None for any other test."""
    return CHECKS.get(f"{item.path.name}::{item.name}")


def pytest_ignore_collect(collection_path, config):
    """Under exactly ``-m serial`` or ``-m "not serial"`` (the README's two parts), do not
    import the test files whose every test that part would deselect.

    Why: each part imports (and pytest rewrites the asserts of) every test file, in each of
    its processes: about 8 s of CPU per process, most of it for files whose tests were all
    deselected (the serial part is timed alone, on the critical path). None means "pytest
    decides", as always.
    """
    name = collection_path.name
    if not (name.startswith("test_") and name.endswith(".py")):
        return None
    wanted = config.getoption("markexpr", "")
    if wanted == "serial":
        holds_serial = name in SERIAL or any(check.startswith(f"{name}::") for check in CHECKS)
        return None if holds_serial else True
    if wanted == "not serial" and name in SERIAL:  # (every test of a SERIAL file is serial)
        return True
    return None


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.name in SERIAL or _check_of(item):
            item.add_marker(pytest.mark.serial)
    items.sort(key=lambda item: _check_of(item) is not None)  # (stable: the checks last)


def _checks_selected_by_args(config) -> bool:
    """Whether this run's paths and ``-m`` select the tests that collect the checks."""
    if config.getoption("markexpr", "") not in ("", "serial"):
        return False
    root = Path(__file__).resolve().parent
    wanted = {root / check.split("::")[0] for check in CHECKS}
    given = [Path(str(arg).split("::")[0]).resolve() for arg in config.args] or [Path.cwd()]
    return all(any(path == arg or arg in path.parents for arg in given) for path in wanted)


@pytest.hookimpl(tryfirst=True)  # (before xdist's own, which starts the workers)
def pytest_sessionstart(session):
    """An xdist controller starts the checks before its workers start, for them to share
    (``_background.start_shared``): it collects no test, and each worker would run its own."""
    config = session.config
    if os.environ.get("PYTEST_XDIST_WORKER") or not getattr(config.option, "numprocesses", None):
        return
    if not _checks_selected_by_args(config):
        return
    checks = {}
    if importlib.util.find_spec("mypy") is not None:
        checks["mypy"] = lambda folder: _background.mypy_argv()
    if importlib.util.find_spec("sphinx") is not None:
        checks["sphinx"] = lambda folder: _background.sphinx_argv(folder / "html")
    _background.start_shared(checks)


def pytest_collection_finish(session):
    """Start the read-only checks the selected tests need, beside the suite (not in an
    xdist worker: each worker collects every test, and the other worker is the
    parallelism; there the test that needs a check runs it itself)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    checks = {_check_of(item) for item in session.items}
    if "mypy" in checks and importlib.util.find_spec("mypy") is not None:
        _background.start("mypy", _background.mypy_argv())
    if "sphinx" in checks and importlib.util.find_spec("sphinx") is not None:
        folder = Path(tempfile.mkdtemp(prefix="mlk-sphinx-"))
        _background.start("sphinx", _background.sphinx_argv(folder / "html"), folder)


def pytest_sessionfinish(session, exitstatus):
    _background.stop_all()
