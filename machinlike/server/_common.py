"""Argument checks and small pieces shared by the server modules."""

from __future__ import annotations

from typing import Any, Optional

from ..distributed import RpcGroup

__all__ = ["check_name", "check_group", "check_timeout", "check_count"]


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
