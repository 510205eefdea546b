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
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, NamedTuple, Optional

__all__ = ["ROOT", "Outcome", "mypy_argv", "sphinx_argv", "checkout_env", "start", "folder_of", "outcome", "stop_all"]

ROOT = Path(__file__).resolve().parent.parent


class Outcome(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


class _Job(NamedTuple):
    proc: subprocess.Popen
    folder: Path


_jobs: Dict[str, _Job] = {}


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


def folder_of(name: str) -> Optional[Path]:
    """The folder of started check ``name``, None when it was not started."""
    job = _jobs.get(name)
    return None if job is None else job.folder


def outcome(name: str, timeout: float) -> Optional[Outcome]:
    """Check ``name``'s outcome, waiting up to ``timeout`` seconds; None when it was not started.

    Raises:
        subprocess.TimeoutExpired: it did not finish within ``timeout``.
    """
    job = _jobs.get(name)
    if job is None:
        return None
    job.proc.wait(timeout)
    return Outcome(job.proc.returncode, (job.folder / "stdout").read_text(), (job.folder / "stderr").read_text())


def stop_all() -> None:
    """Kill the checks still running and remove their files."""
    for job in _jobs.values():
        if job.proc.poll() is None:
            job.proc.kill()
        job.proc.wait(10)
        shutil.rmtree(job.folder, ignore_errors=True)
    _jobs.clear()
