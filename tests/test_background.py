"""The checks an xdist controller starts for its workers (``_background.start_shared``): a
worker reads each outcome from the shared folder, waits a bounded time for one still
running, and the controller's ``stop_all`` ends what still runs and removes the folder.

Run in a subprocess of its own: ``start_shared`` names its folder in the environment and
``stop_all`` ends every check of the process, and the process running this test may be
the one whose mypy and Sphinx build the serial part collects.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent

CONTROLLER = r"""
import os, subprocess, sys, time
from pathlib import Path
import _background

py = sys.executable
root = _background.start_shared({
    "quick": lambda folder: [py, "-c", "import sys; print('to stdout'); print('to stderr', file=sys.stderr); sys.exit(3)"],
    "slow": lambda folder: [py, "-c", "import time; time.sleep(120)"],
    "writes": lambda folder: [py, "-c", f"open({str(folder / 'made')!r}, 'w').write('x')"],
    "dies": lambda folder: [py, "-c", "import time; time.sleep(120)"],
})
dies = _background._jobs["dies"]
deadline = time.monotonic() + 30
while not (dies.folder / "pid").exists() and time.monotonic() < deadline:
    time.sleep(0.05)  # polling for the shell's first line, not synchronising
dies.proc.kill()  # the shell alone (as the OOM killer might): its check runs on
assert os.environ[_background.SHARED_ENV] == str(root)
worker = r'''
import subprocess, _background
quick = _background.outcome("quick", 30)
print("quick", quick.returncode, quick.stdout.strip(), quick.stderr.strip())
writes = _background.outcome("writes", 30)
print("writes", writes.returncode, (_background.folder_of("writes") / "made").read_text())
try:
    _background.outcome("slow", 0.5)
except subprocess.TimeoutExpired as err:
    print("slow timed out", err.timeout)
print("absent", _background.outcome("absent", 1), _background.folder_of("absent"))
try:
    _background.outcome("dies", 30)
except RuntimeError as err:
    print("dies:", "ended without an outcome" in str(err))
'''
done = subprocess.run([py, "-c", worker], capture_output=True, text=True, timeout=60)
print(done.stdout, end="")
assert done.returncode == 0, done.stderr
slow = _background._jobs["slow"].proc
check_pids = Path(f"/proc/{slow.pid}/task/{slow.pid}/children").read_text().split()
_background.stop_all()
print("folder left", root.exists(), "shell ended", slow.poll() is not None)
deadline = time.monotonic() + 10
while any(Path(f"/proc/{pid}").exists() for pid in check_pids) and time.monotonic() < deadline:
    time.sleep(0.05)  # polling a SIGKILLed process's exit, not synchronising
print("check ended", not any(Path(f"/proc/{pid}").exists() for pid in check_pids), len(check_pids))
"""


def test_workers_read_the_controllers_checks_and_its_stop_ends_them():
    env = {"PYTHONPATH": str(TESTS), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", CONTROLLER], cwd=TESTS, env=env, capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines == [
        "quick 3 to stdout to stderr",
        "writes 0 x",
        "slow timed out 0.5",
        "absent None None",
        "dies: True",
        "folder left False shell ended True",
        "check ended True 1",
    ], done.stdout
