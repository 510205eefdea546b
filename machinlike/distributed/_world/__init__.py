"""The World: one per process, the composition of every layer below.

Owns the frozen Settings, the Session (each start step with its undo), leaving and
stopping, this process's current World, and ``debug_with_process``.

This face names what the floors above may use. They reach one of its modules by name only
where the module itself is the seam: callee entry points sent by reference, a process slot
the Session binds, or a family of functions used as a namespace (rendezvous, netif).
"""

from .world import get_cur_name, get_cur_rank, get_world, is_world_initialized, World
from .debug import debug_with_process

__all__ = [
    "debug_with_process", "get_cur_name", "get_cur_rank", "get_world", "is_world_initialized",
    "World",
]
