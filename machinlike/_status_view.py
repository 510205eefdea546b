"""``python -m machinlike status ADDRESS``: a world's members, refreshed like ``top``.

    store (read only) ──read_status──► WorldStatus ──► BeatClock (when each heartbeat last moved)
                                                   └─► render ──► the terminal (cleared each refresh)
                                                       (members, then SERVERS: each alive member's
                                                       servers' numbers as it last published them)

The view reads the store through ``distributed._membership.status`` only; it keeps no state but the
:class:`BeatClock`, which turns heartbeat counters into "last beat N s ago" by watching
them move between reads.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from typing import Any, Dict, List, Optional, Sequence, TextIO, Tuple

from .distributed._membership import (
    MemberStatus, ReadOnlyStore, WorldStatus, connect_read_only, read_status,
)
from .distributed._membership import ServerNote

__all__ = ["BeatClock", "render", "as_json", "main", "exit_cell", "EXIT_WIDTH"]

#: Characters of the EXIT column (``--json`` has the whole cause).
EXIT_WIDTH = 48


class BeatClock:
    """When each member's heartbeat counter last moved, as bounded by successive reads.

    A counter that changed between reads at ``t0`` and ``t1`` last beat after ``t0``:
    shown as "< now - t0 s ago". One that did not change since the read at ``t1`` has
    not beaten since: "> now - t1 s ago" (a reader sees no finer than its refresh).
    """

    def __init__(self) -> None:
        self._last: Dict[Tuple[str, int], Tuple[int, float]] = {}  # counter, when read
        self._moved: Dict[Tuple[str, int], Tuple[float, float]] = {}  # read before, read that saw it move

    def observe(self, status: Optional[WorldStatus], now: float) -> None:
        for member in status.members if status is not None else ():
            if member.beats is None:
                continue
            key = (member.name, member.incarnation)
            seen = self._last.get(key)
            if seen is not None and seen[0] != member.beats:
                self._moved[key] = (seen[1], now)
            if seen is None or seen[0] != member.beats:
                self._last[key] = (member.beats, now)

    def describe(self, member: MemberStatus, now: float) -> str:
        if member.beats is None:
            return "none"
        if member.state != "alive":
            return "stopped"
        key = (member.name, member.incarnation)
        moved = self._moved.get(key)
        last = self._last.get(key)
        if moved is not None and last is not None and moved[1] == last[1]:
            if moved[1] == now:
                return f"<{now - moved[0]:.1f}s ago"
            return f">{now - moved[1]:.1f}s ago"
        if last is not None and now > last[1]:
            return f">{now - last[1]:.1f}s ago"
        return "?"


def _cell(items: Sequence[str], width: int) -> str:
    text = ", ".join(items) or "-"
    return text if len(text) <= width else text[:max(0, width - 3)] + "..."


def exit_cell(member: MemberStatus) -> str:
    """The EXIT column: how a member not alive ended (at most ``EXIT_WIDTH`` characters), "-"
    while it is alive or when nothing says."""
    return _cell([member.exit] if member.exit and member.state != "alive" else [], EXIT_WIDTH)


def render(address: str, status: Optional[WorldStatus], clock: BeatClock, now: float, width: int) -> str:
    """The screen for one read (plain text, ``width`` columns at most)."""
    stamp = time.strftime("%H:%M:%S")
    if status is None:
        return f"machinlike status {address}  {stamp}\nno machinlike world in this store (yet)\n"
    alive = status.alive()
    head = (f"machinlike {status.kind} world at {address}  {stamp}\n"
            f"members {len(alive)} alive of {len(status.members)}; deaths {status.deaths}, rejoins "
            f"{status.rejoins}, leaves {status.leaves}; events {status.events}; keys under {status.namespace}\n")
    columns = ("MEMBER", "STATE", "INC", "RESTARTS", "RANK", "PID", "HOST", "LAST BEAT", "EXIT")
    rows: List[Tuple[str, ...]] = [columns]
    for m in status.members:
        rows.append((m.name, m.state, str(m.incarnation), str(m.restarts), str(m.rank),
                     str(m.pid) if m.pid is not None else "-", m.hostname or "-", clock.describe(m, now),
                     exit_cell(m)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(columns))]
    fixed = sum(widths) + 2 * len(columns)
    rest = max(20, width - fixed)
    lines = []
    for i, row in enumerate(rows):
        left = "  ".join(cell.ljust(w) for cell, w in zip(row, widths))
        if i == 0:
            lines.append(f"{left}  SERVICES / SERVERS (group:key)")
        else:
            m = status.members[i - 1]
            parts = m.services + [f"{v} (paired)" for v in m.values]
            lines.append(f"{left}  {_cell(parts, rest)}")
    lines += _servers_section(status)
    return head + "\n".join(line[:width] for line in lines) + "\n"


def as_json(address: str, status: Optional[WorldStatus], clock: BeatClock, now: float) -> str:
    """One read as one line of JSON (``--json``): the view's fields, by name."""
    record: Dict[str, Any] = {"address": address, "time": time.time(), "world": None}
    if status is not None:
        record["world"] = {
            "kind": status.kind, "namespace": status.namespace, "alive": len(status.alive()),
            "deaths": status.deaths, "rejoins": status.rejoins, "leaves": status.leaves, "events": status.events,
            "members": [{"name": m.name, "state": m.state, "incarnation": m.incarnation, "restarts": m.restarts,
                         "rank": m.rank, "pid": m.pid, "host": m.hostname or None, "host_id": m.host or None,
                         "last_beat": clock.describe(m, now),
                         "services": m.services, "paired": m.values, "exit": m.exit, "exit_by": m.exit_by}
                        for m in status.members]}
        for entry, member in zip(record["world"]["members"], status.members):
            entry.update(_servers_json(member))
    return json.dumps(record)


