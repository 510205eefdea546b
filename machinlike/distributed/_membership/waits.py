"""Waits: each ends as soon as a member it needs is gone, not at its timeout.

Owns the open store waits (which keys each one waits for, of which members) and the
pending calls per RPC worker, under its own lock. The roster is read, never written.

    wait_all(prefix, names, members)   noted here; a store wait on <prefix><name> for each
      a member it needs leaves or is   on_gone (called after Roster.apply) writes LOST_MARK
      lost                             into that member's key and WOKEN_MARK into the other
                                       absent ones: the store wait ends, LOST_MARK names who
    wait_call(fut, worker)             an Event set by the future, or by on_gone when the
                                       worker goes (the future is then still pending), or
                                       by on_cut_off when this member is cut off
    watch(worker, end)                 an async call: end(PeerLostError) then, unless it
                                       completed first (its forget was called)

Why keys are written to end a wait: a store wait blocks in torch's C++ client until every
key exists (or its timeout), and writing them is the only way to end it early.

Why no gone member slips through: a wait is noted *before* it asks the roster who is
gone, and the roster is updated *before* ``on_gone`` runs, so at least one of the two sees
the departure (both may: waking twice is harmless).
"""

from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ...exception import PeerLostError
from .._store import FAILED_MARK, LOST_MARK, STOPPED_MARK, WOKEN_MARK, MemberRecord
from .._store import Registry
from .roster import Roster
from .stops import Stops

__all__ = ["Waits"]

_Wait = Tuple[str, Dict[str, str], Optional[Dict[str, int]], bool]  # prefix, member -> name, incarnations, skip_gone


