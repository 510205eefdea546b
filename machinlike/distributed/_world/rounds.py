"""The round of a torchrun job that a World starts in, agreed by its ranks on the store.

Why: torchrun's agents restart their workers in rounds, and the store the workers meet on
(the agents' own, shared by every round) keeps the keys of the rounds before, so each
round needs a namespace of its own. The restart count torchrun hands each worker
(``TORCHELASTIC_RESTART_COUNT``) is no round number: an agent counts the restarts for its
own workers' failures, not those for a change of membership, so after a worker died on
one node the ranks of the next round disagreed (1 there, 0 on the other node) and waited
for each other in two namespaces until the start-up timeout. Rank 0 of a round is one
process: it draws the round and grants it to each rank's newest ticket::

    rank r > 0   t = add(ticket/r, 1) ─► set(want/r, t) ─► wait(grant/r/t) ─► round
                 ─► set(ack/<round>/r)
    rank 0       round = add(round, 1); until every ack/<round>/r exists:
                     every want/r there (an earlier round's counts)? grant each want/r
                       not granted yet: set(grant/r/<want>, round); every ack there? done
                     else sleep (each pause longer, up to 0.2 s) and look again
                 then delete the grants and acks

A want left by a worker of an earlier round is granted too: nobody waits on its key, and
the grant is deleted with the others. The ack proves a rank took this round, so rank 0
waits for the acks rather than for the wants.
"""

from __future__ import annotations

import datetime
import time
from typing import Dict, List, Set

import torch.distributed as dist

from .._store import Keys, multi_get

__all__ = ["agree_round"]

_SLICE_FIRST, _SLICE_MAX = 0.005, 0.2  # s: rank 0's waits between its looks at the wants


def agree_round(store: dist.Store, rank: int, size: int, deadline: float, address: str) -> str:
    """The namespace root (``"r<round>"``) of this World's round, agreed with its other ranks.

    Args:
        store: The job's store.
        rank, size: This process's rank and the world's size.
        deadline: ``time.monotonic()`` by which the round must be agreed (the start-up's).
        address: ``host:port`` of the store, for messages.

    Raises:
        TimeoutError: rank 0 (for another rank) or some ranks (for rank 0, named) did not
            come by ``deadline``.
    """
    if rank == 0:
        return f"r{_lead(store, size, deadline, address)}"
    ticket = str(store.add(Keys.round_ticket(rank), 1))
    store.set(Keys.round_want(rank), ticket)
    grant = Keys.round_grant(rank, ticket)
    try:
        store.wait([grant], _left(deadline))
    except dist.DistStoreError:
        raise TimeoutError(
            f"World start-up: rank 0 of this torchrun job did not start this round's world within its timeout "
            f"(store {address}): its node may be down or slow to restart, or this worker was started outside "
            f"the round (a worker of the job started by hand); pass a larger dist_timeout if nodes restart "
            f"slowly") from None
    round_ = int(store.get(grant).decode())
    store.set(Keys.round_ack(round_, rank), "1")
    return f"r{round_}"


def _lead(store: dist.Store, size: int, deadline: float, address: str) -> int:
    round_ = store.add(Keys.round_counter(), 1)
    others = list(range(1, size))
    wants = [Keys.round_want(r) for r in others]
    acks = [Keys.round_ack(round_, r) for r in others]
    granted: Dict[int, Set[str]] = {r: set() for r in others}
    pause = _SLICE_FIRST
    # Looks with check(), not timed waits: torch logs two C++ warnings for every wait that
    # times out (a node 60 s late printed about 600 lines); a look costs one round trip.
    while others:
        if store.check(wants):  # (a rank's want, even an earlier round's, then one read of them all)
            _grant(store, others, wants, granted, round_)
            if store.check(acks):
                break
        if time.monotonic() >= deadline:
            missing = [str(r) for r, key in zip(others, acks) if not store.check([key])]
            raise TimeoutError(
                f"World start-up: ranks {', '.join(repr(m) for m in missing)} of this torchrun job did not "
                f"start this round's world within its timeout (store {address}): their node may be down or slow "
                f"to restart; pass a larger dist_timeout if nodes restart slowly")
        time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
        pause = min(pause * 2, _SLICE_MAX)
    for r, tickets in granted.items():  # (the round is taken: its keys are spent)
        for ticket in tickets:
            store.delete_key(Keys.round_grant(r, ticket))
    for key in acks:
        store.delete_key(key)
    return round_


def _grant(store: dist.Store, ranks: List[int], wants: List[str], granted: Dict[int, Set[str]],
           round_: int) -> None:
    for r, ticket in zip(ranks, multi_get(store, wants)):
        text = ticket.decode()
        if text not in granted[r]:
            store.set(Keys.round_grant(r, text), str(round_))
            granted[r].add(text)


def _left(deadline: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))
