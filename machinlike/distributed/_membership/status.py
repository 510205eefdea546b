"""A read-only view of a running world, from its store alone (``python -m machinlike status``).

Every store key this view reads comes from :mod:`._keys` (the one module that spells
them), and the records are decoded with its types. It never joins the
world and never writes: it holds the store only through :class:`ReadOnlyStore`, which
offers ``check`` and ``get`` and nothing else.

    the world's store                             what the view makes of it
    -----------------                             -------------------------
    mlk/<restart>/e/...       (elastic)           kind, namespace <ns>
    mlk/<restart>/incarnation/0 = k (static)      <ns> = mlk/<restart>/<k>/
    <ns>w/name/<rank>         (static)            member names in rank order
    <ns>m/logk, m/snap/<k>, m/e/<seq>             joins, leaves, losses (names, deaths, rejoins)
    <ns>m/live/<name>                             alive ("inc|worker|rank|pid id") or gone ("")
    <ns>m/inc/<name>                              incarnations started (restarts = that - 1)
    <ns>m/hb/<name>                               heartbeat counter (moving = alive)
    <ns>m/own/<worker>                            registry keys it claimed: services (.../s/<key>)
                                                  and paired values, the servers (.../v/<key>)
    <ns>m/srv/<name>                              its servers' numbers (alive members, this
                                                  incarnation's only; see server_notes)
    <ns>m/exit/<name>                             how a member not alive ended (its incarnation's)

Why the store: it is the one place every member writes to and that outlives any of them
(hosted by rank 0, the launcher or torchrun's agent), and reading it costs the world no
RPC thread and no member a message.
"""

from __future__ import annotations

import datetime
import socket
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import torch.distributed as dist

from .event_log import EventCounts, read_history
from .processes import host_name, pid_in
from .._store import ExitRecord, Keys, MemberRecord, new_client, OwnedKey, ServerNote, ServerNotes

__all__ = ["ReadOnlyStore", "MemberStatus", "WorldStatus", "EventCounts", "read_status", "connect_read_only",
           "event_counts", "ServerNote"]

_MAX_RESTARTS = 10_000  # torchrun restart counts probed before giving up


class ReadOnlyStore:
    """The two reading calls of a c10d store; the view is handed this, never the store.

    Args:
        store: A connected store client.
        address: ``(host, port)`` of its server, for :meth:`answering`; None: unknown.
    """

    def __init__(self, store: dist.Store, address: Optional[Tuple[str, int]] = None) -> None:
        self._store = store
        self._address = address

    def answering(self) -> bool:
        """Whether the server still accepts connections (a plain connection, not the
        client's: torch's client logs pages of C++ frames when its server has gone)."""
        if self._address is None:
            return True
        try:
            socket.create_connection(self._address, timeout=2.0).close()
        except OSError:
            return False
        return True

    def has(self, key: str) -> bool:
        return bool(self._store.check([key]))

    def get(self, key: str) -> Optional[str]:
        """The value of ``key``; None when absent (checked first: a store ``get`` of an
        absent key would wait for it)."""
        if not self._store.check([key]):
            return None
        try:
            return self._store.get(key).decode()
        except dist.DistStoreError:  # deleted between the check and the get (a bookkeeping key)
            return None


def connect_read_only(address: str, timeout: float) -> ReadOnlyStore:
    """A client of the store at ``address`` (``"tcp://host:port"`` or ``"host:port"``).

    The client neither registers as a worker nor waits for any (``wait_for_workers=False``).

    Raises:
        ValueError: ``address`` is not ``host:port``.
        ConnectionError: nothing answers there within ``timeout`` seconds.
    """
    rest = address[len("tcp://"):] if address.startswith("tcp://") else address
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"address must be 'host:port' or 'tcp://host:port' (a World's store_address), "
                         f"got {address!r}")
    try:  # a plain connection first: torch's client logs pages of C++ frames for a port where nothing listens
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as err:
        raise ConnectionError(f"no world's store answers at {host}:{port} within {timeout:g} s ({err})") from err
    try:
        store = new_client(host.strip("[]"), int(port), datetime.timedelta(seconds=timeout))
    except (RuntimeError, dist.DistError, TimeoutError) as err:
        # (not the error's own advice, which is a World's: the reader's fix is the address)
        raise ConnectionError(f"something listens at {host}:{port} but did not answer as a world's store within "
                              f"{timeout:g} s: check the address (World.store_address; the examples print it at "
                              f"start)") from err
    return ReadOnlyStore(store, (host.strip("[]"), int(port)))


