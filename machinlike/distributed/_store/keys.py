"""The world's store namespace: every key machinlike writes, and every value's encoding.

This module is the only place a store key is spelled. A World gets one :class:`Keys` for
its namespace ``<ns>`` (``mlk/<restart>/<n>/`` for the n-th static World of a rank on a
store, ``mlk/<restart>/e/`` for an elastic world); everything below is relative to it:

    <ns>m/inc/<name>                 counter: incarnations of a member          members
    <ns>m/live/<name>                MemberRecord of its live incarnation, "" when none
    <ns>m/hb/<name>                  heartbeat counter
    <ns>m/hush/<name>                how long a watcher saw it stand still (_membership.silences)
    <ns>m/srv/<name>                 ServerNotes: its servers' numbers, JSON (_membership.server_notes)
    <ns>m/exit/<name>                ExitRecord: how its newest ended incarnation ended
    <ns>m/e/<seq>, <ns>m/evn         event log: one LogEntry per position; positions claimed
    <ns>m/snap/<k>, <ns>m/logk       members at the start of range k; newest range snapshotted
    <ns>m/id                         this log's token: set once, by its first reader
    <ns>m/bell/<g>, <ns>m/belln      the g-th departure rung (the last 64 kept); rings so far
    <ns>m/own/<worker>               OwnedKey lines: registry keys a worker claimed
    <ns>m/t/<worker>, <ns>m/tid      RPC worker -> member name; worker sequence counter
    <ns>m/lost/<name>/<inc>          counter electing one declarer of a loss
    <ns>m/lostpost/<name>/<inc>      counter: one "lost" event per incarnation
    <ns>m/gone/<name>/<inc>          "1" once the lost one's keys are free
    <ns>m/dep/n, <ns>m/dep/<j>       departures: counter, blocks (see _membership.departures)
    <ns>m/host                       name of the member whose process hosts the store (rank=0)
    <ns>m/rank/<r>                   RPC worker of the member holding rank r (elastic; a claim)
    <ns>w/{proc,name,size,ready,stop,left}/<rank>   static world start-up and stop  World
    <ns>rg/<group>/current           GroupRecord                                 RpcGroup
    <ns>rg/<group>/<epoch>/join/<m>  a member's member list, at creation
    <ns>rg/<group>/<epoch>/s/<key>   ServiceOwner of a service
    <ns>rg/<group>/<epoch>/v/<key>   RPC worker that paired a value
    <ns>rg/<group>/<epoch>/bar/<gen>/<m>  barrier arrivals
    <ns>rg/<group>/<epoch>/end, .../ended  keys the members left, and how many destroyed
    <ns>os/<group>/<server>/...      an ordered server's own keys               servers
    <ns>gs/<group>/<server>/...      a gradient server's own keys
    <ns>rpc, <ns>pg                  prefixes of torch's RPC and process-group rendezvous

Under torchrun, ``<restart>`` is ``r<round>``, the round its Worlds' ranks agreed on
(``_world.rounds``) through ``mlk/tr/{round, ticket/<rank>, want/<rank>,
grant/<rank>/<ticket>, ack/<round>/<rank>}``.

Why one module: the same strings are written by one process and read by another (or by
the next incarnation of the same member), so a key built in two places is a protocol
with two authors. Values are typed records with ``encode``/``decode``; the on-store text
is unchanged from earlier versions, so mixed processes still understand each other.
No state beyond the namespace string; no I/O.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, AbstractSet, Dict, List, NamedTuple, Optional, Sequence, Tuple

__all__ = [
    "Keys", "MemberRecord", "LogEntry", "OwnedKey", "ServiceOwner", "GroupRecord", "ServerNote", "ServerNotes",
    "ExitRecord", "LOST_MARK", "WOKEN_MARK", "FAILED_MARK", "STOPPED_MARK", "OPEN_EPOCH", "rebind_holder", "MAX_EXIT_CAUSE",
]

#: Written into a waited-for key of a member that is gone, to wake its waiters.
LOST_MARK = "\x00lost"
#: Written into the other keys of such a wait that are still absent: a store wait ends
#: only when every key it waits for exists. A member arriving later overwrites it.
WOKEN_MARK = "\x00woken"
#: Starts the arrival key of a member that will not come because it failed (the rest
#: says why): ``RpcGroup.fail_barrier``. Its waiters fail at once instead of timing out.
FAILED_MARK = "\x00failed:"
#: Written by a waiter's liveness thread into the key a member of a static world that began
#: to stop would have written (then what it recorded as its cause): ``_membership.stops``.
STOPPED_MARK = "\x00stopped:"
#: The epoch of an open group (``members=None``): it is never re-created.
OPEN_EPOCH = "o"


def _root(restart: str) -> str:
    return f"mlk/{restart}/"


class Keys:
    """The keys of one world, under the namespace ``ns`` (ends with ``/``).

    Methods named after a table return a full key; those ending in ``_prefix`` return a
    prefix to which the store's ``(prefix, names)`` calls append a member or rank.
    """

    __slots__ = ("ns",)

    def __init__(self, ns: str) -> None:
        self.ns = ns

    # --------------------------------------------------------------- namespaces
    @staticmethod
    def static_counter(restart: str, rank: int) -> str:
        """Counter of the static Worlds rank ``rank`` built on a store (one namespace each).

        ``restart`` is a torchrun round's root (``_world.rounds``), else "0": a store may
        outlive a world (torchrun's agent store outlives restarted workers) and stale keys
        must not leak into the next one; the k-th World of every rank meets the k-th World
        of the others.
        """
        return f"{_root(restart)}incarnation/{rank}"

    # torchrun's rounds (see _world.rounds), beside every namespace
    @staticmethod
    def round_counter() -> str:
        """Counter of the rounds drawn by the rank 0s of a torchrun job's Worlds."""
        return "mlk/tr/round"

    @staticmethod
    def round_ticket(rank: int) -> str:
        """Counter of the processes that came as ``rank`` (one ticket each)."""
        return f"mlk/tr/ticket/{rank}"

    @staticmethod
    def round_want(rank: int) -> str:
        """The ticket of the newest process that came as ``rank``."""
        return f"mlk/tr/want/{rank}"

    @staticmethod
    def round_grant(rank: int, ticket: str) -> str:
        """The round rank 0 granted to ticket ``ticket`` of ``rank``."""
        return f"mlk/tr/grant/{rank}/{ticket}"

    @staticmethod
    def round_ack(round_: int, rank: int) -> str:
        """Set by ``rank`` once it took round ``round_``."""
        return f"mlk/tr/ack/{round_}/{rank}"

    @staticmethod
    def static_world(restart: str, incarnation: int) -> "Keys":
        return Keys(f"{_root(restart)}{incarnation}/")

    @staticmethod
    def elastic_world(restart: str) -> "Keys":
        return Keys(f"{_root(restart)}e/")

    def rpc_prefix(self) -> str:
        """Prefix of torch's RPC rendezvous keys (a ``PrefixStore`` over the store)."""
        return self.ns + "rpc"

    def pg_prefix(self) -> str:
        """Prefix of the default process group's rendezvous keys."""
        return self.ns + "pg"

    def server(self, kind: str, group: str, server: str) -> str:
        """Prefix of one server's own keys: ``kind`` is ``"os"`` (ordered) or ``"gs"`` (gradient).

        The server names its keys inside this prefix; nothing else writes there.
        """
        if kind not in ("os", "gs"):
            raise ValueError(f"kind={kind!r}: a server namespace is 'os' or 'gs'")
        return f"{self.ns}{kind}/{group}/{server}/"

    def collective_prefix(self, number: int) -> str:
        """Each rank's ranks of collective group creation ``number`` (names: ranks), and
        ``read``, the count of ranks that read them (see ``_groups.creation_order``)."""
        return f"{self.ns}cg/{number}/"

    def scratch(self, tag: str) -> str:
        """A key of this world outside machinlike's tables (tests, benchmarks: their own notes)."""
        return f"{self.ns}x/{tag}"

    # ------------------------------------------------------------------ members
    def incarnations(self, member: str) -> str:
        return f"{self.ns}m/inc/{member}"

    def live(self, member: str) -> str:
        return f"{self.ns}m/live/{member}"

    def heartbeat(self, member: str) -> str:
        return f"{self.ns}m/hb/{member}"

    def heartbeat_prefix(self) -> str:
        return f"{self.ns}m/hb/"

    def silence(self, member: str) -> str:
        """The note of how long ``member``'s heartbeat stood still (``_membership.silences``)."""
        return f"{self.ns}m/hush/{member}"

    def server_notes(self, member: str) -> str:
        """``member``'s :class:`ServerNotes`: one key per member, overwritten every interval
        (``_membership.server_notes``)."""
        return f"{self.ns}m/srv/{member}"

    def exit_cause(self, member: str) -> str:
        """The :class:`ExitRecord` of ``member``'s newest incarnation known to have ended
        (``_membership.exit_causes``): one key per name, each incarnation's overwriting."""
        return f"{self.ns}m/exit/{member}"

    def probe_request(self, member: str) -> str:
        """Counter: callers whose call to ``member`` timed out ask it to probe its own agent."""
        return f"{self.ns}m/probe/{member}"

    def log_entry(self, seq: int) -> str:
        """Position ``seq`` of the event log (see ``_membership.event_log``)."""
        return f"{self.ns}m/e/{seq}"

    def log_head(self) -> str:
        """Counter: the newest range of the event log with a snapshot (older ones deleted)."""
        return f"{self.ns}m/logk"

    def log_snapshot(self, k: int) -> str:
        """The members as they stand at the start of range ``k``."""
        return f"{self.ns}m/snap/{k}"

    def log_count(self) -> str:
        """Counter: positions of the event log claimed so far (wakes readers)."""
        return f"{self.ns}m/evn"

    def log_token(self) -> str:
        """A random token set once by the log's first reader (a new store's log has another)."""
        return f"{self.ns}m/id"

    def bell_count(self) -> str:
        """Counter: departures rung on the bell so far (see ``_membership.bell``)."""
        return f"{self.ns}m/belln"

    def bell(self, ring: int) -> str:
        """Set by the ``ring``-th ring: every member's bell thread waits for the next one."""
        return f"{self.ns}m/bell/{ring}"

    def owned(self, worker: str) -> str:
        return f"{self.ns}m/own/{worker}"

    def worker(self, worker: str) -> str:
        return f"{self.ns}m/t/{worker}"

    def worker_ids(self) -> str:
        return f"{self.ns}m/tid"

    def rank(self, rank: int) -> str:
        """Claimed by the member of an elastic world that holds ``rank`` (its RPC worker)."""
        return f"{self.ns}m/rank/{rank}"

    def store_host(self) -> str:
        """The name of the member whose process hosts the store, set before its join is
        posted (absent when no member does: a launcher's or a hand-started store)."""
        return f"{self.ns}m/host"

    def departures_count(self) -> str:
        return f"{self.ns}m/dep/n"

    def departures(self, block: int) -> str:
        return f"{self.ns}m/dep/{block}"

    def lost(self, member: str, incarnation: int) -> str:
        return f"{self.ns}m/lost/{member}/{incarnation}"

    def lost_posted(self, member: str, incarnation: int) -> str:
        return f"{self.ns}m/lostpost/{member}/{incarnation}"

    def gone_prefix(self, member: str) -> str:
        """Prefix of ``m/gone/<member>/<incarnation>`` (the name is ``str(incarnation)``)."""
        return f"{self.ns}m/gone/{member}/"

    def gone(self, member: str, incarnation: int) -> str:
        return f"{self.gone_prefix(member)}{incarnation}"

    # ------------------------------------------------------------- static world
    def proc_prefix(self) -> str:
        """Process identity of each rank of a static world (names: ranks)."""
        return f"{self.ns}w/proc/"

    def name_prefix(self) -> str:
        return f"{self.ns}w/name/"

    def size_prefix(self) -> str:
        """The ``world_size`` each rank of a static world was started with (names: ranks)."""
        return f"{self.ns}w/size/"

    def ready_prefix(self) -> str:
        return f"{self.ns}w/ready/"

    def stop_prefix(self) -> str:
        return f"{self.ns}w/stop/"

    def stop_count(self) -> str:
        """How many ranks of a static world began to stop (what waits look at: ``Stops``)."""
        return f"{self.ns}w/stopping"

    def left_prefix(self) -> str:
        return f"{self.ns}w/left/"

    # ------------------------------------------------------------------- groups
    def group(self, group: str) -> str:
        """The group's current :class:`GroupRecord`."""
        return f"{self.ns}rg/{group}/current"

    def group_join_prefix(self, group: str, epoch: str) -> str:
        return f"{self.ns}rg/{group}/{epoch}/join/"

    def group_proposal(self, group: str, member: str) -> str:
        """The member list ``member`` is creating ``group`` with (read when a creation
        times out, to tell members that passed other lists from members that did not come)."""
        return f"{self.ns}gp/{group}/{member}"

    def group_end(self, group: str, epoch: str) -> str:
        """The keys the incarnation's members leave behind at destroy, one per line."""
        return f"{self.ns}rg/{group}/{epoch}/end"

    def group_ended(self, group: str, epoch: str) -> str:
        """Counter: members that destroyed the incarnation."""
        return f"{self.ns}rg/{group}/{epoch}/ended"

    def service(self, group: str, epoch: str, key: str) -> str:
        return f"{self.ns}rg/{group}/{epoch}/s/{key}"

    def value(self, group: str, epoch: str, key: str) -> str:
        return f"{self.ns}rg/{group}/{epoch}/v/{key}"

    def barrier_prefix(self, group: str, epoch: str, generation: int) -> str:
        return f"{self.ns}rg/{group}/{epoch}/bar/{generation}/"

    def holding(self, key: str) -> Optional[Tuple[str, str, str]]:
        """``(kind, group, key)`` of a service (kind ``"s"``) or paired value (``"v"``)
        key of this world, as built by :meth:`service` / :meth:`value`; None for others."""
        head = f"{self.ns}rg/"
        if not key.startswith(head):
            return None
        parts = key[len(head):].split("/", 3)  # group, epoch, kind, key
        if len(parts) != 4 or parts[2] not in ("s", "v"):
            return None
        return parts[2], parts[0], parts[3]


# ----------------------------------------------------------------------- records
class MemberRecord(NamedTuple):
    """One incarnation of a member, as its claim ``m/live/<name>`` holds it.

    Why a named tuple (a frozen dataclass before session 19): every member decodes every
    other member's join, so a world of N decodes N² of these; a frozen dataclass's
    ``__init__`` sets each field through ``object.__setattr__``, three times the cost.

    Attributes:
        member: The member's name.
        incarnation: 1 for its first process, 2 for the first replacement, ...
        worker: Its RPC worker name (changes when it renews its agent).
        rank: Its rank.
        identity: Its process identity (see ``_membership.processes.process_identity``).
    """

    member: str
    incarnation: int
    worker: str
    rank: int
    identity: str

    def encode(self) -> str:
        return f"{self.incarnation}|{self.worker}|{self.rank}|{self.identity}"

    @staticmethod
    def decode(member: str, text: str) -> "MemberRecord":
        inc, worker, rank, identity = text.split("|", 3)
        return MemberRecord(member, int(inc), worker, int(rank), identity)

    def with_worker(self, worker: str) -> "MemberRecord":
        """The same incarnation answering as another RPC worker."""
        return MemberRecord(self.member, self.incarnation, worker, self.rank, self.identity)


class LogEntry(NamedTuple):
    """One line of the event log: ``"kind|member|record"``.

    ``kind`` is ``"join"``, ``"leave"``, ``"lost"`` or ``"move"`` (a live member's new RPC
    worker). A named tuple for the reason :class:`MemberRecord` is one.
    """

    kind: str
    record: MemberRecord

    def encode(self) -> str:
        return f"{self.kind}|{self.record.member}|{self.record.encode()}\n"

    @staticmethod
    def decode(line: str) -> "LogEntry":
        """The entry of one line (its newline, if any, ignored)."""
        kind, member, inc, worker, rank, identity = line.rstrip("\n").split("|", 5)
        return LogEntry(kind, MemberRecord(member, int(inc), worker, int(rank), identity))


#: Characters an :class:`ExitRecord`'s cause keeps (a longer one is cut, ending "...").
MAX_EXIT_CAUSE = 200
# Who said how an incarnation ended, from the least to the most precise: the member that
# declared it lost (how it knew), its parent (the exit status), the member itself (the
# exception it ended with). A record of the same incarnation gives way only to a better one.
_EXIT_RANK = {"watcher": 1, "launcher": 2, "member": 3}


class ExitRecord(NamedTuple):
    """How one incarnation of a member ended: ``"<incarnation>|<pid>|<by>|<cause>"``.

    Attributes:
        incarnation: The incarnation it is about.
        pid: Its process id; 0 when unknown.
        by: Who said it: ``"member"`` (its own report of the exception it ended with),
            ``"launcher"`` (its parent, which saw its exit status) or ``"watcher"`` (the
            member that declared it lost, saying how it knew).
        cause: E.g. ``"raised ValueError: bad thing"``, ``"killed by signal SIGKILL (9)"``,
            ``"heartbeat silent for 7.6 s"``; encoded on one line, at most
            :data:`MAX_EXIT_CAUSE` characters.
    """

    incarnation: int
    pid: int
    by: str
    cause: str

    def encode(self) -> str:
        cause = " ".join(self.cause.split())  # (one line: a traceback's message can span many)
        if len(cause) > MAX_EXIT_CAUSE:
            cause = cause[:MAX_EXIT_CAUSE - 3] + "..."
        return f"{self.incarnation}|{self.pid}|{self.by}|{cause}"

    @staticmethod
    def decode(text: str) -> Optional["ExitRecord"]:
        """The record ``text`` holds; None for text of another form (written by no version of this)."""
        parts = text.split("|", 3)
        if len(parts) != 4 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in _EXIT_RANK:
            return None
        return ExitRecord(int(parts[0]), int(parts[1]), parts[2], parts[3])

    def outranks(self, other: "ExitRecord") -> bool:
        """Whether this record replaces ``other``: it is about a newer incarnation, or about
        the same one from a better-placed source (see ``by``)."""
        if self.incarnation != other.incarnation:
            return self.incarnation > other.incarnation
        return _EXIT_RANK[self.by] > _EXIT_RANK[other.by]


@dataclass(frozen=True)
class OwnedKey:
    """A registry key a worker claimed, and the holder text it claimed it with."""

    key: str
    holder: str

    def encode(self) -> str:
        return f"{self.key}\x1f{self.holder}\n"

    @staticmethod
    def decode_all(text: str) -> List["OwnedKey"]:
        out = []
        for line in text.splitlines():
            key, _, holder = line.partition("\x1f")
            out.append(OwnedKey(key, holder))
        return out


@dataclass(frozen=True)
class ServiceOwner:
    """Who serves a service: ``"s:<worker>"`` (plain) or ``"a:<worker>"`` (async_execution)."""

    worker: str
    is_async: bool

    def encode(self) -> str:
        return f"{'a' if self.is_async else 's'}:{self.worker}"

    @staticmethod
    def decode(text: str) -> "ServiceOwner":
        return ServiceOwner(text[2:], text[0] == "a")

    @staticmethod
    def worker_of(text: str) -> str:
        """The worker of an encoded owner, without building the record (a hot path)."""
        return text[2:]


def rebind_holder(holder: str, old_workers: AbstractSet[str], current: str) -> str:
    """``holder`` naming ``current`` when it names one of ``old_workers`` (after a renewal).

    A holder is a value's worker or a :class:`ServiceOwner`'s encoding.
    """
    if holder in old_workers:
        return current
    if holder[1:2] == ":" and holder[2:] in old_workers:
        return holder[:2] + current
    return holder


@dataclass(frozen=True)
class GroupRecord:
    """An RpcGroup's current incarnation: ``"<epoch>/<members>"`` (``"o/*"`` when open).

    Attributes:
        epoch: How many times the name was created before (``"o"``: an open group).
        members: The members, sorted; None for an open group.
    """

    epoch: str
    members: Optional[Tuple[str, ...]]

    def encode(self) -> str:
        return f"{self.epoch}/{'*' if self.members is None else ','.join(self.members)}"

    @staticmethod
    def decode(text: str) -> "GroupRecord":
        epoch, members = text.split("/", 1)
        return GroupRecord(epoch, None if members == "*" else tuple(members.split(",")))

    @staticmethod
    def listing(members: Sequence[str]) -> str:
        """The member list each member writes at creation (they must agree)."""
        return ",".join(members)


class ServerNote(NamedTuple):
    """One server's numbers on one member, as a summary of its ``stats()``.

    A number that does not apply to the server or its role is None (left out of the
    encoding).

    Attributes:
        kind: ``"grad"``, ``"model"``, ``"ordered"`` or ``"inference"``.
        name: The server's name.
        group: Its RpcGroup's name.
        role: The part this member plays: ``"primary"`` or ``"secondary"`` (gradient
            servers), ``"host"`` (the others).
        version: The newest version it published, made or runs.
        accepted: Pushes (requests) it took.
        applied: Pushes in the optimizer steps it made (gradient primary).
        refused: Pushes (requests) it turned away: queue full (gradient secondary, over
            ``max_pending`` for inference), a stale version (ordered, model).
        dropped: What it held and let go (at stop; of callers gone).
        queued: What it holds now.
        lag_mean, lag_max: Versions between the one a gradient was computed on and the
            step applying it.
        since: Seconds since its last version, when published.
    """

    kind: str
    name: str
    group: str
    role: str
    version: Optional[int] = None
    accepted: Optional[int] = None
    applied: Optional[int] = None
    refused: Optional[int] = None
    dropped: Optional[int] = None
    queued: Optional[int] = None
    lag_mean: Optional[float] = None
    lag_max: Optional[float] = None
    since: Optional[float] = None

    def as_dict(self) -> Dict[str, Any]:
        """Its fields by name, those that do not apply left out."""
        return {k: v for k, v in self._asdict().items() if v is not None}


class ServerNotes(NamedTuple):
    """What ``m/srv/<name>`` holds: the servers of one incarnation of a member, and when
    it wrote them. On the store: compact JSON (``{"inc": 1, "t": 1718000000.1, "s": [{...}]}``,
    each server's fields by name, floats to 3 places).

    Attributes:
        incarnation: The incarnation that wrote it (an older one's numbers are stale).
        time: When, as ``time.time()`` on the writer's host.
        servers: One note per server and role.
    """

    incarnation: int
    time: float
    servers: Tuple[ServerNote, ...]

    def encode(self) -> str:
        def rounded(note: ServerNote) -> Dict[str, Any]:
            return {k: round(v, 3) if isinstance(v, float) else v for k, v in note.as_dict().items()}
        return json.dumps({"inc": self.incarnation, "t": round(self.time, 3),
                           "s": [rounded(n) for n in self.servers]}, separators=(",", ":"))

    @staticmethod
    def decode(text: str) -> Optional["ServerNotes"]:
        """The notes in ``text``; None when it is no such record (a newer writer's fields
        beyond these are ignored)."""
        try:
            record = json.loads(text)
            notes = tuple(ServerNote(**{k: v for k, v in entry.items() if k in ServerNote._fields})
                          for entry in record["s"])
            when = float(record["t"])
            return ServerNotes(int(record["inc"]), when if math.isfinite(when) else 0.0, notes)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
