"""World stop: ``stop(timeout)`` never waits past its deadline.

Static: a stop barrier (a lost member wakes it at once), a graceful RPC shutdown only when
every peer arrived, else a local one. Elastic: free this member's keys, post "leave", stop
RPC locally. The session's undo (``Session.close``) runs afterwards in any case, so a
failed stop never keeps the process from building a new World.

    leave_static   w/stop/<rank> barrier -> RPC shutdown (graceful when all came)
                   -> destroy the process group -> w/left/<rank> (the store's host waits
                   for the others: they still need the store)
    leave_elastic  destroy this member's groups -> Membership.leave -> the store's host
                   waits for the others to leave -> RPC shutdown (local)

RPC's shutdown waits for the calls this member still serves, within what is left of the
stop's time (at least 1 s; half a second once the store is gone: the world is over); a
call that outlasts it does not hold the stop (_transport.agent_stop).
"""

from __future__ import annotations

import datetime
import logging

from ..._deadline import deadline_left
from .._store import mark_closing
from .session import Session

__all__ = ["leave_static", "leave_elastic"]

log = logging.getLogger(__name__)


def leave_static(session: Session, deadline: float, wait: float) -> None:
    """The static stop barrier and shutdown (see the module doc).

    Args:
        deadline: ``time.monotonic()`` deadline of the whole stop.
        wait: The caller's timeout, quoted in messages.
    """
    members, info, s = session.membership, session.store, session.settings
    if members is None or info is None:  # start-up failed before the store: nothing to leave
        return
    if info.hosted_here:  # (before any rank may leave: see _store.closing)
        mark_closing(info.store)
    everyone = False
    names = [str(r) for r in range(s.size)]
    order = members.roster.names_by_rank()
    try:
        members.registry.add(members.keys.stop_count(), 1)  # (the others' waits end: _membership.stops)
        members.registry.set(members.keys.stop_prefix() + str(s.rank), "1")
        members.waits.wait_all(members.keys.stop_prefix(), names, order, deadline_left(deadline),
                               "World.stop: ranks", wait)
        everyone = session.rpc is None or members.members() == sorted(order)
    except (TimeoutError, ConnectionError) as err:
        log.warning("World %r stops without its peers: %s", s.name, err)
    # (a stop whose own requests found the store gone is cut off, whether or not the
    # liveness thread has said so yet: the race held the stop for the whole time a call it
    # served ran, up to its timeout; the test of cold trial 24 saw it in CI)
    cut_off = members.roster.cut_off is not None or members.registry.unreachable
    members.close()
    if session.rpc is not None:
        if everyone:  # (bounds the graceful shutdown's waits in the store)
            (session.rpc_store or info.store).set_timeout(datetime.timedelta(seconds=max(deadline_left(deadline), 0.5)))
        session.rpc(everyone, _serving_time(deadline, cut_off))
    if session.process_group is not None:
        session.process_group()
    if not everyone:
        return
    try:
        members.registry.set(members.keys.left_prefix() + str(s.rank), "1")
        if info.hosted_here:
            # Peers may still be talking to the store inside their own shutdown.
            members.waits.wait_all(members.keys.left_prefix(), names[1:], order[1:], deadline_left(deadline),
                                   "World.stop: ranks leaving", wait)
    except (TimeoutError, ConnectionError) as err:
        log.warning("World %r closes its store before all peers left: %s", s.name, err)


def leave_elastic(session: Session, deadline: float) -> None:
    """Leave an elastic world: withdraw this member's groups and keys, tell the others."""
    members, info, name = session.membership, session.store, session.settings.name
    if members is None or info is None:
        return
    if info.hosted_here:  # (a member that joins from now on waits for the next store: see _store.closing)
        mark_closing(info.store)
    members.claims.leaving()  # (what the groups withdraw now goes with this member: its departure says so)
    if session.groups is not None:
        for group in session.groups.local_groups():
            group.destroy()
    members.leave(deadline)
    if info.hosted_here:
        try:
            members.wait_others_gone(deadline_left(deadline))
        except TimeoutError as err:
            log.warning("World %r closes the store while members remain: %s", name, err)
    cut_off = members.roster.cut_off is not None or members.registry.unreachable
    members.close()
    if session.rpc is not None:  # calls this member still serves get what is left of the stop's time
        session.rpc(False, _serving_time(deadline, cut_off, least=0.0))


#: Seconds the calls a member still serves get at its stop once its store is gone.
CUT_OFF_SERVING_S = 0.5


def _serving_time(deadline: float, cut_off: bool, least: float = 0.5) -> float:
    """What the calls this member still serves get of the stop's time.

    Why less once cut off: with its store gone the world is over, and every caller is
    cut off too (or is within a tick); waiting out a long service held the stop for its
    whole timeout, and the service's caller heard nothing for as long (cold trial 24).
    """
    left = max(deadline_left(deadline), least)
    return min(left, CUT_OFF_SERVING_S) if cut_off else left