@dataclass
class MemberStatus:
    """One member as the store shows it.

    Attributes:
        name: Its member name.
        state: ``"alive"``, ``"lost"`` (died or went silent), ``"left"`` (stopped) or
            ``"gone"`` (its claim is cleared and the log does not say why).
        incarnation: The incarnation of its claim, or of its last event when gone.
        started: Incarnations started under this name (elastic worlds; 1 in static ones).
        rank: Its rank (-1 when unknown).
        pid: Its process id, None when unknown.
        host: Its process's host identity (host name, boot id and namespaces), "" when unknown.
        beats: Its heartbeat counter, None when it never beat (no liveness monitor).
        services: Service keys it holds, as ``"<group>:<key>"``.
        values: Paired values it holds (servers are paired under their name), as
            ``"<group>:<key>"``.
        servers: Its servers' numbers, one note per server and role, as it last
            published them (alive members only).
        servers_time: When it published them (``time.time()`` on its host); None: never.
        exit: How its incarnation ended (``"raised ValueError: bad thing"``, ``"killed by
            signal SIGKILL (9)"``, ``"process gone"``, ...); None while it is alive, or
            when nothing was recorded (see ``_membership.exit_causes``).
        exit_by: Who recorded ``exit``: ``"member"``, ``"launcher"`` or ``"watcher"``; None with it.
    """

    name: str
    state: str
    incarnation: int
    started: int
    rank: int
    pid: Optional[int]
    host: str
    beats: Optional[int]
    services: List[str] = field(default_factory=list)
    values: List[str] = field(default_factory=list)
    servers: List[ServerNote] = field(default_factory=list)
    servers_time: Optional[float] = None
    exit: Optional[str] = None
    exit_by: Optional[str] = None

    @property
    def hostname(self) -> str:
        """Its host's name, "" when unknown."""
        return host_name(self.host)

    @property
    def restarts(self) -> int:
        """Incarnations after the first."""
        return max(0, self.started - 1)


@dataclass
class WorldStatus:
    """A world as its store shows it at one moment.

    Attributes:
        kind: ``"elastic"`` or ``"static"``.
        namespace: The world's key prefix in the store.
        members: Every member the world has had, in rank order (elastic: first join order).
        deaths: ``"lost"`` events so far.
        rejoins: Joins of an incarnation after the first.
        leaves: ``"leave"`` events so far.
        events: Events in the world's log.
    """

    kind: str
    namespace: str
    members: List[MemberStatus]
    deaths: int
    rejoins: int
    leaves: int
    events: int

    def alive(self) -> List[str]:
        return [m.name for m in self.members if m.state == "alive"]


def _find_namespace(store: ReadOnlyStore) -> Optional[Tuple[str, Keys]]:
    """(kind, keys) of the newest world on the store, None when there is none."""
    rounds = store.get(Keys.round_counter())  # a torchrun job's worlds (see _world.rounds)
    for round_ in range(int(rounds) if rounds else 0, 0, -1):
        elastic = Keys.elastic_world(f"r{round_}")
        if store.has(elastic.log_count()):
            return "elastic", elastic
        latest = store.get(Keys.static_counter(f"r{round_}", 0))
        if latest is not None:  # (the newest round whose rank 0 came that far)
            return "static", Keys.static_world(f"r{round_}", int(latest))
    found: Optional[Tuple[str, Keys]] = None
    for restart in range(_MAX_RESTARTS):
        elastic = Keys.elastic_world(str(restart))
        if store.has(elastic.log_count()):
            found = ("elastic", elastic)
        else:
            latest = store.get(Keys.static_counter(str(restart), 0))
            if latest is None:
                break
            found = ("static", Keys.static_world(str(restart), int(latest)))
    return found


