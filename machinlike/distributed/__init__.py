"""Distributed core: World, RpcGroup, CollectiveGroup, the local launcher and the Ray launcher."""

# Layers, bottom up (docs/architecture.rst): _store and _transport, _membership, _calls,
# _groups, _world, _launch; each imports only those below it, through its face.
from .. import _lean

if not _lean.STATUS_TOOL:  # (the status tool reads the store only: see machinlike._lean)
    from ._membership import MemberEvent, Membership
    from ._calls import PairedRef, ResultRef, RpcFuture, share
    from ._groups import CollectiveGroup, RpcGroup
    from ._world import World, debug_with_process, get_cur_name, get_cur_rank, get_world, is_world_initialized
    from ._launch import LaunchResult, Restart, launch, launch_ray
    from ._store import external_launcher

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
    "external_launcher",
    "get_world",
    "is_world_initialized",
    "get_cur_rank",
    "get_cur_name",
    "debug_with_process",
    "share",
]
