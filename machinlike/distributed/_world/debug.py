"""``debug_with_process``: machin's debug-log helper, on the standard ``logging`` module."""

from __future__ import annotations

import logging
import os
import sys

from .world import get_world

__all__ = ["debug_with_process"]

log = logging.getLogger("machinlike.distributed")


def debug_with_process(message: str) -> None:
    """Log ``message`` at DEBUG level, prefixed with this process's rank and the caller.

    The record goes to the ``machinlike.distributed`` logger and reads
    ``Process [<rank>]: <file,L<line>> <message>`` (machin's format); the rank is the
    World's, or ``pid <n>`` in a process without a World. Nothing is formatted when
    DEBUG is not enabled for that logger (machin checked its own logger the same way).

    Args:
        message: The text to log.
    """
    if not log.isEnabledFor(logging.DEBUG):
        return
    world = get_world()
    who = str(world.rank) if world is not None else f"pid {os.getpid()}"
    caller = sys._getframe(1)  # the caller's frame: cheaper than inspect.stack()
    log.debug("Process [%s]: <%s,L%d> %s", who, caller.f_code.co_filename, caller.f_lineno, message)
