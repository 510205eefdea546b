"""wait_paired: a handle to a value once some member pairs it, in a world whose members
start at their own pace.

Why: an elastic world's actors start before, with or after their learner, and an open
group has no barrier; ``get_paired`` raises ``KeyError`` at once for a value not paired
yet, so users wrote sleep loops over ``is_paired`` (cold trial 11). The store says when a
key first appears, so the common case waits without a request::

    look the value up (get_paired) ── found ──► its handle
        │ nobody holds it
        ├─ its claim key was never made: wait in the store for it (one blocked request;
        │  the first pair makes it), then look again
        └─ it was held before (its holder withdrew it, left or was lost; a restarted
           holder pairs it again): look again at each change of membership, and at
           least every RECHECK seconds (a claim freed and taken again leaves no trace
           that the store could wake a waiter on)

Every step shares the caller's one deadline; past it, ``TimeoutError`` names the value.
"""

from __future__ import annotations

import time

from ..._deadline import deadline_left
from ...exception import PeerLostError
from .._calls import PairedRef
from .._membership import Roster
from .._store import Registry
from .caller import Caller
from .owners import OwnerCache

__all__ = ["wait_paired", "RECHECK"]

RECHECK = 0.1  # seconds between look-ups of a value that was held before (see the module doc)


def wait_paired(caller: Caller, owners: OwnerCache, registry: Registry, roster: Roster, elastic: bool,
                group: str, key: str, wait: float) -> PairedRef:
    """The handle ``caller.paired(key)`` gives, once a member of ``group`` pairs ``key``.

    Args:
        elastic: Whether a lost holder may come back (a static world's does not: its loss
            is raised at once).

    Raises:
        TimeoutError: nobody paired ``key`` within ``wait`` seconds (named).
        PeerLostError: the world's store is gone; in a static world, the holder is.
    """
    deadline = time.monotonic() + wait
    claim = owners.value_key(key)
    looked = False
    while True:
        left = deadline_left(deadline)
        if looked and left <= 0:
            raise TimeoutError(f"no member of group {group!r} paired value {key!r} within {wait:g} s; the member "
                               f"that is to pair it has not started or not reached group.pair({key!r}, ...), or it "
                               f"failed (its log says why)")
        seen, looked = roster.version, True
        try:
            return caller.paired(key, max(0.001, left))
        except KeyError:
            pass
        except PeerLostError:  # its holder was lost (a restarted one pairs it again), or the store was:
            if not elastic:  # (the store ops below raise then)
                raise
        if registry.absent("", [claim]):
            try:
                registry.wait_all("", [claim], deadline_left(deadline), f"value {key!r} of group {group!r}")
            except TimeoutError:
                pass  # (named at the top)
        else:
            try:
                roster.wait_until(lambda live: roster.version != seen, min(max(0.0, deadline_left(deadline)), RECHECK))
            except TimeoutError:
                pass