_SERVER_COLUMNS = ("SERVER", "KIND", "MEMBER", "ROLE", "VERSION", "ACCEPTED", "APPLIED", "REFUSED", "DROPPED",
                   "QUEUED", "LAG", "SINCE VER", "AGE")
_SERVERS_TITLE = "SERVERS (as each member last published them, AGE ago; LAG: versions behind, mean/max)"


def _age(seconds: float) -> str:
    return f"{max(0.0, seconds):.1f}s"


def _server_row(member: MemberStatus, n: ServerNote, wall: float) -> Tuple[str, ...]:
    def num(value: Any) -> str:
        return "-" if value is None else str(value)

    refused = num(n.refused)
    if n.refused and n.accepted is not None:  # (the share an operator asks first: how many bounced?)
        refused += f" ({100 * n.refused / (n.refused + n.accepted):.0f}%)"
    lag = "-" if n.lag_mean is None else f"{n.lag_mean:.2f}/{num(n.lag_max)}"
    age = 0.0 if member.servers_time is None else max(0.0, wall - member.servers_time)
    since = "-" if n.since is None else _age(n.since)  # (when published, as every number here)
    return (f"{n.group}:{n.name}", n.kind, member.name, n.role, num(n.version), num(n.accepted), num(n.applied),
            refused, num(n.dropped), num(n.queued), lag, since, "-" if member.servers_time is None else _age(age))


def _servers_section(status: WorldStatus) -> List[str]:
    """The SERVERS lines: one per (server, member, role), the numbers as the member last
    published them (``-``: not this server's); none when no alive member published any."""
    wall = time.time()
    rows = sorted(_server_row(m, n, wall) for m in status.members for n in m.servers)
    if not rows:
        return []
    rows.insert(0, _SERVER_COLUMNS)
    widths = [max(len(r[i]) for r in rows) for i in range(len(_SERVER_COLUMNS))]
    return ["", _SERVERS_TITLE] + [
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]


