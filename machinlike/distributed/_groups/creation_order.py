"""CreationOrder: every process creates its collective groups with the same ranks in the
same order, or no group is made.

Why: torch pairs the processes of a new gloo or NCCL group by how many groups each process
made before (``dist.new_group`` counts its calls), so processes that create their groups in
another order, or with other ranks, are wired to the wrong peers: a collective then sums
over processes the caller never named (a trial met rank 0 summing with rank 2 in a group of
[0, 1]), or waits out gloo's own connect timeout and reports raw store keys. torch states
the rule; nothing checks it. So before each ``new_group`` every process writes the ranks it
passes under the number of that creation, and reads every other's::

    creation n   set cg/<n>/<rank> = "0,1"
                 wait for cg/<n>/<r> of every rank, members or not (torch's rule); a gone
                 process fails at once, named; one that never comes: TimeoutError naming it
                 another list anywhere ──► ValueError naming that rank and both lists
                 count cg/<n>/read: the last reader deletes the creation's keys
    World.stop   set cg/<n>/<rank> = STOPPED for this process's next creation n, counted as
                 read: a process waiting there (a rank that returned without creating a
                 group the others create) fails at once, naming it, not at its timeout

The cost: one store round trip and a wait that the group's own rendezvous would make
anyway (every process calls it), about a millisecond.
"""

from __future__ import annotations

import logging
import threading
from typing import List, Sequence

from .._membership import Waits
from .._store import LOST_MARK, WOKEN_MARK, Keys, Registry
from ...exception import PeerLostError

__all__ = ["CreationOrder"]

log = logging.getLogger(__name__)

# What a stopped process states for the creation it never made (no list of ranks reads so).
_STOPPED = "\x00stopped"


class CreationOrder:
    """The collective group creations of one static world, as this process makes them.

    Args:
        registry: The world's store.
        keys: The world's keys.
        waits: Waits that fail fast for a gone member.
        rank: This process's rank.
        names: Member names by rank (static world).
    """

    def __init__(self, registry: Registry, keys: Keys, waits: Waits, rank: int, names: Sequence[str]) -> None:
        self._registry = registry
        self._keys = keys
        self._waits = waits
        self._rank = rank
        self._names = list(names)
        self._lock = threading.Lock()
        self._count = 0  # creations so far (this process's; every process counts alike)

    def agree(self, ranks: List[int], timeout: float) -> None:
        """Wait (up to ``timeout`` seconds) until every process has stated the ranks of
        this creation; return when all stated ``ranks``.

        Raises:
            ValueError: a process stated other ranks (named, with both lists).
            TimeoutError: a process did not come (named).
            PeerLostError: a process is gone (named).
        """
        with self._lock:
            number = self._count
            self._count += 1
        prefix = self._keys.collective_prefix(number)
        listing = ",".join(map(str, ranks))
        ranks_all = self._ranks_all()
        self._registry.set(prefix + str(self._rank), listing)
        self._waits.wait_all(prefix, ranks_all, self._names, timeout,
                             f"creating collective group {ranks} (creation {number + 1} of this process): ranks",
                             timeout)
        stated = self._registry.values(prefix, ranks_all)
        self._count_read(prefix)
        stopped = [r for r, held in enumerate(stated) if held == _STOPPED]
        if stopped:
            rank = stopped[0]
            raise ValueError(f"collective group creation {number + 1} ({ranks}): rank {rank} ({self._names[rank]!r}) "
                             f"stopped its World without creating it; every process of the world creates each "
                             f"collective group, members or not, in the same order (torch's rule for new_group): "
                             f"call create_collective_group({ranks}) in rank {rank} too")
        gone = [r for r, held in enumerate(stated) if held in (LOST_MARK, WOKEN_MARK)]
        if gone:  # (a process that had stated its ranks and died since: the others were woken)
            raise PeerLostError(self._names[gone[0]], f"creating collective group {ranks}: it left or died "
                                                      f"while being waited for")
        other = [(r, held) for r, held in enumerate(stated) if held != listing]
        if other:
            rank, held = other[0]
            theirs = [int(x) for x in held.split(",")] if held else []
            raise ValueError(f"collective group creation {number + 1}: rank {rank} created ranks {theirs} where this "
                             f"rank created {ranks}; every process of the world creates its collective groups with "
                             f"the same ranks in the same order, members or not (torch's rule for new_group)")

    def end(self) -> None:
        """This process stops: it states that it makes no next creation, so that a process
        waiting for it there fails at once (ValueError naming it), not at its timeout.
        A store already gone is logged (DEBUG): the stop's own barrier reports it."""
        with self._lock:
            number = self._count
            self._count += 1  # (no creation after this: a later agree would wait for itself)
        prefix = self._keys.collective_prefix(number)
        try:
            self._registry.set(prefix + str(self._rank), _STOPPED)
            self._count_read(prefix)  # (it reads nothing, but the last reader must still delete)
        except ConnectionError as err:
            log.debug("collective group creations: could not mark rank %d's as ended: %s", self._rank, err)

    def _ranks_all(self) -> List[str]:
        return [str(r) for r in range(len(self._names))]

    def _count_read(self, prefix: str) -> None:
        # Counted once read: the last reader deletes what every process has read.
        ranks_all = self._ranks_all()
        if self._registry.add(prefix + "read", 1) == len(ranks_all):
            self._registry.delete([prefix + r for r in ranks_all] + [prefix + "read"])
