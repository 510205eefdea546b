"""Push accounting of a gradient server in an elastic world: accepted, received, dropped.

Why: a secondary reducer that dies takes the pushes it queued with it, and the clients
were already told True. Nothing dead can report, so the count of what a secondary
accepted lives in the world's store, written before the client's acknowledgement; the
primary counts what arrived; the difference, once the secondary is gone, is exactly what
died with it::

    client ──push──► secondary S (RPC worker w)             primary P, incarnation p
                     admit(client):                          accept(partial sum of "w#i@p"):
                       P not live ──► PeerLostError(P)         incarnation i gone, or tagged for another
                       source = "w#i@p"                        primary incarnation ──► refused
                       store: acc/<source>/<client> += 1       received[source, client] += n
                     queue it, reply True                    (check and count under one lock)

    dropped(client) = sum over settled sources of  acc[source, client] - received[source, client]

``w#i`` names one process: incarnation ``i`` of the secondary, by the RPC worker of its
first agent (``<name>_<id>``, new for every incarnation). A renewal or a recycling gives
the process another worker but keeps its tag. A source is *settled* once no more of it
can arrive: its incarnation is gone (lost or left; not moved to a new agent), or it was
tagged for another primary incarnation (a restarted primary refuses those; what it had
received is restored from its checkpoint). A forward of a settled source is refused
under the same lock that counts receipts, so a gradient is either received (and applied)
or dropped, never both.

Store keys (under the world's namespace)::

    gs/<group>/<server>/src                    "source," appended once per source
    gs/<group>/<server>/cl/<source>            "client," appended once per client of it
    gs/<group>/<server>/acc/<source>/<client>  counter of pushes accepted
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Any, Dict, List, NamedTuple, Optional, Set, Tuple

from ..exception import PeerLostError

__all__ = ["Admission", "Ledger", "Source", "parse_source"]

Origin = Dict[Tuple[str, str], int]


class Source(NamedTuple):
    """What a source tag names."""

    member: str  # the secondary reducer (as its worker name spells it; for messages)
    worker: str  # its RPC worker when it accepted its first push (it may renew its agent since)
    incarnation: Optional[int]  # the secondary's incarnation; None: a tag without it (older checkpoints)
    primary: int  # the primary reducer's incarnation the pushes were accepted for


def parse_source(source: str) -> Source:
    """``"w#i@p"`` (or ``"w@p"``) -> its :class:`Source`."""
    head, _, primary = source.rpartition("@")
    worker, mark, incarnation = head.rpartition("#")
    if not mark:
        worker, incarnation = head, ""
    return Source(worker.rpartition("_")[0] or worker, worker, int(incarnation) if incarnation else None,
                  int(primary))


class _Keys:
    def __init__(self, world: Any, group_name: str, server_name: str) -> None:
        self.members = world.membership
        self.registry = world.membership.registry
        self.base = world.membership.keys.server("gs", group_name, server_name)

    def sources(self) -> List[str]:
        return _entries(self.registry.get_or_empty(self.base + "src"))

    def clients(self, source: str) -> List[str]:
        return _entries(self.registry.get_or_empty(f"{self.base}cl/{source}"))

    def accepted(self, source: str, clients: List[str]) -> List[int]:
        return [int(v or 0) for v in self.registry.values_or_empty(f"{self.base}acc/{source}/", clients)]


def _entries(text: str) -> List[str]:
    return list(dict.fromkeys(e for e in text.split(",") if e))


class Admission:
    """The secondary's side: tags each push with its source and counts it in the store.

    Args:
        world: This process's (elastic) World.
        group_name, server_name: Identify the server.
        primary: Name of the primary reducer.
    """

    def __init__(self, world: Any, group_name: str, server_name: str, primary: str) -> None:
        self._keys = _Keys(world, group_name, server_name)
        self._server = server_name
        self._primary = primary
        # The worker of the incarnation's first agent, and the incarnation: the tag stays for
        # the incarnation's life (a renewal or a recycling gives it another worker, not
        # another process), and that worker's store entry stays as long (the primary asks it).
        self._me = f"{world.membership.first_worker}#{world.incarnation}"
        self._lock = threading.Lock()
        self._known: Set[Tuple[str, str]] = set()

    def source(self) -> str:
        """The tag of pushes accepted now.

        Raises:
            PeerLostError: the primary reducer is not live (its pushes could not be applied).
        """
        primary = self._keys.members.incarnation_of(self._primary)
        if primary is None:
            raise PeerLostError(self._primary, f"gradient server {self._server!r}: its primary reducer is gone, so "
                                               f"pushes are refused until it is back")
        return f"{self._me}@{primary}"

    def admit(self, client: str) -> str:
        """Count one push of ``client`` as accepted (before it is acknowledged); its source tag."""
        source = self.source()
        keys = self._keys
        with self._lock:  # the listings are written before any counter they announce
            if (source, "") not in self._known:
                keys.registry.append(keys.base + "src", source + ",")
                self._known.add((source, ""))
            if (source, client) not in self._known:
                keys.registry.append(f"{keys.base}cl/{source}", client + ",")
                self._known.add((source, client))
        keys.registry.add(f"{keys.base}acc/{source}/{client}", 1)
        return source


class Ledger:
    """The primary's side: counts receipts per (source, client) and reports the dropped.

    Args:
        world: This process's (elastic) World.
        group_name, server_name: Identify the server.
    """

    def __init__(self, world: Any, group_name: str, server_name: str) -> None:
        self._keys = _Keys(world, group_name, server_name)
        self._server = server_name
        self._incarnation = world.incarnation
        self._lock = threading.Lock()
        self._received: Dict[str, Counter] = {}
        self._applied: Dict[str, Counter] = {}
        # Sources found settled through the store before this view saw their worker go:
        # once dropped() counted what they never delivered, receive() refuses the rest.
        self._closed: Set[str] = set()
        self.refused = 0

    def _settled(self, source: str) -> Optional[str]:
        src = parse_source(source)
        if src.primary != self._incarnation:
            return (f"they were accepted for incarnation {src.primary} of the primary reducer, this is "
                    f"{self._incarnation}")
        # Not "not live": a secondary that joined may not be in this member's view yet. Not
        # "its worker gone": one that renewed its agent still forwards what it accepted.
        if source in self._closed or self._keys.members.worker_ended(src.worker):
            return f"secondary reducer {src.member!r} (RPC worker {src.worker!r}) is gone"
        return None

    def receive(self, origin: Origin) -> Optional[PeerLostError]:
        """Count a partial sum as received, or the error refusing it (its source is settled)."""
        with self._lock:
            for source in {s for s, _ in origin}:
                why = self._settled(source)
                if why is not None:
                    self.refused += sum(origin.values())
                    member = parse_source(source).member
                    return PeerLostError(member, f"gradient server {self._server!r} refuses gradients of source "
                                                 f"{source!r}: {why}; they are counted as dropped")
            for (source, client), n in origin.items():
                self._received.setdefault(source, Counter())[client] += n
        return None

    def applied(self, origin: Origin) -> None:
        with self._lock:
            for (source, client), n in origin.items():
                self._applied.setdefault(source, Counter())[client] += n

    def state(self) -> Dict[str, Dict[str, int]]:
        """What was applied, per source and client (for a checkpoint)."""
        with self._lock:
            return {s: dict(c) for s, c in self._applied.items()}

    def restore(self, applied: Dict[str, Dict[str, int]]) -> None:
        """Resume from a checkpoint: what it had applied is all that was received of old sources."""
        with self._lock:
            self._applied = {s: Counter(c) for s, c in applied.items()}
            self._received = {s: Counter(c) for s, c in applied.items()}

    def clients(self) -> List[str]:
        """Clients whose pushes this primary received."""
        with self._lock:
            return sorted({c for counts in self._received.values() for c in counts})

    def dropped(self) -> Dict[str, int]:
        """Pushes accepted by a settled source and never received, by client (reads the store)."""
        out: Counter = Counter()
        for source in self._keys.sources():
            if self._settled(source) is None:
                # This view learns of a loss a monitor tick after the store does (and a
                # flush that skipped a dead secondary may be answered in between): ask
                # the store, and close the source so that nothing of it is received later.
                src = parse_source(source)
                members = self._keys.members
                if not (members.worker_dead(src.worker) if src.incarnation is None
                        else members.incarnation_dead(src.worker, src.incarnation)):
                    continue
                with self._lock:
                    self._closed.add(source)
            clients = self._keys.clients(source)
            accepted = self._keys.accepted(source, clients)
            with self._lock:
                received = self._received.get(source, Counter())
                for client, n in zip(clients, accepted):
                    if n - received[client] > 0:
                        out[client] += n - received[client]
        return dict(out)
