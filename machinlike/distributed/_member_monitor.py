"""Membership's liveness monitor, the clean-up after a lost member, and this member's RPC worker.

    monitor thread, each tick (liveness / 8):       the world's store
             heartbeat, read the others'            m/hb/<name>     heartbeat counter
             apply new events, check this member's RPC listener
             suspect: process gone (same host,
             read from /proc) or heartbeat
             stalled for 3/4 of liveness
    declare (one winner): release its keys,         m/lost/<name>/<inc>  elects one declarer
            prune it from the RPC group,            m/own/<transport>    registry keys it claimed
            clear m/live, post "lost"               m/gone/<name>/<inc>  set when its keys are free
            (a declarer that dies mid-way is taken over after a few leases: m/lostpost keeps it
            to one "lost" event per incarnation)
    join RPC under a fresh worker name              m/tid, m/t/<transport>  its member (RPC worker -> name)
    own RPC listener closed (see _listener): renew the agent under a new worker name, move the
            claims to it, post "move"; the others route new calls to the new worker

Why heartbeats and /proc: a SIGKILLed peer says nothing; a local one is seen gone at the
next tick through /proc (no false alarm under load), a remote one by its silent lease.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import List

from ..exception import PeerLostError
from . import _transport
from ._listener import ListenerWatch
from ._liveness import alive_here
from ._keys import MemberRecord, OwnedKey
from ._registry import deadline_left

__all__ = ["MembershipMonitor"]

log = logging.getLogger(__name__)


class MembershipMonitor:
    """Liveness and the RPC worker of :class:`~machinlike.distributed.Membership` (a mixin it inherits).

    Holds no state of its own: what these methods use (``_thread``, ``_stop``, ``_beats``,
    ``_declaring``, ``_store_lost``, ``_listener``, ``_join_args``, ``_claims``,
    ``_old_transports``, ``_me``, ``_tid``, ``transport``, ``renewals``, the live tables
    ...) is initialised in ``Membership.__init__`` (or ``enter``), which owns it.
    """

    # --------------------------------------------------------------- monitor
    def start_monitor(self) -> None:
        self._catch_up()
        if self.liveness is None or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._monitor, name=f"machinlike-liveness-{self.name}", daemon=True)
        self._thread.start()

    def _lease(self) -> float:
        return 0.75 * (self.liveness or 2.0)

    def _monitor(self) -> None:
        tick = max(0.02, (self.liveness or 2.0) / 8)
        beat_key = self.keys.heartbeat(self.name)
        while not self._stop.wait(tick):
            try:
                self.registry.add(beat_key, 1)
                self._catch_up()
                if self._listener is not None and self._listener.alive() is False:
                    self._renew()
                for rec in self._suspects():
                    self._declare(rec, time.monotonic() + 10 * tick, wait=False)
            except PeerLostError as err:
                self._on_store_lost(err)
                return
            except Exception:  # never let the monitor die silently
                log.exception("machinlike liveness monitor of %r", self.name)

    def _suspects(self) -> List[MemberRecord]:
        with self._lock:
            others = [r for m, r in self._live.items() if m != self.name]
        if not others:
            return []
        counts = self.registry.values_or_empty(self.keys.heartbeat_prefix(), [r.member for r in others])
        now = time.monotonic()
        out = []
        for rec, count in zip(others, counts):
            local = alive_here(rec.identity)
            if local is False:
                out.append(rec)
                continue
            last = self._beats.get(rec.member)
            if last is None or last[0] != count or local:
                self._beats[rec.member] = (count, now)
            elif now - last[1] > self._lease():
                out.append(rec)
        return out

    def _record_alive(self, rec: MemberRecord, wait: float) -> bool:
        local = alive_here(rec.identity)
        if local is not None:
            return local
        key = self.keys.heartbeat(rec.member)
        first = self.registry.get_or_empty(key)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:  # its heartbeat moving within a lease: alive
            self._stop.wait(min(0.1, deadline_left(deadline)))
            if self.registry.get_or_empty(key) != first:
                return True
        return False

    def _worker_dead(self, worker: str) -> bool:
        """Whether RPC worker ``worker`` belongs to no live claim (read from the store)."""
        member = self.registry.get_or_empty(self.keys.worker(worker))
        held = self.registry.get_or_empty(self.keys.live(member)) if member else ""
        if not held:
            return True
        rec = MemberRecord.decode(member, held)
        return rec.transport != worker or alive_here(rec.identity) is False

    def _token_holder_dead(self, token: str) -> bool:
        holder = _transport.token_holder(token)
        return holder is not None and holder != self.transport and self._worker_dead(holder)

    def _declare(self, rec: MemberRecord, deadline: float, wait: bool = True) -> None:
        """Make ``rec`` lost everywhere: one member (the first to ask) cleans up after it.

        Args:
            wait: When another member declares it, wait (until ``deadline``) for its keys
                to be free; the monitor does not (the event will come).
        """
        reg = self.registry
        if reg.add(self.keys.lost(rec.member, rec.incarnation), 1) != 1:
            if wait:
                try:
                    reg.wait_all(self.keys.gone_prefix(rec.member), [str(rec.incarnation)],
                                 max(0.1, deadline_left(deadline)), f"clean-up after member {rec.member!r}")
                    return
                except TimeoutError:
                    pass  # the declarer died or stalls mid-clean-up: finish it here (below)
            else:
                # The monitor never blocks on another's clean-up; it takes over only when
                # the declarer has not finished within a few ticks (it may have died too).
                first = self._declaring.setdefault((rec.member, rec.incarnation), time.monotonic())
                if time.monotonic() - first < 4 * self._lease():
                    return
            log.warning("machinlike: finishing the clean-up after member %r (incarnation %d) that another "
                        "member began", rec.member, rec.incarnation)
            deadline = time.monotonic() + 10 * max(0.02, (self.liveness or 2.0) / 8)
        else:
            log.warning("machinlike: member %r (incarnation %d, rank %d) is lost", rec.member, rec.incarnation,
                        rec.rank)
        self._free(rec, deadline)  # idempotent: releases compare the holder
        # One "lost" event per incarnation, whoever finished the clean-up.
        if reg.add(self.keys.lost_posted(rec.member, rec.incarnation), 1) == 1:
            self._post("lost", rec)

    def _free(self, rec: MemberRecord, deadline: float) -> None:
        reg = self.registry
        for owned in OwnedKey.decode_all(reg.get_or_empty(self.keys.owned(rec.transport))):
            reg.release(owned.key, owned.holder)
        if self.elastic:
            # Best effort, briefly: whoever joins next prunes stale workers itself.
            try:
                _transport.prune_workers(self._rpc_store(), self.transport, [rec.transport],
                                         min(deadline, time.monotonic() + 0.5), self._token_holder_dead)
            except TimeoutError as err:
                log.info("machinlike: %r stays listed in the RPC group for now: %s", rec.transport, err)
        reg.compare_set(self.keys.live(rec.member), rec.encode(), "")
        reg.set(self.keys.gone(rec.member, rec.incarnation), "1")

    def _on_store_lost(self, err: PeerLostError) -> None:
        self._store_lost = err
        with self._lock:
            self._changed.notify_all()
        log.error("machinlike: %s; every call of this member now fails", err)

    # ------------------------------------------------------------ RPC worker
    def _new_transport(self) -> None:
        """Take a fresh RPC worker id and name (each join attempt needs its own)."""
        tid = self.registry.add(self.keys.worker_ids(), 1) - 1
        if tid > 32000:
            raise RuntimeError("this elastic world has used up its 32,000 RPC worker ids; start a new one")
        self._tid = tid
        # torch's dynamic join parses its worker list as "name-id," entries, so a worker
        # name must not contain "-"; the unique id keeps every incarnation's name apart.
        self.transport = f"{self.name.replace('-', '_')}_{tid}"
        self.registry.set(self.keys.worker(self.transport), self.name)

    def join_transport(self, threads: int, timeout: float, deadline: float, default_timeout: float) -> None:
        """Join the world's dynamic RPC group (elastic worlds), pruning the dead first.

        A member that dies while this one joins makes torch's join fail (it calls every
        listed worker); the attempt is then undone and repeated under a fresh worker name
        until ``deadline``.

        Args:
            threads: RPC worker threads of the agent.
            timeout: Seconds for each call the join makes.
            deadline: ``time.monotonic()`` deadline of the whole join.
            default_timeout: The agent's default RPC timeout afterwards, in seconds.

        Raises:
            RuntimeError, TimeoutError: the last attempt's error, when the deadline passed.
        """
        self._join_args = (threads, timeout, default_timeout)
        store = self._rpc_store()
        while True:
            # A listed worker is stale when no live claim names it (its member was declared
            # gone, or came back as another incarnation) or its process is gone. The live
            # claims decide, not the event log: a member joins RPC before it posts "join".
            try:
                _transport.start_dynamic(store, self.transport, self._tid, threads, max(0.5, min(timeout, 5.0)),
                                         deadline, self._token_holder_dead, self._worker_dead)
                _transport.set_default_timeout(default_timeout)
                self.tables.rrefs_stale = _transport.rrefs_bound_elsewhere()
                self._listener = ListenerWatch(_transport.published_address(store, self.transport))
                return
            except RuntimeError as err:
                if deadline_left(deadline) < 1.0:
                    raise
                log.warning("machinlike: member %r: RPC join attempt failed (%s); retrying", self.name, err)
                # A pause, not a synchronisation: what failed (a silent peer renewing its
                # agent, one dying) takes a monitor tick to change.
                self._stop.wait(max(0.02, (self.liveness or 2.0) / 8))
            old = self._me.encode()
            self._new_transport()
            self._me = MemberRecord(self.name, self.incarnation, self.transport, self.rank, self._me.identity)
            self.registry.compare_set(self.keys.live(self.name), old, self._me.encode())

    # ------------------------------------------------------- transport renewal
    def _renew(self) -> None:
        """Give this member a new RPC agent (and worker name) after its listener closed.

        Its incarnation, services and values stay: the registry keys it holds move to the
        new worker name, and a "move" event tells the others. The old agent keeps serving
        the connections it has (calls under way complete), until the World stops.
        """
        old = self._me
        threads, timeout, default_timeout = self._join_args
        log.warning("machinlike: member %r: the RPC listener of %r closed (a peer vanished while connecting, "
                    "or something probed its port); restarting its RPC agent", self.name, old.transport)
        self._listener = None
        with self._claims:
            _transport.retire_current()
            self._old_transports.add(old.transport)
            self._new_transport()
            self._me = MemberRecord(self.name, self.incarnation, self.transport, self.rank, old.identity)
            self.registry.compare_set(self.keys.live(self.name), old.encode(), self._me.encode())
            try:
                self.join_transport(threads, timeout, time.monotonic() + max(10.0, 3 * timeout), default_timeout)
            except (RuntimeError, TimeoutError) as err:
                log.error("machinlike: member %r could not renew its RPC agent (%s): nobody can call it any "
                          "more; stop this process (a launcher with max_restarts brings it back)", self.name, err)
                raise
            moved = []
            for owned in OwnedKey.decode_all(self.registry.get_or_empty(self.keys.owned(old.transport))):
                new = self._current_holder(owned.holder)
                if self.registry.compare_set(owned.key, owned.holder, new) == new:
                    moved.append(OwnedKey(owned.key, new).encode())
            if moved:
                self.registry.append(self.keys.owned(self.transport), "".join(moved))
        self.renewals += 1
        self._post("move", self._me)
        with self._lock:  # this process routes to the new agent at once (the log follows)
            self._apply_move(self._me)
            self._changed.notify_all()
        log.warning("machinlike: member %r now answers as RPC worker %r", self.name, self.transport)

    def _apply_move(self, rec: MemberRecord) -> None:
        """A live member's new RPC worker (called under the lock)."""
        current = self._live.get(rec.member)
        if current is None or current.incarnation != rec.incarnation or current.transport == rec.transport:
            return
        self._live[rec.member] = rec
        self._by_transport[rec.transport] = rec.member
        # New calls go to the new worker; calls under way on the old one still complete.
        self._gone_transports.add(current.transport)
