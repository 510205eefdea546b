"""The World: one per process, the composition of every layer below.

Owns the frozen Settings, the Session (each start step with its undo), leaving and
stopping, this process's current World, and ``debug_with_process``.

This face names what the layers above may use; the modules behind it are private to it.
"""

from .world import get_cur_name, get_cur_rank, get_world, is_world_initialized, World
from .debug import debug_with_process

__all__ = [
    "debug_with_process", "get_cur_name", "get_cur_rank", "get_world", "is_world_initialized",
    "World",
]
