"""One member per rank in an elastic world: the rank is a claim, ``m/rank/<r>``.

    enter(): name claimed ──► claim m/rank/<r> for this worker (Claims: freed with it)
                 held by a live member ─► given rank: ValueError naming it
                                          no rank:    the next sequence number, claimed
                 held by a dead one     ─► declared lost (its keys freed), claimed again

Why: a rank given twice (two actors started with ``rank=3``, a learner's ``rank=1``
repeated by a script) made two members answer ``world.rank == 3``; code that seeds,
shards or elects by rank then did the same work twice, silently. A member given no rank
takes its worker's sequence number, unique among those, but a rank given by hand may
be that number too: it then takes the next. The claim is one of the member's noted
keys, so it is freed when the member leaves or is declared lost, and the store keeps
no key per rank ever used.
"""

from __future__ import annotations

import time

from .claims import Claims
from .endpoint import Endpoint
from .monitor import Monitor
from .._store import Keys, MemberRecord, Registry
from ..._deadline import deadline_left

__all__ = ["claim_rank"]

_LOOK_S = 0.05  # seconds between looks while a dead holder's keys are being freed


def claim_rank(mine: MemberRecord, given: bool, registry: Registry, keys: Keys, claims: Claims,
               endpoint: Endpoint, monitor: Monitor, deadline: float) -> MemberRecord:
    """Claim ``mine.rank`` for this member; returns its record (another rank when it was
    not ``given`` and the first was held).

    Args:
        mine: This incarnation's record, its name claimed already.
        given: The rank was given by the caller (else it is the worker's sequence number).

    Raises:
        ValueError: ``given`` and a live member holds that rank (named).
        TimeoutError: a dead holder's keys were not freed by ``deadline``.
    """
    while True:
        holder = claims.claim(keys.rank(mine.rank), mine.worker)
        if holder is None:
            return mine
        owner = registry.get_or_empty(keys.worker(holder))
        held = registry.get_or_empty(keys.live(owner)) if owner else ""
        rec = MemberRecord.decode(owner, held) if held else None
        if rec is not None and rec.member != mine.member:
            if monitor.record_alive(rec, wait=min(deadline_left(deadline), monitor.lease())):
                if given:
                    raise ValueError(
                        f"rank {mine.rank} is held by member {rec.member!r} (incarnation {rec.incarnation}), alive in "
                        f"this world: give each member its own rank, or rank=None for a fresh one")
                mine = _renumbered(mine, registry, keys, endpoint)
                continue
            monitor.declare(rec, deadline, why=f"found dead by {mine.member!r}, which claims its rank {mine.rank}")
        if deadline_left(deadline) <= 0:
            raise TimeoutError(f"rank {mine.rank} was still held by {holder!r} (gone) when the deadline passed")
        # Its holder is gone (declared just now, or its keys are being freed by the
        # member that declared it): look again shortly.
        time.sleep(min(_LOOK_S, deadline_left(deadline)))


def _renumbered(mine: MemberRecord, registry: Registry, keys: Keys, endpoint: Endpoint) -> MemberRecord:
    """``mine`` with the next sequence number as its rank, in its name claim as well."""
    rank = registry.add(keys.worker_ids(), 1) - 1  # (a number no worker takes: see Endpoint)
    moved = mine._replace(rank=rank)
    registry.compare_set(keys.live(mine.member), mine.encode(), moved.encode())
    endpoint.rank = rank
    endpoint.claimed(moved)
    return moved

