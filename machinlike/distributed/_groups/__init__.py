"""RpcGroup and CollectiveGroup, built from the layers below.

Owns the group façade and its typed parts (owner cache, service and value tables, caller,
barrier), this process's group directory and group creation, and collective groups over
subsets of ranks.

This face names what the floors above may use. They reach one of its modules by name only
where the module itself is the seam: callee entry points sent by reference, a process slot
the Session binds, or a family of functions used as a namespace (rendezvous, netif).
"""

from .collective import CollectiveGroup, RetiredGroups
from .collective_failures import FailureNamer
from .directory import GroupDirectory, GroupHandle
from .create import create_group, find_group, open_group
from .creation_order import CreationOrder
from .rpc_group import RpcGroup

__all__ = [
    "CollectiveGroup", "create_group", "CreationOrder", "FailureNamer", "find_group", "GroupDirectory", "GroupHandle",
    "open_group", "RetiredGroups", "RpcGroup",
]
