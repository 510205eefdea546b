"""``python -m machinlike <command>``: tools run from a shell.

    python -m machinlike status ADDRESS [--once] [--json] [--interval S]   a live view of a world
"""

from __future__ import annotations

import sys

from ._status_view import main

__all__: list = []

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