def event_counts(membership: Any) -> EventCounts:
    """The event counts of the world ``membership`` (a started World's) belongs to, from its store.

    What a member's own callbacks cannot give: the events posted before it subscribed.
    """
    registry = membership.registry
    return read_history(lambda key: registry.get_or_empty(key) or None, membership.keys).counts


def _holdings(store: ReadOnlyStore, keys: Keys, worker: str) -> Tuple[List[str], List[str]]:
    """(services, values) that ``worker`` still holds, each ``"<group>:<key>"``."""
    services: List[str] = []
    values: List[str] = []
    seen = set()
    for owned in OwnedKey.decode_all(store.get(keys.owned(worker)) or ""):
        held = keys.holding(owned.key)
        if held is None or owned.key in seen:
            continue
        seen.add(owned.key)
        if store.get(owned.key) != owned.holder:
            continue  # released since (a tombstone) or taken over by another member
        kind, group, key = held
        (services if kind == "s" else values).append(f"{group}:{key}")
    return services, values


def _add_server_notes(store: ReadOnlyStore, keys: Keys, members: List[MemberStatus]) -> None:
    """Each alive member's servers' numbers, when its current incarnation published them
    (an earlier incarnation's are stale: its servers died with it)."""
    for member in members:
        if member.state != "alive":
            continue
        notes = ServerNotes.decode(store.get(keys.server_notes(member.name)) or "")
        if notes is not None and notes.incarnation == member.incarnation:
            member.servers, member.servers_time = list(notes.servers), notes.time


def read_status(store: ReadOnlyStore) -> Optional[WorldStatus]:
    """What the store says about its newest world; None when it holds no machinlike world."""
    located = _find_namespace(store)
    if located is None:
        return None
    kind, keys = located
    history = read_history(store.get, keys)
    log = [(entry.kind, entry.record) for _, entry in history.entries]
    names: List[str] = []
    if kind == "static":
        rank = 0
        while True:
            name = store.get(f"{keys.name_prefix()}{rank}")
            if name is None:
                break
            names.append(name)
            rank += 1
    last_event: Dict[str, Tuple[str, MemberRecord]] = {}
    for event_kind, rec in log:
        if rec.member not in names:
            names.append(rec.member)
        if event_kind != "move":
            last_event[rec.member] = (event_kind, rec)
    members = []
    for index, name in enumerate(names):
        held = store.get(keys.live(name)) or ""
        started_text = store.get(keys.incarnations(name))
        beats_text = store.get(keys.heartbeat(name))
        if held:
            rec = MemberRecord.decode(name, held)
            state = "alive"
        else:
            event_kind, rec = last_event.get(name, ("", MemberRecord(name, 1, name, index, "")))
            state = {"lost": "lost", "leave": "left"}.get(event_kind, "gone")
        space, pid = rec.identity.rpartition("/")[0], pid_in(rec.identity)
        services, values = _holdings(store, keys, rec.worker) if state == "alive" else ([], [])
        members.append(MemberStatus(
            name=name, state=state, incarnation=rec.incarnation,
            started=int(started_text) if started_text else 1, rank=rec.rank,
            pid=pid or None, host=space,
            beats=int(beats_text) if beats_text else None, services=services, values=values))
    _add_server_notes(store, keys, members)
    _read_exits(store, keys, members)
    counts = history.counts
    return WorldStatus(kind=kind, namespace=keys.ns, members=members, deaths=counts.deaths, rejoins=counts.rejoins,
                       leaves=counts.leaves, events=counts.events)


def _read_exits(store: ReadOnlyStore, keys: Keys, members: List[MemberStatus]) -> None:
    """Set ``exit`` of each member not alive from its ``m/exit/<name>`` record, when that
    is about the incarnation shown (and its process, where both pids are known)."""
    for m in members:
        if m.state == "alive":
            continue
        record = ExitRecord.decode(store.get(keys.exit_cause(m.name)) or "")
        if record is None or record.incarnation != m.incarnation:
            continue  # (none, or an older incarnation's: the view shows the newest)
        if record.pid and m.pid is not None and record.pid != m.pid:
            continue  # (a launcher's guess of the incarnation, for a process that died before it claimed one)
        m.exit, m.exit_by = record.cause, record.by
