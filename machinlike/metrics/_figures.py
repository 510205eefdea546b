"""The library's own figures as scalars: a world's members, a process's memory, servers' stats.

:class:`WorldFigures` counts a world's member events from the moment it is made (it
subscribes to ``World.on_member_change``; the counters are its own, under its lock) and
reads resident memory from ``/proc`` for the members on this host. :func:`flatten_stats`
turns any ``stats()`` dictionary of the servers into ``"<prefix>/<path>"`` tags.
"""

from __future__ import annotations

import os
import threading
from numbers import Real
from typing import Any, Dict, List, Mapping, Optional

from ..distributed._membership import event_counts, pid_in
from ..exception import PeerLostError

__all__ = ["WorldFigures", "flatten_stats", "rss_bytes"]

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: Optional[int] = None) -> Optional[int]:
    """Resident memory of process ``pid`` (None: this one), bytes; None when it cannot be read
    (gone, another host's, not Linux)."""
    try:
        with open(f"/proc/{'self' if pid is None else int(pid)}/statm") as stream:
            return int(stream.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


def flatten_stats(stats: Mapping[str, Any], prefix: str) -> Dict[str, float]:
    """The numbers of a nested ``stats()`` dictionary, as ``{"<prefix>/<key>/<subkey>": value}``.

    Strings, lists and other non-numbers are left out; booleans become 0/1.

    Example: ``flatten_stats({"primary": {"applied": 3, "state": "running"}}, "actor")``
    is ``{"actor/primary/applied": 3.0}``.
    """
    out: Dict[str, float] = {}
    for key, value in stats.items():
        tag = f"{prefix}/{key}" if prefix else str(key)
        if isinstance(value, Mapping):
            out.update(flatten_stats(value, tag))
        elif isinstance(value, Real):
            out[tag] = float(value)
    return out


class WorldFigures:
    """Members alive, deaths and rejoins of a world, and each local member's resident memory.

    Make one in the process that writes the metrics: it reads the world's event log once
    (from the store) and then follows its member events (:meth:`close` stops that), so
    the counts cover the world's whole life, not only this object's. Deaths are
    ``"lost"`` events (a process that died or went silent), rejoins are joins of an
    incarnation after the first.

    Args:
        world: A started :class:`~machinlike.distributed.World`.
    """

    def __init__(self, world: Any) -> None:
        self._world = world
        self._lock = threading.Lock()
        self._deaths = self._rejoins = self._leaves = 0
        # Subscribe first, then count what the log already holds: each event is counted by
        # exactly one of the two (by seq); events that arrive while the log is read wait.
        self._logged: Optional[int] = None  # events in the log when it was read
        self._early: List[Any] = []
        world.on_member_change(self._on_event)
        counts = event_counts(world.membership)
        with self._lock:
            self._deaths, self._rejoins, self._leaves = counts.deaths, counts.rejoins, counts.leaves
            self._logged = counts.events
            for event in self._early:
                self._count(event)
            self._early = []

    def _on_event(self, event: Any) -> None:
        with self._lock:
            if self._logged is None:
                self._early.append(event)
            else:
                self._count(event)

    def _count(self, event: Any) -> None:  # under _lock
        if self._logged is not None and event.seq < self._logged:
            return  # in the log when it was read: counted there
        if event.kind == "lost":
            self._deaths += 1
        elif event.kind == "leave":
            self._leaves += 1
        elif event.kind == "join" and event.incarnation > 1:
            self._rejoins += 1

    def sample(self) -> Dict[str, float]:
        """The figures now: ``world/members_alive``, ``world/deaths``, ``world/rejoins``,
        ``world/leaves``, and ``rss_mb/<member>`` (MB, ``2**20`` bytes) for every live
        member whose process is on this host."""
        members = self._world.membership
        alive = members.members()
        with self._lock:
            out = {"world/members_alive": float(len(alive)), "world/deaths": float(self._deaths),
                   "world/rejoins": float(self._rejoins), "world/leaves": float(self._leaves)}
        for member in alive:
            try:
                worker = members.worker_of(member)
            except PeerLostError:  # lost since members(): no figure this time
                continue
            identity = members.roster.identity_of(worker)
            if identity is None or not members.roster.on_this_host(worker):
                continue  # another host's process: its /proc is not ours to read
            rss = rss_bytes(pid_in(identity))
            if rss is not None:
                out[f"rss_mb/{member}"] = rss / 2**20
        return out

    def close(self) -> None:
        """Stop counting (unsubscribe from the world's events)."""
        self._world.remove_member_callback(self._on_event)