def _servers_json(member: MemberStatus) -> Dict[str, Any]:
    """A member's servers for ``--json``: each note's fields by name, and when they were published."""
    published = member.servers_time
    return {"servers": [n.as_dict() for n in member.servers], "servers_published": published,
            "servers_age": None if published is None else round(max(0.0, time.time() - published), 3)}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m machinlike", description="Tools for machinlike jobs.")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("status", help="a live view of a world's members, read from its store (read only)",
                       description="Show a world's members, incarnations, heartbeats, restarts, services and "
                                   "servers, refreshing like top. Reads the world's store; never joins the world.")
    s.add_argument("address", help="the world's store: 'host:port' or 'tcp://host:port' (World.store_address; "
                                   "the examples print it at start)")
    s.add_argument("--once", action="store_true", help="print one view and exit (for scripts)")
    s.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes (default 2)")
    s.add_argument("--beat-window", type=float, default=1.5,
                   help="with --once: seconds between the two reads that tell a beating member from a "
                        "silent one (default 1.5: at the default liveness of 10 s a member beats every other tick of 0.5 s, "
                        "once a second; a tick is liveness/8 s, at most 0.5 s)")
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the store (default 5)")
    s.add_argument("--json", action="store_true",
                   help="one line of JSON per read (with --once, one) instead of the table, for scripts and logs")
    return p


def main(argv: Sequence[str], out: TextIO = sys.stdout) -> int:
    """Run the command line; the exit status (0 fine, the world it showed ended included;
    1 the store is unreachable; 2 usage)."""
    args = _parser().parse_args(list(argv))
    for name in ("interval", "beat_window", "timeout"):
        # (inf passed "> 0", then ended in an OverflowError traceback: cold trial 30)
        if not 0 < getattr(args, name) < 86400:
            print(f"--{name.replace('_', '-')} must be > 0 seconds and under a day, got {getattr(args, name)}",
                  file=sys.stderr)
            return 2
    try:
        store = connect_read_only(args.address, args.timeout)
    except (ValueError, ConnectionError) as err:
        print(f"machinlike status: {err}", file=sys.stderr)
        return 1 if isinstance(err, ConnectionError) else 2
    clock = BeatClock()
    # A terminal is redrawn in place; a pipe or a file gets each read after the last.
    screen = out.isatty() and not args.json

    def show(status: Optional[WorldStatus], now: float, live: bool) -> None:
        if args.json:
            out.write(as_json(args.address, status, clock, now) + "\n")
        else:
            text = render(args.address, status, clock, now, shutil.get_terminal_size((120, 40)).columns)
            if screen and live:
                text = "\x1b[H\x1b[2J" + text + f"\n(every {args.interval:g} s; Ctrl-C to quit)\n"
            out.write(text if screen or not live else text + "\n")
        out.flush()

    shown = False  # (a live view drew the world at least once)
    try:
        if args.once:
            clock.observe(_read(store), time.monotonic())
            time.sleep(args.beat_window)
            now = time.monotonic()
            status = _read(store)
            clock.observe(status, now)
            show(status, now, live=False)
            return 0
        while True:
            now = time.monotonic()
            status = _read(store)
            clock.observe(status, now)
            show(status, now, live=True)
            shown = True
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0
    except ConnectionError as err:
        print(f"machinlike status: {err}", file=sys.stderr)
        # A live view whose world ended did its job (a script waiting for the run sees 0);
        # one that never read the store did not.
        return 0 if shown else 1


def _read(store: ReadOnlyStore) -> Optional[WorldStatus]:
    if not store.answering():  # (asked first: torch's client would print C++ frames)
        raise ConnectionError("the world's store stopped answering (nothing listens at its address now); has "
                              "the world ended?")
    try:
        return read_status(store)
    except (RuntimeError, OSError) as err:  # the store went away: the world ended
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__  # (not torch's frames)
        raise ConnectionError(f"the world's store stopped answering ({why}); has the world ended?") from err
