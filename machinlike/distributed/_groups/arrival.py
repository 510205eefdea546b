"""wait_paired / wait_registered: a value or a service once some member holds it, in a
world whose members start at their own pace.

Why: an elastic world's actors start before, with or after their learner, and an open
group has no barrier; ``get_paired`` raises ``KeyError`` at once for a value not paired
yet, so users wrote sleep loops over ``is_paired`` (cold trial 11). The store says when a
key first appears, so the common case waits without a request::

    look the key up (get_paired; a service's owner) ── found ──► its handle (or return)
        │ nobody holds it
        ├─ its claim key was never made: wait in the store for it (one blocked request;
        │  the first pair makes it), then look again
        └─ it was held before (its holder withdrew it, left or was lost; a restarted
           holder pairs it again): look again at each change of membership, and at
           least every RECHECK seconds (a claim freed and taken again leaves no trace
           that the store could wake a waiter on); if the departure that freed it was a
           member leaving the world, raise PeerLostError naming it

Every step shares the caller's one deadline; past it, ``TimeoutError`` names the key.

Why a departure ends the wait: a value or service lives in its holder's process, so a
holder that returned (its World stopped) took it along, and no restart brings it back
(``launch`` restarts the lost, not the finished). "Pair a flag, then return" is how a
learner says it is done (cold trial 15: its actors, already waiting, woke to find the
flag gone and waited out their timeout, told that nobody had paired it). A lost holder
(a SIGKILL) does not end an elastic wait: its restart pairs the value again.
"""

from __future__ import annotations

import time
from typing import Callable, Optional, TypeVar

from ..._deadline import deadline_left
from ...exception import PeerLostError
from .._calls import PairedRef
from .._membership import Departures, Roster
from .._store import Registry
from .caller import Caller
from .owners import OwnerCache

__all__ = ["wait_paired", "wait_registered", "RECHECK"]

RECHECK = 0.1  # seconds between look-ups of a value that was held before (see the module doc)
# Seconds after a change of membership during which a free claim's departure is looked for
# at each look-up: a leaving member posts its "leave" before it records the departure.
_DEPARTURE_LAG = 1.0


def wait_paired(caller: Caller, owners: OwnerCache, registry: Registry, roster: Roster, departures: Departures,
                elastic: bool, group: str, key: str, wait: float) -> PairedRef:
    """The handle ``caller.paired(key)`` gives, once a member of ``group`` pairs ``key``.

    Args:
        elastic: Whether a lost holder may come back (a static world's does not: its loss
            is raised at once).

    Raises:
        TimeoutError: nobody paired ``key`` within ``wait`` seconds (named).
        PeerLostError: the world's store is gone; in a static world, the holder is; the
            member that paired ``key`` left the world since (named).
    """
    def look(left: float) -> PairedRef:
        found = caller.paired(key, left)
        known = roster.incarnation_of(found.owner_name())
        if known is None or known < found.owner_incarnation():
            # Its holder's join is in the log but not yet in this view (a restarted member
            # pairs at once; this view reads the log at its next tick): read it now, so the
            # holder is a member here when this returns (cold trial 28). A view that still
            # holds the holder's previous incarnation would send the next call to its dead
            # worker (the CI of stop 91: EPIPE on the old pipe). After a read under way on
            # another thread, which may have begun before that join (CI of stop 113).
            roster.catch_up(within=left)
        return found

    return _wait_held(look, owners.value_key(key), registry, roster, departures, elastic, "value", key, group, wait)


def wait_registered(owners: OwnerCache, registry: Registry, roster: Roster, departures: Departures, group: str,
                    key: str, wait: float) -> None:
    """Return once a member of ``group`` holds service ``key`` (as :func:`wait_paired`).

    Raises:
        TimeoutError: nobody registered ``key`` within ``wait`` seconds (named).
        PeerLostError: the world's store is gone; the member that registered ``key`` left
            the world since (named).
    """
    def look(left: float) -> bool:
        if owners.service(key, refresh=True, timeout=left) is None:
            raise KeyError(key)
        return True

    _wait_held(look, owners.service_key(key), registry, roster, departures, True, "service", key, group, wait)


_Held = TypeVar("_Held")
_VERBS = {"value": ("paired", "pair"), "service": ("registered", "register")}


def _wait_held(look: Callable[[float], _Held], claim: str, registry: Registry, roster: Roster,
               departures: Departures, elastic: bool, kind: str, key: str, group: str, wait: float) -> _Held:
    """``look(seconds left)`` until it stops raising KeyError (nobody holds ``kind``
    ``key``, whose claim is ``claim``), all within ``wait`` seconds (see the module doc)."""
    deadline = time.monotonic() + wait
    done, verb = _VERBS[kind]
    looked, held_before = False, False
    checked: Optional[int] = None  # the roster's version at the last change seen (a departure looked for)
    follow = 0.0  # until when (monotonic) each look-up also looks for the departure
    while True:
        left = deadline_left(deadline)
        if looked and left <= 0:
            if held_before:
                raise TimeoutError(f"no member of group {group!r} holds {kind} {key!r}: it was {done} and "
                                   f"withdrawn (by its holder, or with a lost one), and nobody {done} it again "
                                   f"within {wait:g} s")
            raise TimeoutError(f"no member of group {group!r} {done} {kind} {key!r} within {wait:g} s; the member "
                               f"that is to hold it has not started or not reached group.{verb}({key!r}, ...), or "
                               f"it failed (its log says why)")
        seen, looked = roster.version, True
        try:
            return look(max(0.001, left))
        except KeyError:
            pass
        except PeerLostError:  # its holder was lost (a restarted one takes it again), or the store was:
            if not elastic:  # (the store ops below raise then)
                raise
        if registry.absent("", [claim]):
            try:
                registry.wait_all("", [claim], deadline_left(deadline), f"{kind} {key!r} of group {group!r}")
            except TimeoutError:
                pass  # (named at the top)
        else:
            held_before = True
            if roster.version != checked:
                checked, follow = roster.version, time.monotonic() + _DEPARTURE_LAG
            if time.monotonic() <= follow:
                holder = _left_holder(departures, roster, claim)
                if holder is not None:
                    raise PeerLostError(holder, f"{kind} {key!r} of group {group!r} was {done} by this member, which "
                                                f"has since left the world and took it along (it lives on its "
                                                f"holder); {verb} it on a member that stays until its readers have "
                                                f"it, or wait for the holder itself (World.wait_for_members)")
            try:
                roster.wait_until(lambda live: roster.version != seen, min(max(0.0, deadline_left(deadline)), RECHECK))
            except TimeoutError:
                pass


def _left_holder(departures: Departures, roster: Roster, claim: str) -> Optional[str]:
    """The member whose departure freed ``claim`` if it left the world (rather than being
    lost, whose restart may take the claim again) and has not come back; else None."""
    found = departures.last_released(claim)
    if found is None:
        return None
    member, _ = found
    return member if roster.gone(member) == "left" else None
