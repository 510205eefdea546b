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

import ast
import functools
import multiprocessing.process
import os
import sys
from typing import FrozenSet, Optional

__all__ = ["EXIT_CODE", "EXPLANATION", "check", "check_main_file", "starting", "explain", "note_guarded_name"]

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


def note_guarded_name(exc: BaseException) -> None:
    """Explain a NameError raised in a spawned child for a name that the script defines
    under its ``if __name__ == "__main__":`` block, which the child skipped when it
    imported the script as ``__mp_main__`` (a pool's lambda, a rank's body or a function
    run over RPC using such a name): the most common surprise for users of ``fork``.

    Adds a note (``exc.add_note``) with the fix; does nothing for any other exception.
    """
    if not isinstance(exc, NameError):
        return
    name = getattr(exc, "name", None)
    main = sys.modules.get("__main__")
    if not name or getattr(main, "__name__", None) != "__mp_main__":
        return
    path = getattr(main, "__file__", None)
    if not isinstance(path, str) or name not in _guarded_names(path):
        return
    if any(note.startswith(f"{name!r} is defined under") for note in getattr(exc, "__notes__", ())):
        return  # (carried once already, then again: said once)
    exc.add_note(f"{name!r} is defined under the script's `if __name__ == \"__main__\":` block, which this process "
                 f"(pid {os.getpid()}) skipped: a spawned process imports the script as '__mp_main__'. Pass it as "
                 f"an argument (launch(fn, n, args=(...)) gives it to every rank) or define it at module level "
                 f"(a Pool can also send the globals its functions use: Pool(is_recursive=True))")


@functools.lru_cache(maxsize=4)
def _guarded_names(path: str) -> FrozenSet[str]:
    """The global names a script binds under its ``if __name__ == "__main__":`` blocks."""
    try:
        with open(path, encoding="utf-8") as source:
            tree = ast.parse(source.read(), path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return frozenset()
    names: set = set()
    for node in tree.body:
        if isinstance(node, ast.If) and _is_main_test(node.test):
            for statement in node.body:
                _bound(statement, names)
    return frozenset(names)


def _is_main_test(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = {ast.dump(test.left), ast.dump(test.comparators[0])}
    return sides == {ast.dump(ast.Name("__name__", ast.Load())), ast.dump(ast.Constant("__main__"))}


def _bound(node: ast.AST, names: set) -> None:
    """Add the names ``node`` binds at the level it runs at (not inside functions or classes)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        names.add(node.name)
        return
    if isinstance(node, (ast.Import, ast.ImportFrom)):
        names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        return
    if isinstance(node, (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
        return  # their own scopes
    if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
        names.add(node.id)
        return
    for child in ast.iter_child_nodes(node):
        _bound(child, names)
