"""The ground floor beside the store: torch's RPC agents, and nothing above them.

Owns starting, swapping and shutting down this process's TensorPipe agents (static and
dynamic groups, the agents retired and reaped), torch's dynamic-group protocol in the store,
elastic workers' names and torch's 16-bit worker ids, the agent probe, the listener watch,
the pipe ledger and network interfaces. The one folder a torch upgrade has to check: every
use of torch's private RPC internals lives here.

This face names what the floors above may use. They reach one of its modules by name only
where the module itself is the seam: callee entry points sent by reference, a process slot
the Session binds, or a family of functions used as a namespace (rendezvous, netif).
"""

from .agent import (
    ELASTIC_CHANNELS, claim_worker_id, closed_agent_error, introduce_current, no_agent_error, renewing,
    set_default_timeout, start_dynamic, start_static, wait_current, wait_steady,
)
from . import lane
from .agents import pool_threads, reap_retired, shutdown
from .dynamic_group import forget_retired, prune_workers, published_address, token_holder
from .listener import ListenerWatch
from .pipes import PipeLedger, recycle_after
from .probe import AgentProbe
from .workers import ID_SPACE_ENV, id_held, id_space, worker_seq

__all__ = [
    "ELASTIC_CHANNELS", "AgentProbe", "ListenerWatch", "lane", "PipeLedger", "ID_SPACE_ENV", "claim_worker_id",
    "closed_agent_error",
    "forget_retired", "id_held", "id_space", "introduce_current", "no_agent_error", "pool_threads",
    "prune_workers", "published_address", "reap_retired", "recycle_after", "renewing", "set_default_timeout", "shutdown",
    "start_dynamic", "start_static", "token_holder", "wait_current", "wait_steady", "worker_seq",
]
