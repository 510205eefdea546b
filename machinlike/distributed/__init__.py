"""Distributed core: World, RpcGroup, CollectiveGroup, the local launcher and the Ray launcher."""

from ._calls import RpcFuture
from ._collective import CollectiveGroup
from ._debug import debug_with_process
from ._launch import LaunchResult, Restart, launch
from ._ray import launch_ray
from ._rpc_group import RpcGroup
from ._membership import MemberEvent, Membership
from ._refs import PairedRef, ResultRef
from ._samehost import share
from ._world import World, get_cur_name, get_cur_rank, get_world, is_world_initialized

__all__ = [
    "World",
    "MemberEvent",
    "Membership",
    "RpcGroup",
    "CollectiveGroup",
    "RpcFuture",
    "PairedRef",
    "ResultRef",
    "launch",
    "LaunchResult",
    "Restart",
    "launch_ray",
    "get_world",
    "is_world_initialized",
    "get_cur_rank",
    "get_cur_name",
    "debug_with_process",
    "share",
]
