"""Smoke tests of the API tours examples/ordered_server.py and examples/exceptions_events.py."""

from __future__ import annotations

import example_run


def run_example(script, *args, timeout=120):
    return example_run.run_example(script, args, timeout=timeout)


def test_ordered_server_tour():
    done = run_example("ordered_server.py", "--num-workers", 2, "--increments", 10)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "counter 20 at version 20, expected 20" in out  # no increment lost in the race
    assert "(no longer retained)" in out and "pull_if_changed(have_version=2) -> None" in out


def test_exceptions_events_tour():
    done = run_example("exceptions_events.py", "--num-workers", 2)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for text in ["exit code   0  exception None",
                 "exit code   1  ValueError: invalid literal",
                 "exited with code 3: the target called sys.exit(3)",
                 "exited with code 7",
                 "killed by signal SIGKILL (9), signal SIGKILL",
                 "worker-1 failed: caught ZeroDivisionError",
                 "scratch file left behind: False",
                 "the cleaner raised as well: OSError",
                 "round without failures: all 2 finished",
                 "raised ValueError: thread 1 found corrupt input",
                 "after release: all done -> True"]:
        assert text in out, f"{text!r} missing from:\n{out}"
