"""What a rank runs: ``fn(world, *args, **kwargs)``; an ``async def`` fn in an event loop;
what it raised recorded as the member's exit cause.

Why: asyncio programs (actors that await their calls, ``await group.registered_async``)
write their rank function as ``async def main(world)``; each rank runs it with
``asyncio.run``, a loop of its own that is closed when the function ends.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import TYPE_CHECKING, Any, Callable, Dict, Optional, Sequence

from ... import _checks

if TYPE_CHECKING:
    from .._world import World

__all__ = ["check_rank_fn", "run_rank_fn"]


def check_rank_fn(fn: Any) -> None:
    """Raise TypeError for a ``fn`` no rank can run (not callable, an async generator)."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")
    if not inspect.iscoroutinefunction(fn):
        _checks.not_async("fn", fn, "in each rank")


def run_rank_fn(fn: Callable[..., Any], world: "World", args: Sequence[Any], kwargs: Optional[Dict[str, Any]]) -> Any:
    """``fn``'s result in this rank; a coroutine it returns runs to its end first.

    Raises:
        BaseException: what ``fn`` raised, once it is recorded as the member's exit cause
            (:meth:`World.note_exit`: before the launcher hears of it, which may end the rank).
    """
    try:
        result = fn(world, *args, **(kwargs or {}))
        if inspect.iscoroutine(result):
            return asyncio.run(result)
        return result
    except BaseException as exc:
        world.note_exit(exc)  # (a no-op in a child that fn forked: that World is its parent's)
        raise
