"""Smoke test of the pool tour examples/pool.py: run it as a user would, check what it proves."""

from __future__ import annotations

import re

from example_run import run_example


def test_pool_tour():
    done = run_example("pool.py", ["--time-budget", "60"], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for text in [
        # 1. lambdas, closures, a chunked map, in other processes
        "apply_async(lambda x: x * x, (12,)).get() -> 144",
        "offset=0.5 captured -> 6.5",
        "50 tasks",
        "matches the serial result: True",
        # 2. 64 MB tensor: copied vs shared
        "the worker saw [1.0, 1.0, 1.0]; the caller's tensor now holds 0.0",
        "the worker saw [1.0, 2.0, 3.0]; the caller's tensor now holds 3.0",
        # 3. per-worker contexts
        "every answer equals the answer of the replica that served it",
        "the caller's contexts are untouched (copy mode): served = [0, 0]",
        # 4. thread pools share objects
        "read back intact: True",
        "the caller's own lock object, not a copy: True",
        "total 300 of 300 records, every file written: True",
        # 5. a SIGKILLed worker: a clear error, then the pool keeps serving
        "killed by signal SIGKILL (9): while running its task",
        "err.exitcode=-9  err.signal_name='SIGKILL'",
        "the tasks submitted beside it still complete: [0, 1, 4, 9, 16, 25]",
        "is among them: False; size() = 2",
        # 6. a remote exception keeps its type and carries the worker's traceback
        "caught ConfigError, the very class of this script: True; message: port must be a number, got 'eighty'",
        "__cause__ is RemoteTraceback; its first line: Traceback (most recent call last) on pool worker",
        "in parse_port",
        "parse_port('port=8080') -> 8080",
    ]:
        assert text in out, f"{text!r} missing from:\n{out}"
    assert re.search(r"ran in worker processes \[[\d, ]+\], not in this process \(\d+\): True", out), out
    assert re.search(r"-> 'replica-[01]': the worker's context comes first", out), out
    assert re.search(r"doomed\.get\(\) raised WorkerLostError: pool worker \d \(pid \d+\) killed", out), out
    seconds = float(re.search(r"done in ([\d.]+) s", out).group(1))
    print(f"tour ran in {seconds:.1f} s")
    assert "Warning" not in done.stderr, done.stderr  # a tour runs clean
