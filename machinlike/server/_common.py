"""Argument checks shared by the servers' public entrances, and the World's default timeout.

Each public constructor and helper checks its arguments once, here, and hands the
checked, typed values inward; the server's inner parts (reducers, checkpoints, the
objects a host builds for itself) trust them.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

from ..distributed import RpcGroup, get_world

__all__ = ["check_name", "check_group", "check_timeout", "check_count", "check_members", "rpc_timeout"]


def check_name(value: Any, param: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{param} must be a str, not {type(value).__name__} ({value!r})")
    if not value:
        raise ValueError(f"{param} must be a non-empty string")
    return value


def check_group(group: Any, param: str = "group") -> RpcGroup:
    if not isinstance(group, RpcGroup):
        raise TypeError(f"{param} must be an RpcGroup (world.create_rpc_group(...)), not {type(group).__name__}")
    return group


def check_timeout(timeout: Any, param: str = "timeout") -> Optional[float]:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
        raise ValueError(f"{param}={timeout!r} must be a positive number of seconds, or None for the "
                         f"world's rpc_timeout")
    return float(timeout)


def check_count(value: Any, param: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{param} must be an int, not {type(value).__name__} ({value!r})")
    if value < minimum:
        raise ValueError(f"{param}={value} must be at least {minimum}")
    return value


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


def rpc_timeout() -> float:
    """The World's ``rpc_timeout`` in seconds: what a server's ``timeout=None`` stands for.

    Raises:
        RuntimeError: this process has no World (a server's group lives in one).
    """
    world = get_world()
    if world is None:
        raise RuntimeError("no World in this process: a server's calls need the World its group belongs to")
    return world.rpc_timeout
