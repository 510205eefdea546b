"""``python -m machinlike <command>``: tools run from a shell.

    python -m machinlike status ADDRESS [--once] [--json] [--interval S]   a live view of a world

The package's faces import only the status view's needs in this process (see ``_lean``);
torch's own import still takes seconds, so the tool says first, on a terminal, what it is
about to do, and it ends without tearing torch down.
"""

from __future__ import annotations

import os
import sys
from typing import Sequence, TextIO

__all__: list = []


def announce(argv: Sequence[str], err: TextIO) -> None:
    """On a terminal (``err`` a TTY), say at once which store ``status`` is about to read.

    Why: torch's import comes first, 3 to 5 s on an idle 2-core box and 20 s or more on a
    busy one, and nothing showed until the first view (trial 7). Only on a terminal: stdout
    stays the view or pure JSON, and a script's captured stderr gets nothing new.
    """
    args = list(argv)
    if args[:1] != ["status"] or "-h" in args or "--help" in args or not err.isatty():
        return
    address = next((a for a in args[1:] if not a.startswith("-")), None)
    if address is not None:
        print(f"machinlike status: reading the world's store at {address} (torch loads first: a few seconds, "
              f"more on a busy machine) ...", file=err, flush=True)


def _end(code: int) -> None:
    """Flush and end the process without the interpreter's teardown.

    Why: tearing torch's modules down took about 1.1 s after the view was printed (a quarter
    of the tool's time on an idle 2-core box); the tool holds nothing that needs it (a
    read-only store client: the kernel closes its socket).
    """
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (BrokenPipeError, ValueError):  # (a reader that went away: nothing more to say)
        code = code or 1
    os._exit(code)


if __name__ == "__main__":
    announce(sys.argv[1:], sys.stderr)
    # torch reads this as it loads (next line): its store client logged a page of C++ frames
    # for each retry against a port that answers but is no store, above the tool's one line
    # (cold trial 30). The tool's errors say what went wrong; a user's own setting wins.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
    from ._status_view import main

    _end(main(sys.argv[1:]))
