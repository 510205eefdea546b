"""What a rank runs: ``fn(world, *args, **kwargs)``; an ``async def`` fn in an event loop;
what it raised recorded as the member's exit cause.

Why: asyncio programs (actors that await their calls, ``await group.registered_async``)
write their rank function as ``async def main(world)``; each rank runs it with
``asyncio.run``, a loop of its own that is closed when the function ends.
"""

from __future__ import annotations

import asyncio
import difflib
import inspect
import os
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence

from ... import _checks
from ...exception import ProcessExitedError

if TYPE_CHECKING:
    from .._world import World

__all__ = ["RESERVED", "check_rank_call", "check_rank_fn", "check_world_kwargs", "rank_names", "run_rank_fn"]


def check_rank_fn(fn: Any) -> None:
    """Raise TypeError for a ``fn`` no rank can run (not callable, an async generator)."""
    if not callable(fn):
        raise TypeError(f"fn must be callable, not {type(fn).__name__}")
    if not inspect.iscoroutinefunction(fn):
        _checks.not_async("fn", fn, "in each rank")


def check_rank_call(fn: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]]) -> None:
    """Raise TypeError when ``fn``'s signature cannot take ``(world, *args, **kwargs)``
    (said here, not by every rank once started); a ``fn`` without one passes."""
    args, kwargs = _checks.call_args(args, kwargs)
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin or an object without one: the ranks will tell
        return
    try:
        signature.bind(None, *args, **kwargs)
    except TypeError as err:
        name = getattr(fn, "__qualname__", repr(fn))
        raise TypeError(f"fn={name}{signature} cannot be called as fn(world, *args, **kwargs) with "
                        f"{len(args)} argument(s) in args and kwargs {sorted(kwargs)}: {err}; each rank calls it "
                        f"with its World first (def {getattr(fn, '__name__', 'fn')}(world, ...))") from None


#: World keywords a launcher sets itself for each rank.
RESERVED = frozenset({"rank", "world_size", "store", "init_method", "name"})


def check_world_kwargs(who: str, world_kwargs: Dict[str, Any]) -> None:
    """Raise TypeError naming what in ``world_kwargs`` (the rest of ``who``'s keywords,
    passed to each rank's World) is no keyword of :class:`World` or one ``who`` sets itself
    (``RESERVED``), with the closest keyword World has (said here, not by every rank)."""
    from .._world import World

    taken = sorted(RESERVED & set(world_kwargs))
    if taken:
        raise TypeError(f"{who} sets {taken} itself; do not pass them")
    known = set(inspect.signature(World.__init__).parameters) - {"self"} - RESERVED
    unknown = sorted(set(world_kwargs) - known)
    if unknown:
        close = difflib.get_close_matches(unknown[0], known, 1)
        raise TypeError(f"{who} got an unexpected keyword argument {unknown[0]!r}, neither its own nor World's"
                        + (f": did you mean {close[0]}=?" if close else f" (World takes {sorted(known)})"))
    # The plain numbers here, not seconds later in every rank (World checks the rest there).
    for param in ("rpc_timeout", "dist_timeout"):
        if param in world_kwargs:
            _checks.seconds(param, world_kwargs[param])
    if world_kwargs.get("liveness") is not None:
        _checks.seconds("liveness", world_kwargs["liveness"], or_none=True)
    if "rpc_threads" in world_kwargs:
        _checks.positive_int("rpc_threads", world_kwargs["rpc_threads"])


def rank_names(names: Optional[Sequence[Any]], world_size: int) -> List[str]:
    """The member name of each rank: ``names`` as str, or ``"0"``, ``"1"``, ... for None.

    Raises:
        ValueError: not one name per rank, a name twice, or a name World refuses (named).
        TypeError: ``names`` is a str (one name, not a list of them).
    """
    if names is None:
        return [str(r) for r in range(world_size)]
    if isinstance(names, str):
        raise TypeError(f"names={names!r} must be a sequence of names, one per rank, not one str")
    out = [str(n) for n in names]
    if len(out) != world_size:
        raise ValueError(f"names has {len(out)} entries; world_size is {world_size}")
    for i, name in enumerate(out):
        _checks.member_name(name, f"names[{i}]")
    twice = sorted({n for n in out if out.count(n) > 1})
    if twice:
        raise ValueError(f"names={out!r} holds {twice} more than once: each rank needs its own member name")
    return out


def run_rank_fn(fn: Callable[..., Any], world: "World", args: Sequence[Any], kwargs: Optional[Dict[str, Any]],
                reported_as: Optional[str] = None) -> Any:
    """``fn``'s result in this rank; a coroutine it returns runs to its end first.

    Args:
        reported_as: The rank's process name where its outcome goes to a launcher as a
            report (``launch``'s own ranks, Ray's): then ``sys.exit(0)`` (or None) in ``fn``
            is a result of None, ``sys.exit(n)`` a ProcessExitedError and a
            KeyboardInterrupt a RuntimeError, never what the launcher would re-raise as its
            own (a SystemExit ended the launching script in silence, with the rank's exit
            code; cold trial 28). None (torchrun, srun: the rank is the process) lets them
            end the process as they would.

    Raises:
        BaseException: what ``fn`` raised, once it is recorded as the member's exit cause
            (:meth:`World.note_exit`: before the launcher hears of it, which may end the rank).
    """
    me = os.getpid()
    try:
        try:
            result = fn(world, *args, **(kwargs or {}))
            if inspect.iscoroutine(result):
                return asyncio.run(result)
            return result
        except SystemExit as exc:
            if reported_as is None or os.getpid() != me:  # (or in a child fn forked: its own exit)
                raise
            if exc.code in (None, 0):
                return None  # (what a script that exits 0 means: done)
            code = exc.code if isinstance(exc.code, int) else 1
            raise ProcessExitedError(reported_as, os.getpid(), code, f"fn called sys.exit({exc.code!r})") from exc
        except KeyboardInterrupt as exc:
            if reported_as is None or os.getpid() != me:
                raise
            # (re-raised in the launcher it read as the user's Ctrl-C there, past every
            # ``except Exception``; a rank ignores the terminal's Ctrl-C, so fn's code raised it)
            raise RuntimeError(f"{reported_as}: fn raised KeyboardInterrupt (its own code did: a rank ignores the "
                               f"terminal's Ctrl-C, which ends the launcher)") from exc
    except BaseException as exc:
        world.note_exit(exc)  # (a no-op in a child that fn forked: that World is its parent's)
        raise
