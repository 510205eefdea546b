"""The ground floor: the c10d store a world meets on.

Owns opening or reaching the store (rendezvous: explicit addresses, torchrun and SLURM
environments), the spelling of every key and its typed value (keys), one-round-trip tables
over the store (registry), a connection of a thread's own (client), this process's
connections to it, to cut when it falls silent (connections), a store its host is closing
told apart from the next world's (closing), and look-ups bounded by a
deadline on their own thread (lookups), and whether this process is a child forked from
a World's (forked). It imports no other layer.

This face names what the floors above may use. They reach one of its modules by name only
where the module itself is the seam: callee entry points sent by reference, a process slot
the Session binds, or a family of functions used as a namespace (rendezvous, netif).
"""

from .rendezvous import connect_store, external_launcher, host_store, resolve_rank_and_size
from .keys import (
    ExitRecord, FAILED_MARK, GroupRecord, Keys, LogEntry, LOST_MARK, MemberRecord, OPEN_EPOCH, OwnedKey, rebind_holder,
    ServerNote, ServerNotes, ServiceOwner, STOPPED_MARK, WOKEN_MARK, MAX_EXIT_CAUSE,
)
from .registry import STORE_OF_RANK0, Registry
from .client import multi_get, new_client, own_client, server_of, store_address, value_or_empty
from .connections import IP, connections_to, shut_down
from .closing import mark_closing
from . import forked

__all__ = [
    "connect_store", "connections_to", "ExitRecord", "external_launcher", "FAILED_MARK", "forked", "GroupRecord",
    "host_store", "IP", "Keys", "LogEntry", "LOST_MARK", "mark_closing", "MAX_EXIT_CAUSE", "MemberRecord", "multi_get", "new_client",
    "OPEN_EPOCH",
    "own_client", "OwnedKey", "rebind_holder", "Registry", "resolve_rank_and_size", "server_of", "ServerNote",
    "ServerNotes", "ServiceOwner", "shut_down", "STOPPED_MARK", "store_address", "STORE_OF_RANK0", "value_or_empty",
    "WOKEN_MARK",
]
