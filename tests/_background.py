"""Checks that only read the tree, run beside the suite instead of inside it.

mypy (about 35 s of CPU on a fresh checkout: it reads torch's sources) and the Sphinx
build (about 20 s) need no test's machine state, only the files. They start once pytest
knows the session's tests, at the lowest CPU priority (``nice 19``: a test process of
normal priority gets the CPU first, so timing-sensitive tests are not slowed), and the
test that needs one collects its outcome; by then it has usually finished in the idle
time other tests leave::

    pytest_collection_finish ── start(name, argv) ──► nice 19 subprocess, output to files
    test_types / test_docs   ── outcome(name, timeout) ─► (returncode, stdout, stderr)
    pytest_sessionfinish     ── stop_all() ──► kill what still runs, remove the files

A check that was not started (its test selected some other way) runs in the test itself.

Under pytest-xdist the workers collect, not the controller, and each would start its own
copy; so there the controller starts the checks as its session starts
(:func:`start_shared`), into a folder named by ``MACHINLIKE_TEST_CHECKS`` that the workers
it then starts inherit, and the worker that runs a check's test reads its outcome there
(a check's ``returncode`` file appears once it has ended)::

    controller: pytest_sessionstart ── start_shared(folder) ──► nice 19 "sh -c 'check; echo $? > returncode'"
    worker:     test_types       ── outcome("mypy", timeout) ─► waits for folder/mypy/returncode
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Dict, List, NamedTuple, Optional

__all__ = ["ROOT", "SHARED_ENV", "Outcome", "mypy_argv", "sphinx_argv", "checkout_env", "start", "start_shared", "folder_of",
           "outcome", "stop_all"]

ROOT = Path(__file__).resolve().parent.parent

#: The environment variable naming the folder of the checks a controller started for its
#: xdist workers (unset: none).
SHARED_ENV = "MACHINLIKE_TEST_CHECKS"


class Outcome(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


class _Job(NamedTuple):
    proc: subprocess.Popen
    folder: Path
    group: bool = False  # leads a process group of its own (start_shared)


_jobs: Dict[str, _Job] = {}
_shared: List[Path] = []  # folders of start_shared, removed by stop_all


def checkout_env() -> Dict[str, str]:
    """The environment of a subprocess: this checkout's machinlike, installed or not."""
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": str(ROOT) if not path else f"{ROOT}{os.pathsep}{path}"}


def mypy_argv() -> List[str]:
    return [sys.executable, "-m", "mypy"]  # what it checks: setup.cfg's [mypy]


def sphinx_argv(out: Path) -> List[str]:
    return [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html", str(ROOT / "docs"), str(out)]


def start(name: str, argv: List[str], folder: Optional[Path] = None) -> None:
    """Start check ``name`` in the background (once), its output to files in ``folder``
    (None: a temporary folder, removed by :func:`stop_all`)."""
    if name in _jobs:
        return
    folder = folder or Path(tempfile.mkdtemp(prefix=f"mlk-{name}-"))
    with open(folder / "stdout", "w") as out, open(folder / "stderr", "w") as err:
        # coreutils' nice, not preexec_fn: that is unsafe in a process with threads.
        nice = ["nice", "-n", "19"] if shutil.which("nice") else []
        proc = subprocess.Popen(nice + argv, cwd=ROOT, env=checkout_env(), stdout=out, stderr=err)
    _jobs[name] = _Job(proc, folder)


def start_shared(checks: Dict[str, Callable[[Path], List[str]]]) -> Path:
    """Start each of ``checks`` (name: its argv, given its folder) in the background, for
    the xdist workers this process starts next: each in a folder of its own under the
    returned one, which ``SHARED_ENV`` names from now on, with a ``returncode`` file
    written once it ended. Each leads a process group, so that :func:`stop_all` ends the
    check with its shell."""
    root = Path(tempfile.mkdtemp(prefix="mlk-checks-"))
    nice = ["nice", "-n", "19"] if shutil.which("nice") else []
    for name, argv_in in checks.items():
        folder = root / name
        folder.mkdir()
        argv = argv_in(folder)
        # The shell's pid first (a reader tells a dead shell from a slow check); the rename
        # makes the returncode appear whole: a reader never sees it empty.
        script = ('echo $$ >"$0/pid.part" && mv "$0/pid.part" "$0/pid"; "$@" >"$0/stdout" 2>"$0/stderr"; '
                  'echo $? >"$0/returncode.part" && mv "$0/returncode.part" "$0/returncode"')
        proc = subprocess.Popen(nice + ["sh", "-c", script, str(folder), *argv], cwd=ROOT, env=checkout_env(),
                                stdin=subprocess.DEVNULL, start_new_session=True)
        _jobs[name] = _Job(proc, folder, group=True)
    os.environ[SHARED_ENV] = str(root)
    _shared.append(root)
    return root


def _shared_folder(name: str) -> Optional[Path]:
    """The folder of check ``name`` started by this worker's controller, None without one."""
    root = os.environ.get(SHARED_ENV)
    if not root or name in _jobs:
        return None
    folder = Path(root) / name
    return folder if folder.is_dir() else None


def _ended(pid: int) -> bool:
    """Whether process ``pid`` ended: gone, or a zombie its parent (the controller) has not
    reaped yet."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except OSError:
        return True


def _shared_outcome(folder: Path, timeout: float) -> Outcome:
    """Raises:
        subprocess.TimeoutExpired: no outcome within ``timeout`` seconds.
        RuntimeError: the check's shell ended without writing one (killed).
    """
    deadline = time.monotonic() + timeout
    code = folder / "returncode"
    while not code.exists():
        pid = folder / "pid"
        if pid.exists() and _ended(int(pid.read_text())) and not code.exists():
            raise RuntimeError(f"the shell of check {folder.name!r} (pid {pid.read_text().strip()}) ended without "
                               f"an outcome: killed? Its output: {folder}")
        if time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired(folder.name, timeout)
        time.sleep(0.2)  # another process's check: no handle to wait on, only its files
    return Outcome(int(code.read_text()), (folder / "stdout").read_text(), (folder / "stderr").read_text())


def folder_of(name: str) -> Optional[Path]:
    """The folder of started check ``name``, None when it was not started."""
    shared = _shared_folder(name)
    if shared is not None:
        return shared
    job = _jobs.get(name)
    return None if job is None else job.folder


def outcome(name: str, timeout: float) -> Optional[Outcome]:
    """Check ``name``'s outcome, waiting up to ``timeout`` seconds; None when it was not started.

    Raises:
        subprocess.TimeoutExpired: it did not finish within ``timeout``.
    """
    shared = _shared_folder(name)
    if shared is not None:
        return _shared_outcome(shared, timeout)
    job = _jobs.get(name)
    if job is None:
        return None
    job.proc.wait(timeout)
    return Outcome(job.proc.returncode, (job.folder / "stdout").read_text(), (job.folder / "stderr").read_text())


def stop_all() -> None:
    """Kill the checks still running and remove their files."""
    for job in _jobs.values():
        if job.proc.poll() is None:
            if job.group:
                os.killpg(job.proc.pid, signal.SIGKILL)  # the shell and its check
            else:
                job.proc.kill()
        job.proc.wait(10)
        shutil.rmtree(job.folder, ignore_errors=True)
    _jobs.clear()
    for root in _shared:
        shutil.rmtree(root, ignore_errors=True)
    _shared.clear()
