"""This process's current World: set by ``World``, read by groups and entry points."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from ._world import World

__all__ = ["current", "lock", "require_world"]

#: The running World of this process, None when there is none.
current: Optional["World"] = None
#: Held while a World claims or releases ``current``.
lock = threading.Lock()


def require_world() -> "World":
    """This process's World.

    Raises:
        RuntimeError: there is none.
    """
    world = current
    if world is None:
        raise RuntimeError("no World in this process: create one first, e.g. World(rank=..., world_size=...)")
    return world