class Waits:
    """Waits that fail fast when a member they need is gone.

    Args:
        registry: The world's store tables (the waits and their wake-up marks).
        roster: Who is live (read only).
        stops: A static world's members that began to stop (see ``stops``); None: an
            elastic world's (their leave is in the log).
    """

    def __init__(self, registry: Registry, roster: Roster, stops: Optional[Stops] = None) -> None:
        self._registry = registry
        self._roster = roster
        self._stops = stops  # (a static world's: members that stop never arrive)
        self._stops_seen: Dict[int, str] = {}  # wait -> the count of stopping members it was checked at
        self._lock = threading.Lock()
        self._waits: Dict[int, _Wait] = {}
        self._wait_ids = 0
        # worker -> what ends each call pending on it (a sync call's Event.set, an async
        # call's RpcFuture.end_unanswered): called once its member is gone or this one cut off
        self._pending: Dict[str, Set[Callable[[], None]]] = {}

    def wait_all(self, prefix: str, names: Sequence[str], members: Sequence[str], timeout: float, what: str,
                 stated: Optional[float] = None, incarnations: Optional[Dict[str, int]] = None,
                 skip_gone: bool = False) -> None:
        """``Registry.wait_all`` that fails fast when a member it waits for is gone.

        ``names[i]`` is the key suffix member ``members[i]`` writes.

        Args:
            incarnations: The incarnation each member must have (a member that came back
                as a later one counts as gone); None: any.
            skip_gone: A gone member counts as arrived instead of failing the wait.

        Raises:
            PeerLostError: a member it waits for left or was lost (named); not with
                ``skip_gone``.
            RuntimeError: a member wrote that it failed instead (``FAILED_MARK``): named,
                with its reason.
            TimeoutError: as ``Registry.wait_all``.
        """
        mapping = dict(zip(members, names))
        with self._lock:
            self._wait_ids += 1
            wid = self._wait_ids
            self._waits[wid] = (prefix, mapping, incarnations, skip_gone)
        try:
            already = self._roster.not_current(members, incarnations)
            if already:
                # (skip_gone: the live members' keys are left to come: the wait goes on)
                self._wake(prefix, [mapping[m] for m in already], [] if skip_gone else list(names))
            self._registry.wait_all(prefix, names, timeout, what, stated)
            values = self._registry.values(prefix, names)
        finally:
            with self._lock:
                self._waits.pop(wid, None)
                self._stops_seen.pop(wid, None)
        failed = [(m, v) for m, v in zip(members, values) if v.startswith(FAILED_MARK)]
        if failed:
            member, why = failed[0]
            raise RuntimeError(f"{what}: {member!r} failed instead of arriving: {why[len(FAILED_MARK):]}")
        stopped = [(m, v[len(STOPPED_MARK):]) for m, v in zip(members, values) if v.startswith(STOPPED_MARK)]
        if stopped and not skip_gone:
            who = ", ".join(repr(m) for m, _ in stopped)
            raise PeerLostError(stopped[0][0], f"{what}: {who} stopped its World ({stopped[0][1]}) and will "
                                               f"not arrive")
        marked = [m for m, v in zip(members, values) if v == LOST_MARK]
        if marked and not skip_gone:
            gone = ", ".join(repr(m) for m in marked)
            raise PeerLostError(marked[0], f"{what}: {gone} left or died while being waited for")

    def wait_call(self, fut: "torch.futures.Future", worker: str, what: str) -> object:
        """The result of ``fut``, a call to ``worker``; PeerLostError as soon as it is lost.

        Raises:
            PeerLostError: the worker left or was lost while the call was pending.
            RuntimeError: what ``fut`` raised (torch's text errors, timeouts included).
        """
        done = threading.Event()
        end = done.set
        with self._lock:
            self._pending.setdefault(worker, set()).add(end)
        try:
            # (A worker retired by a renewal since the call was sent is not lost: the old
            # agent serves the calls it took until it is reaped.)
            if self._roster.resolve(worker) is None:
                raise PeerLostError(self._roster.member_of(worker), f"{what}: it left or was lost")
            fut.add_done_callback(lambda _: done.set())
            if self._roster.cut_off is not None:
                done.set()  # (cut off before this call was noted: on_cut_off missed it)
            done.wait()  # bounded: torch completes the future at the call's own timeout
            if not fut.done():
                raise self._unanswered(worker, what)
            return fut.wait()
        finally:
            self._forget(worker, end)

    def watch(self, worker: str, what: str, end: Callable[[PeerLostError], None]) -> Callable[[], None]:
        """Have ``end(error)`` called once ``worker``'s member is gone, or this member is
        cut off, while an asynchronous call to it is pending; returns what to call when the
        call completes (then nothing is kept). ``end`` runs on the thread that saw it go
        (the liveness thread), and must not block; the caller checks ``gone`` once after
        noting the call (a departure before it was noted is not seen here)."""
        def ender() -> None:
            end(self._unanswered(worker, what))

        with self._lock:
            self._pending.setdefault(worker, set()).add(ender)
        return lambda: self._forget(worker, ender)

    def gone(self, worker: str, what: str) -> Optional[PeerLostError]:
        """The error for a call to ``worker`` that cannot be answered now; None: it may be."""
        if self._roster.cut_off is not None or self._roster.resolve(worker) is None:
            return self._unanswered(worker, what)
        return None

    def _unanswered(self, worker: str, what: str) -> PeerLostError:
        """Why a call pending on ``worker`` can never be answered: this member was cut off,
        or the worker's member left or was lost."""
        cut = self._roster.cut_off
        if cut is not None:  # (names this member, not the worker: its answer can no longer come)
            return PeerLostError(cut.member, f"{what} ended unanswered: this member was cut off from "
                                             f"the world ({cut.detail})")
        member = self._roster.member_of(worker)
        gone = self._roster.departed(member)
        how = "left the world" if gone is not None and gone[0] == "left" else "was lost"
        return PeerLostError(member, f"{what}: it {how} while the call was pending")

    def _forget(self, worker: str, end: Callable[[], None]) -> None:
        with self._lock:
            waiting = self._pending.get(worker)
            if waiting is not None:
                waiting.discard(end)
                if not waiting:
                    del self._pending[worker]

    def on_gone(self, rec: MemberRecord, workers: List[str]) -> None:
        """``rec``'s incarnation left or was lost: end the calls to ``workers`` and its waits."""
        ends: List[Callable[[], None]] = []
        with self._lock:
            for worker in workers:
                ends.extend(self._pending.pop(worker, ()))
            wake = [(p, m[rec.member], [] if skip else list(m.values())) for p, m, incs, skip in self._waits.values()
                    if rec.member in m and (incs is None or incs.get(rec.member) == rec.incarnation)]
        for end in ends:
            end()  # wait_call sees its future still pending (lost); an async call fails
        for prefix, name, names in wake:
            self._wake(prefix, [name], names)

    def check_stops(self) -> None:
        """Static worlds, each liveness tick: end the pending waits for members that began
        to stop their World (see ``stops``). One request while nobody stops."""
        if self._stops is None:
            return
        with self._lock:  # (the stop's own waits are not read for: there everyone stops)
            pending = [(wid, p, m, skip) for wid, (p, m, _, skip) in self._waits.items() if self._stops.concerns(p)]
        if not pending:
            return
        count = self._stops.count()
        for wid, prefix, mapping, skip_gone in pending:
            with self._lock:
                if count in ("", "0", self._stops_seen.get(wid)) or wid not in self._waits:
                    continue
                self._stops_seen[wid] = count
            stopping = self._stops.among(prefix, mapping)
            for member, why in stopping.items():
                self._registry.compare_set(prefix + mapping[member], "", STOPPED_MARK + why)
            if stopping and not skip_gone:  # (the others' keys too: the wait ends now)
                self._wake(prefix, [], [n for m, n in mapping.items() if m not in stopping])

    def on_cut_off(self) -> None:
        """This member is cut off (Roster.mark_cut_off): end every pending call at once.

        Why: a member cut off by a partition, or declared lost after a stall, never gets
        the answers of its pending calls; without this they waited out their timeout.
        (Store waits end by themselves: the store is gone, or they fail as it answers.)
        """
        with self._lock:
            ends = [end for waiting in self._pending.values() for end in waiting]
            self._pending.clear()
        for end in ends:
            end()  # wait_call sees the future still pending and the roster cut off

    def _wake(self, prefix: str, lost: Sequence[str], names: Sequence[str]) -> None:
        """Mark ``lost`` keys of a wait as gone and fill its other absent keys, so it ends."""
        try:
            for name in lost:
                self._registry.compare_set(prefix + name, "", LOST_MARK)
            for name in names:
                self._registry.compare_set(prefix + name, "", WOKEN_MARK)
        except PeerLostError:
            pass
