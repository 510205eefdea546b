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
           that the store could wake a waiter on)

Every step shares the caller's one deadline; past it, ``TimeoutError`` names the key.
"""

from __future__ import annotations

import time
from typing import Callable, TypeVar

from ..._deadline import deadline_left
from ...exception import PeerLostError
from .._calls import PairedRef
from .._membership import Roster
from .._store import Registry
from .caller import Caller
from .owners import OwnerCache

__all__ = ["wait_paired", "wait_registered", "RECHECK"]

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
    return _wait_held(lambda left: caller.paired(key, left), owners.value_key(key), registry, roster, elastic,
                      "value", key, group, wait)


def wait_registered(owners: OwnerCache, registry: Registry, roster: Roster, group: str, key: str,
                    wait: float) -> None:
    """Return once a member of ``group`` holds service ``key`` (as :func:`wait_paired`).

    Raises:
        TimeoutError: nobody registered ``key`` within ``wait`` seconds (named).
        PeerLostError: the world's store is gone.
    """
    def look(left: float) -> bool:
        if owners.service(key, refresh=True, timeout=left) is None:
            raise KeyError(key)
        return True

    _wait_held(look, owners.service_key(key), registry, roster, True, "service", key, group, wait)


_Held = TypeVar("_Held")
_VERBS = {"value": ("paired", "pair"), "service": ("registered", "register")}


def _wait_held(look: Callable[[float], _Held], claim: str, registry: Registry, roster: Roster, elastic: bool,
               kind: str, key: str, group: str, wait: float) -> _Held:
    """``look(seconds left)`` until it stops raising KeyError (nobody holds ``kind``
    ``key``, whose claim is ``claim``), all within ``wait`` seconds (see the module doc)."""
    deadline = time.monotonic() + wait
    done, verb = _VERBS[kind]
    looked = False
    while True:
        left = deadline_left(deadline)
        if looked and left <= 0:
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
            try:
                roster.wait_until(lambda live: roster.version != seen, min(max(0.0, deadline_left(deadline)), RECHECK))
            except TimeoutError:
                pass
