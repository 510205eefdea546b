"""A process that is still being started must not start processes, pools or Worlds.

Why: the ``spawn`` and ``forkserver`` start methods (machinlike's pools, processes and
``launch()`` use a forkserver by default) run the script's main module again in every new
process, as ``__mp_main__``, before its target. A script that makes a Pool, starts a
Process, ``launch()``es ranks or builds a World at import time, outside ``if __name__ ==
"__main__":``, does it again in each child. ``multiprocessing`` stops such a child with a
RuntimeError on its stderr and exit code 1, so its parent could only say "exited with
code 1" (a pool: three times, then "broken"; ``launch``: "ended without reporting a
result", after restarting it). Users who come from the ``fork`` start method, where the
script is not imported again, meet this first::

    child, importing the script's main module      parent
      Pool(...), Process.start(), launch(...),
      World(...): check(what)
        still being started? ── yes ──► a message on its stderr, os._exit(EXIT_CODE)
                                        sees EXIT_CODE and no report of the child's:
                                        the error carries ``EXPLANATION`` (the fix);
                                        a pool breaks and ``launch`` fails at once
                                        (a restart would do the same again)

``os._exit`` and not an exception: the forkserver's child turns any exception, even a
``SystemExit``, into exit code 1, and the child cannot be saved either way.
"""

from __future__ import annotations

import multiprocessing.process
import os
import sys
from typing import Optional

__all__ = ["EXIT_CODE", "EXPLANATION", "check", "check_main_file", "starting", "explain"]

#: The exit code of a child stopped by ``check``: outside sysexits' 64-78, and not 1 or 2.
EXIT_CODE = 86

#: What a parent's error says of such a child.
EXPLANATION = (
    "it stopped before it ran anything of yours: while it started, it imported the script's main module "
    "again (the 'spawn' and 'forkserver' start methods do so in every new process), and that module starts "
    "processes, pools, ranks or a World at import time; put the script's entry point under "
    "`if __name__ == \"__main__\":` (the child's stderr names the call)")


def starting() -> bool:
    """Whether this process is a child that ``multiprocessing`` is still starting (it is
    importing the parent's main module, or loading its process object)."""
    return bool(getattr(multiprocessing.process.current_process(), "_inheriting", False))


def check(what: str) -> None:
    """Stop this process at once, saying why, when it is still being started (see the
    module docstring); otherwise do nothing.

    Args:
        what: The call, as the user wrote it (``"Pool(...)"``).
    """
    if not starting():
        return
    try:
        sys.stdout.flush()
    except Exception:  # (a closed or odd stdout: the message below matters more)
        pass
    try:
        sys.stderr.write(
            f"machinlike: {what} was called while this process (pid {os.getpid()}) was still being started: "
            f"the 'spawn' and 'forkserver' start methods import the script's main module again in every new "
            f"process, so code that starts processes, pools, ranks or a World must run only under "
            f"`if __name__ == \"__main__\":`; this process stops (exit code {EXIT_CODE})\n")
        sys.stderr.flush()
    finally:
        os._exit(EXIT_CODE)


def check_main_file(what: str, method: Optional[str]) -> None:
    """Raise before anything starts when start method ``method`` cannot start a child of
    this script: ``spawn`` and ``forkserver`` run its main module again in every new process,
    by its path, and that path is no file (a script read from stdin, ``python - < x.py``).
    Without this, each child failed to start, and the parent said only that it exited with
    code 1 (a pool: broken after three tries).

    Raises:
        RuntimeError: so; the message says the fix.
    """
    if method == "fork":
        return
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if path is None or getattr(main, "__spec__", None) is not None:
        return  # python -c, a notebook or a prompt (nothing to run again); python -m (run by name)
    if not os.path.isabs(path):
        path = os.path.join(getattr(multiprocessing.process, "ORIGINAL_DIR", None) or os.getcwd(), path)  # (as spawn)
    if os.path.isfile(path):
        return
    raise RuntimeError(
        f"{what} cannot start processes from this script: the {method!r} start method runs its main module again "
        f"in every new process, by its path, and {path!r} is not a file (a script read from stdin?); save the "
        f"script to a file and run `python script.py`")


def explain(exitcode: Optional[int]) -> str:
    """``EXPLANATION`` for a child that ended with ``EXIT_CODE`` without a report of its
    own; else ""."""
    return EXPLANATION if exitcode == EXIT_CODE else ""
