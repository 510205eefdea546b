"""Argument checks shared by the servers' public entrances (in the package's wording,
``machinlike._checks``), the World's default timeout, and where a server hands its
numbers to the status view (:func:`publish_notes`).

Each public constructor and helper checks its arguments once, here, and hands the
checked, typed values inward; the server's inner parts (reducers, checkpoints, the
objects a host builds for itself) trust them.
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, Sequence

from .. import _checks
from ..distributed import RpcGroup, World, get_world
from ..distributed._store import ServerNote

__all__ = ["check_name", "check_group", "check_timeout", "check_count", "check_members", "rpc_timeout",
           "current_world", "publish_notes", "ServerNote"]


def check_name(value: Any, param: str) -> str:
    return _checks.nonempty_str(param, value)


def check_group(group: Any, param: str = "group") -> RpcGroup:
    if not isinstance(group, RpcGroup):
        raise TypeError(f"{param} must be an RpcGroup (world.create_rpc_group(...)), not {type(group).__name__}")
    return group


def check_timeout(timeout: Any, param: str = "timeout") -> Optional[float]:
    """None (the World's ``rpc_timeout`` or ``dist_timeout``, as documented) or positive seconds."""
    return _checks.seconds_or_none(param, timeout)


def check_count(value: Any, param: str, minimum: int) -> int:
    return _checks.positive_int(param, value, minimum)


def check_members(group: RpcGroup, members: Optional[Sequence[str]], param: str) -> List[str]:
    """``members`` checked against the group (None: every member), as a list.

    Raises:
        TypeError: not a list of str.
        ValueError: empty, repeated, or not members of ``group`` (listed).
    """
    everyone = group.get_group_members()
    if members is None:
        return everyone
    if isinstance(members, str) or not all(isinstance(m, str) for m in members):
        raise TypeError(f"{param} must be a list of member names, not {members!r}")
    chosen = list(members)
    strangers = [m for m in chosen if m not in everyone]
    if not chosen or strangers or len(set(chosen)) != len(chosen):
        raise ValueError(f"{param}={chosen!r} must be distinct members of group {group.get_group_name()!r} "
                         f"({everyone}); not members: {strangers}")
    return chosen


def current_world() -> World:
    """This process's World.

    Raises:
        RuntimeError: there is none (a server's group lives in one).
    """
    world = get_world()
    if world is None:
        raise RuntimeError("no World in this process: a server's calls need the World its group belongs to")
    return world


def rpc_timeout() -> float:
    """The World's ``rpc_timeout`` in seconds: what a server's ``timeout=None`` stands for.

    Raises:
        RuntimeError: this process has no World (a server's group lives in one).
    """
    return current_world().rpc_timeout


def publish_notes(notes: Callable[[], Sequence[ServerNote]]) -> Callable[[], None]:
    """Have this member's World write ``notes()`` into its store every few seconds, for
    ``python -m machinlike status`` (see ``distributed._membership.server_notes``).

    Args:
        notes: A server's bound method (held weakly) returning its numbers; called on the
            publisher's thread, so it must be cheap and send nothing.

    Returns:
        ``withdraw()``, for the server's ``close()`` (safe to call twice).
    """
    world = get_world()
    if world is None:
        return lambda: None
    return world.membership.server_notes.add(notes)
