"""One member per rank in an elastic world: the rank is a claim, ``m/rank/<r>``.

    enter(): name claimed ──► claim m/rank/<r> for this worker (Claims: freed with it)
                 held by a live member ─► given rank: ValueError naming it
                                          no rank:    the next sequence number, claimed
                 held by a dead one     ─► declared lost (its keys freed), claimed again
                 held by a gone worker (no entry, or its own last incarnation's) ─► taken over

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
        if not owner or (owner == mine.member and holder != mine.worker):
            # A gone worker: its entry was deleted with its member's loss, or it is one
            # of this member's own earlier incarnation (this one won the name only after
            # that one was declared lost). One killed between its claim and the claim's
            # note held the rank for good (nobody frees a key not noted): taken over. Its
            # declarer's release, if still to come, then finds another holder and does
            # nothing. (A live member's claims always name a worker with an entry.)
            if claims.take_over(keys.rank(mine.rank), holder, mine.worker):
                return mine
            continue
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

