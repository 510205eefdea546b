"""Who is in the world: one writer (the Roster), one order (the EventLog).

``Membership`` is the composition root over Registry, Roster, Waits, Endpoint, Claims,
EventLog, Departures, Monitor and ServerNotesPublisher (server_notes: this member's
servers' numbers); beside it live member events, process identity and /proc checks
(processes), how a member ended (exit_causes) and the read-only status view (status).
Imports only the store and transport layers.

This face names what the floors above may use. They reach one of its modules by name only
where the module itself is the seam: callee entry points sent by reference, a process slot
the Session binds, or a family of functions used as a namespace (rendezvous, netif).
"""

from ... import _lean
from .log_tail import LogTail
from .status import (
    connect_read_only, event_counts, MemberStatus, read_status, ReadOnlyStore, ServerNote, WorldStatus,
)

if not _lean.STATUS_TOOL:  # (the status tool needs the reader above only: see machinlike._lean)
    from .processes import alive_here, DEFAULT_LIVENESS, is_here, pid_in, process_identity
    from .roster import Roster
    from .waits import Waits
    from .claims import Claims
    from .departures import Departures
    from .event_log import HOLE_WAIT
    from .endpoint import Endpoint
    from .membership import MemberEvent, Membership
    from .exit_causes import describe_exception, record_exit, record_own_exit

__all__ = [
    "alive_here", "Claims", "connect_read_only", "DEFAULT_LIVENESS", "Departures", "describe_exception", "Endpoint",
    "event_counts", "HOLE_WAIT", "is_here", "LogTail", "MemberEvent", "Membership", "MemberStatus", "pid_in", "process_identity",
    "read_status", "ReadOnlyStore", "record_exit", "record_own_exit", "Roster", "ServerNote", "Waits", "WorldStatus",
]
