"""This process's current World (set by ``World``) and the functions that ask for it."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from .world import World

__all__ = ["current", "lock", "require_world", "get_world", "is_world_initialized", "get_cur_rank", "get_cur_name"]

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


def get_world() -> Optional["World"]:
    """This process's World, None if there is none (or it was stopped)."""
    return current


def is_world_initialized() -> bool:
    """Whether this process has a running World."""
    return current is not None


def get_cur_rank() -> int:
    """Rank of this process.

    Raises:
        RuntimeError: this process has no World.
    """
    return require_world().rank


def get_cur_name() -> str:
    """Member name of this process.

    Raises:
        RuntimeError: this process has no World.
    """
    return require_world().name
