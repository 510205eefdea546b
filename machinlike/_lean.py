"""Whether this process is the status tool, ``python -m machinlike status ...``.

Why: runpy imports the package before the tool runs, and the status view reaches its
store reader through the ``distributed`` and ``distributed._membership`` packages; the
three faces re-export everything, which cost about a second of wall time beyond torch's
own import on a busy 2-core box (BENCHMARKS.md, "The status view's start"), before the
tool could say anything. In that process alone the three faces import only what the view
needs. Every other process, ``import machinlike`` included, gets the whole package.
"""

from __future__ import annotations

import sys
from typing import Sequence

__all__ = ["STATUS_TOOL", "status_tool"]


def status_tool(argv: Sequence[str], orig_argv: Sequence[str]) -> bool:
    """Whether ``sys.argv``/``sys.orig_argv`` are those of ``python -m machinlike status``
    while runpy locates the module (``sys.argv[0]`` is ``"-m"`` until it runs it)."""
    if list(argv[:1]) != ["-m"]:
        return False
    for i, arg in enumerate(orig_argv):
        if arg == "-m":
            module, rest = orig_argv[i + 1:i + 2], orig_argv[i + 2:]
        elif arg.startswith("-m"):
            module, rest = [arg[2:]], orig_argv[i + 1:]
        else:
            continue
        return list(module) == ["machinlike"] and list(rest[:1]) == ["status"]
    return False


#: Read once, when the package is first imported (runpy sets ``sys.argv[0]`` afterwards).
STATUS_TOOL = status_tool(sys.argv, getattr(sys, "orig_argv", ()))
