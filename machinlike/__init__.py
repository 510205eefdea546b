"""machinlike: distributed and parallel building blocks for PyTorch training.

The package re-exports the main names; each lives in a module that mirrors machin's
``machin.parallel`` layout (``machinlike.distributed``, ``machinlike.server``, ...).
"""

from .distributed import (
    CollectiveGroup,
    RpcGroup,
    World,
    get_cur_name,
    get_cur_rank,
    get_world,
    is_world_initialized,
    launch,
)

__version__ = "0.1.0"

__all__ = [
    "World",
    "RpcGroup",
    "CollectiveGroup",
    "launch",
    "get_world",
    "is_world_initialized",
    "get_cur_rank",
    "get_cur_name",
]
