"""Runs an example script as ``python examples/<script> ...`` would, from a warm process.

Why: an example started as a new interpreter imports torch (about 3.5 s of CPU on the
2-core CI box), then starts the warm forkserver of its ranks, which imports torch again
(about 5 s more), before its first line of work; the suite's thirteen example runs spent
about 100 s on that alone. Here the script runs as ``__main__`` in a child of the
session's "train" warm forkserver (torch, torch._dynamo and machinlike already imported),
and the ranks it launches come from that same server, as they would from its own.

What is the same as a new interpreter: ``__main__`` is the script (its ranks import it
by path, as spawn does), ``sys.argv``, the working directory, the environment, the
script's folder first on ``sys.path``, the exit status (``sys.exit(n)``, an uncaught
exception: 1, a signal: its negative), and stdout/stderr captured at the descriptor level
(so the ranks' output is captured too). What is not: Ctrl-C of a terminal's process group
(``test_example_a3c.py`` starts that one as a real interpreter).
"""

from __future__ import annotations

import builtins
import os
import subprocess
import sys
import tempfile
import types
from collections.abc import Sequence

import _background
from machinlike._warm import warm_context

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

__all__ = ["EXAMPLES", "ROOT", "run_example"]


def _as_main(script: str, argv: Sequence[str], env: dict[str, str], cwd: str, out: str, err: str) -> None:
    for path, fd in ((out, 1), (err, 2)):
        opened = os.open(path, os.O_WRONLY | os.O_TRUNC)
        os.dup2(opened, fd)
        os.close(opened)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [script, *argv]
    sys.path.insert(0, os.path.dirname(script))
    # The script's module becomes this process's __main__ for good, as in an interpreter
    # started on it (runpy.run_path would swap it in only for the run, and objects pickled
    # by reference to __main__ must resolve on any thread, e.g. a pool's result reader).
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script, __builtins__=builtins, __spec__=None, __package__=None)
    sys.modules["__main__"] = sys.modules["__mp_main__"] = main  # the names a child of ours gives it
    with open(script) as source:
        code = compile(source.read(), script, "exec")
    try:
        exec(code, main.__dict__)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def run_example(script: str, args: Sequence[object], *, timeout: float = 150.0,
                env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``examples/<script> *args`` and return what ``subprocess.run(..., text=True,
    capture_output=True)`` would.

    Args:
        script: A file name under ``examples/`` (or a path).
        args: Its command line (each turned into a string).
        timeout: Seconds before the run is SIGKILLed.
        env: Its environment; None: this process's, with the checkout on PYTHONPATH.

    Raises:
        subprocess.TimeoutExpired: It ran past ``timeout`` (it was killed).
    """
    path = script if os.path.isabs(script) else os.path.join(EXAMPLES, script)
    argv = [str(a) for a in args]
    if env is None:
        env = _background.checkout_env()
    with tempfile.TemporaryDirectory(prefix="mlk-example-") as folder:
        out, err = os.path.join(folder, "stdout"), os.path.join(folder, "stderr")
        for name in (out, err):
            open(name, "w").close()
        proc = warm_context("train").Process(target=_as_main, args=(path, argv, dict(env), ROOT, out, err),
                                             name=f"example {os.path.basename(path)}")
        proc.start()
        proc.join(timeout)
        timed_out = proc.is_alive()
        if timed_out:
            proc.kill()
            proc.join(10)
        with open(out, errors="replace") as o, open(err, errors="replace") as e:
            stdout, stderr = o.read(), e.read()
    if timed_out:
        raise subprocess.TimeoutExpired([path, *argv], timeout, stdout, stderr)
    return subprocess.CompletedProcess([sys.executable, path, *argv], proc.exitcode, stdout, stderr)
