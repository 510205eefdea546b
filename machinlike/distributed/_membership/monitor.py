"""Monitor: the liveness thread, and the clean-up after a lost member.

Owns the one thread of membership, what it last saw of each member's heartbeat, and the
losses another member began to clean up. Each tick it beats, catches up with the log,
checks this member's RPC listener, and declares the suspects lost.

    each tick (liveness / 8, at most 0.5 s; at once   the world's store
      when a watched process here exits: PidWatch)
      heartbeat (every other tick where the silence   m/hb/<name>   heartbeat counter
        bound spans 8 ticks: the default liveness)
      read the watched members' heartbeats and the    m/evn
        log counter (Watch: k ring successors, or all)
      EventLog.catch_up (Roster, Waits, callbacks)    m/e/<seq>
      declared lost itself? cut off: calls fail, stop
      listener closed, recycling due, or its own agent
        silent to a probe call (AgentProbe: sent once a
        call timed out, here or a peer's to it, which
        bumps m/probe/<name>)? renew on a thread of its   m/probe/<name>
        own (Endpoint, Claims), post "move"
      suspect (a watched member): process gone (same
        host, /proc) or heartbeat stalled for the watch's
        silence bound by this thread's own looks (from    m/hush/<name>  (Silences)
        the silence an earlier watcher noted), and
        still stalled when read once more
    declare (one winner):                             m/lost/<name>/<inc>  elects the declarer
      record how it knew, unless told better; log     m/exit/<name>  (exit_causes)
        "is lost: <the cause recorded>"
      free its keys (Claims.free), clear m/live,      m/own/<worker>
      set m/gone, post "lost",                        m/gone/<name>/<inc>, m/lostpost/...
      record the departure (Departures), then prune   m/dep/...
      its worker from RPC (waits for torch's token)
      (a declarer that dies mid-way is taken over after 6 s; m/lostpost keeps it
      to one "lost" event per incarnation)

Why heartbeats and /proc: a SIGKILLed peer says nothing; a local one is seen gone the
moment it exits (its pidfd; /proc at the next tick where there is none), with no false
alarm under load, a remote one by its silent lease.

The thread starts before the member's first catch-up with the log, and only beats until
that is done (see start). At the interpreter's exit, a hook ends every liveness thread
of the process first (see exits).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable, Deque, Dict, List, Optional, Tuple

from ...exception import PeerLostError
from .. import _transport
from .._transport import AgentProbe
from . import exits
from .claims import Claims
from .departures import Departures
from .endpoint import Endpoint
from .event_log import EventLog
from .exit_causes import detected
from .pidwatch import PidWatch
from .._store import Keys, MemberRecord, Registry
from .processes import DEFAULT_LIVENESS, host_name, running_here, tick_of
from ..._deadline import deadline_left
from .roster import Roster
from .silences import Silences
from .watch import AllWatch, Watch

__all__ = ["Monitor"]

log = logging.getLogger(__name__)


class Monitor:
    """Liveness of the world as this member checks it.

    Args:
        registry: The world's store tables.
        keys: The world's keys.
        roster: Who is live (read; told when the store is lost).
        events: The event log (read each tick; "lost" and "move" posted).
        claims: This member's keys (moved on renewal) and the lost ones' (freed).
        endpoint: This member (heartbeat name, RPC worker, renewal).
        departures: Where each loss it posts is recorded (its records go much later).
        liveness: Seconds within which a dead member is detected; None: no thread.
        elastic: Whether RPC is a dynamic group (a lost worker is pruned from it).
        closing: Set when this member leaves or stops: the thread ends.
        watch: Whom the thread checks and how it reads them (see watch); None: every
            member (the design before issue 37).
        pids: The thread's sleep, cut short when a watched process of this host exits
            (``closing`` must wake it: a WakingEvent); None: it sleeps on ``closing``.
    """

    #: Called each tick once the log is read (a static world's Waits.check_stops).
    ticked: Callable[[], None] = staticmethod(lambda: None)

    def __init__(self, registry: Registry, keys: Keys, roster: Roster, events: EventLog, claims: Claims,
                 endpoint: Endpoint, departures: Departures, liveness: Optional[float], elastic: bool,
                 closing: threading.Event, watch: Optional[Watch] = None, pids: Optional[PidWatch] = None) -> None:
        self._registry = registry
        self._keys = keys
        self._roster = roster
        self._events = events
        self._claims = claims
        self._endpoint = endpoint
        self._departures = departures
        self._liveness = liveness
        self._elastic = elastic
        self._closing = closing
        self.watch = watch if watch is not None else AllWatch(registry, keys, roster, events)
        self._pids = pids
        self._thread: Optional[threading.Thread] = None
        # The agent renewal under way, on a thread of its own (see _start_renewal).
        self._renewing: Optional[threading.Thread] = None
        self._caught_up = threading.Event()  # set once start's first catch-up is done
        # The watched members' heartbeat timers, and the notes of long silences (the ring's
        # watchers can all die; with "all", everyone watches: no notes); only the thread.
        self.silences = Silences(registry, keys, notes=not isinstance(self.watch, AllWatch))
        # Watched members silent for a quarter of the bound (2 ticks at least) at the last
        # look (the ring watches past them: see RingWatch).
        self._silent = 0
        # Losses another member began to clean up -> when this one first saw that.
        self._declaring: Dict[Tuple[str, int], float] = {}
        # When this thread last looked (monotonic): a look much later than a tick means
        # this process itself was starved or stopped, and what it saw before is stale.
        self._looked: Optional[float] = None
        #: Suspects found alive by the re-read before declaring (a beat that just came).
        self.spared = 0
        # Probes of this member's own agent (elastic: a wedged one is renewed).
        self._probe = AgentProbe(liveness) if elastic and liveness is not None else None
        # Members a call of this process timed out on, to ask for a probe (see call_timed_out).
        self._timed_out: Deque[str] = collections.deque(maxlen=64)
        self._probe_requests: Optional[str] = None  # m/probe/<me> as last read (None: not yet)
        #: When this thread last had an answer from the store (monotonic): while it is
        #: recent, the StoreWatch need not ask the store itself.
        self.store_answered = time.monotonic()

    @property
    def pid_wakes(self) -> int:
        """Sleeps cut short because a watched process of this host exited."""
        return self._pids.woken if self._pids is not None else 0

    def _tick(self) -> float:
        return tick_of(self._liveness)

    def _beat_every(self) -> int:
        """Ticks between heartbeats: 2 when the watch's silence bound spans 8 ticks or more, else 1."""
        return 2 if self.watch.silence(self._liveness) >= 8 * self._tick() - 1e-9 else 1

    def lease(self) -> float:
        """Seconds a heartbeat may stall before its member is suspected."""
        return 0.75 * (self._liveness or DEFAULT_LIVENESS)

    def call_timed_out(self, member: str) -> None:
        """A call of this process to ``member`` timed out (any thread; returns at once):
        probe this member's own agent, and ask ``member`` to probe its own (next tick)."""
        if self._probe is not None:
            self._probe.request()
            self._timed_out.append(member)

    def _probes(self, ticks: int) -> Optional[str]:
        """Post the probe requests of this process's timed-out calls, read the others' for
        this member (every 4th tick), and check this member's probe; why to renew, or None."""
        probe = self._probe
        if probe is None:
            return None
        asked = set()
        while self._timed_out:
            asked.add(self._timed_out.popleft())
        for member in asked - {self._endpoint.name}:
            if self._roster.incarnation_of(member) is not None:  # (a gone member's key would stay)
                self._registry.add(self._keys.probe_request(member), 1)
        if ticks % 4 == 0:
            count = self._registry.get_or_empty(self._keys.probe_request(self._endpoint.name))
            if self._probe_requests is not None and count != self._probe_requests:
                probe.request()
            self._probe_requests = count
        return probe.check(self._endpoint.me.worker)

    # ------------------------------------------------------------------- thread
    def start(self) -> None:
        """Start the thread (once; none without liveness), then catch up with the log.

        Why the thread first: this member's join is posted by now, and its watchers time its
        heartbeat from the moment they see the join. A first catch-up that outlasted the
        silence bound (a thousand members joining at once, 128 to a process, at
        ``liveness=2``) got live members declared lost before their first beat. The
        thread beats from the start, and watches once that catch-up is done.
        """
        if self._liveness is not None and self._thread is None:
            exits.running(self)  # (ended first at the interpreter's exit: see exits)
            self._thread = threading.Thread(target=self._run, name=f"machinlike-liveness-{self._endpoint.name}",
                                            daemon=True)
            self._thread.start()
        try:
            self._events.catch_up()
        except BaseException:
            self._closing.set()  # (a member that failed to start must not go on beating)
            raise
        finally:
            self._caught_up.set()

    def ask_to_end(self) -> None:
        """Set ``closing``: the thread ends at its next tick (the interpreter's exit)."""
        self._closing.set()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for the thread and a renewal under way to
        end (``closing`` must be set)."""
        deadline = time.monotonic() + timeout
        for thread in (self._thread, self._renewing):
            if thread is not None and thread is not threading.current_thread():
                thread.join(deadline_left(deadline))

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            self.watch.disconnect()
            exits.stopped(self)
            if self._pids is not None:
                self._pids.close()

    def _sleep(self, tick: float) -> bool:
        """Sleep a tick (less when a watched process here exits); whether closing is set."""
        if self._pids is None:
            return self._closing.wait(tick)
        return self._pids.sleep(tick, self._closing)

    def _loop(self) -> None:
        self.watch.connect()
        tick = self._tick()
        beat_key = self._keys.heartbeat(self._endpoint.name)
        # Beat every other tick when the watchers' silence bound spans 8 ticks or more (the
        # default liveness: 15): a quarter fewer store requests, and a gap between beats of
        # 2 ticks still leaves 6 ticks of room. A tick that comes late (this process was
        # stopped or starved) beats at once, so a pause costs at most one tick more.
        every = self._beat_every()
        beaten = float("-inf")
        ticks = 0
        pid_watched: Optional[List[MemberRecord]] = None
        while not self._sleep(tick):
            ticks += 1
            try:
                now = time.monotonic()
                if every == 1 or now - beaten >= 1.5 * tick:
                    self._registry.add(beat_key, 1)
                    beaten = self.store_answered = now
                if not self._caught_up.is_set():
                    continue  # (the joining thread reads the log so far: beat only, until it is done)
                # (catches up with the log too; the ring looks past the silent ones)
                watched, counts = self.watch.tick(self._endpoint.name, self._silent)
                self.store_answered = time.monotonic()
                if self._pids is not None and watched is not pid_watched:
                    # (the watch hands back the same list until the roster changes)
                    self._pids.watch(watched)
                    pid_watched = watched
                if self._declared_lost():
                    return
                self.ticked()
                if self._renewing is not None and self._renewing.is_alive():
                    pass  # one renewal at a time; this thread goes on watching the others
                elif self._endpoint.listener_closed():
                    self._start_renewal(recycle=False)
                elif self._endpoint.pipes.due() or self._endpoint.aged():
                    self._start_renewal(recycle=True)
                elif self._probe is not None:
                    wedged = self._probes(ticks)
                    if wedged:
                        self._start_renewal(recycle=False, why=wedged)
                # A retired agent goes once idle and every member has seen the move (they
                # catch up every tick), or once any call on it would have timed out.
                now = time.monotonic()
                reaped = _transport.reap_retired(now - 16 * tick, now - self._endpoint.rpc_timeout - 2 * tick)
                if reaped:
                    log.info("machinlike: member %r shut down retired RPC agents %s", self._endpoint.name, reaped)
                    self._endpoint.forget_retired(reaped)
                for rec, why in self._suspects(watched, counts):
                    self.declare(rec, time.monotonic() + 10 * tick, wait=False, why=why)
            except PeerLostError as err:
                self._roster.mark_cut_off(err)
                log.error("machinlike: %s; every call of this member now fails", err)
                return
            except Exception:  # never let the monitor die silently
                log.exception("machinlike liveness monitor of %r", self._endpoint.name)

    def _declared_lost(self) -> bool:
        """Whether the others declared *this* member lost (it was silent for a lease: a
        process stopped, starved of CPU, or holding the GIL that long); then every call of
        this member fails from now on, saying so, instead of meeting freed keys one by one."""
        if self._roster.gone(self._endpoint.name) != "lost":
            return False
        err = PeerLostError(self._endpoint.name, (
            f"this member was declared lost by the others: its heartbeat stopped for more than "
            f"{self.watch.silence(self._liveness):.3g} s (its process was stopped, starved of CPU or held the GIL "
            f"that long), so its keys were freed and its peers went on without it; give World(liveness=...) a "
            f"bound longer than such pauses (now {self._liveness or DEFAULT_LIVENESS:g} s), or leave and join again"))
        self._roster.mark_cut_off(err)
        log.error("machinlike: %s", err)
        return True

    def beat(self) -> None:
        """Count one heartbeat now (before "join" is posted: watchers read the key at once)."""
        self._registry.add(self._keys.heartbeat(self._endpoint.name), 1)

    def _suspects(self, watched: List[MemberRecord], counts: List[str]) -> List[Tuple[MemberRecord, str]]:
        """The watched members to declare lost, each with how it was found: a process gone
        here (``/proc``), or a heartbeat this thread saw stalled for the watch's whole silence bound.

        A stall counts only from looks of a thread that was not starved: after a look
        that came late (this process was starved or stopped) every timer starts again, so
        a starved watcher does not blame the members it could not see. A timer goes on
        from the silence an earlier watcher noted (see silences). A suspect's heartbeat is
        read once more before it is declared (a beat that just came spares it).
        """
        now = time.monotonic()
        starved = self._looked is not None and now - self._looked > 3 * self._tick()
        self._looked = now
        silences = self.silences
        silences.keep({(r.member, r.incarnation) for r in watched})
        live = {(r.member, r.incarnation) for r in self._roster.others(self._endpoint.name)} \
            if self._declaring else set()
        for gone in [k for k in self._declaring if k not in live]:  # (its "lost" came)
            del self._declaring[gone]
        bound = self.watch.silence(self._liveness)
        quiet = max(bound / 4, 2 * self._tick())  # (silent: the ring watches past it)
        out = []
        silent = 0
        writer = True  # (no member before it in this list is heard: this one writes its notes)
        for rec, count in zip(watched, counts):
            if self._roster.incarnation_of(rec.member) != rec.incarnation:
                continue  # gone (or replaced) in the events this tick read
            local = running_here(rec.identity)  # (None: remote, or stopped: its heartbeat says)
            if local is False:
                out.append((rec, "process gone"))
                continue
            if local or starved:
                silences.restart(rec, count, now)
                writer = False
                continue
            still = silences.look(rec, count, now, quiet, writer)  # (goes on from another watcher's note)
            if still >= quiet:
                silent += 1
            else:
                writer = False
            if still > bound:
                again = self._registry.get_or_empty(self._keys.heartbeat(rec.member))
                if again != count:
                    self.spared += 1
                    silent -= 1
                    silences.restart(rec, again, time.monotonic())
                else:
                    out.append((rec, f"heartbeat silent for {still:.1f} s"))
        self._silent = silent
        return out

    def _start_renewal(self, recycle: bool, why: Optional[str] = None) -> None:
        """Renew this member's agent on a thread of its own.

        Why: the new agent's join calls every listed member, and waits for one that is
        silent (a host cut off from the network) until it is pruned or the join's deadline
        passes, 10 s or more. Run on the liveness thread, that wait stopped this member
        from declaring anyone lost, the silent member included, so the join could only
        fail; here the liveness thread goes on, declares the silent member lost and
        prunes it, and the join's next attempt goes through without it.
        """
        self._renewing = threading.Thread(target=self._renew_reporting, args=(recycle, why), daemon=True,
                                          name=f"machinlike-renew-{self._endpoint.name}")
        self._renewing.start()

    def _renew_reporting(self, recycle: bool, why: Optional[str]) -> None:
        try:
            self._renew(recycle, why)
        except PeerLostError as err:
            self._roster.mark_cut_off(err)
            log.error("machinlike: %s; every call of this member now fails", err)
        except Exception:  # logged by the endpoint too; never let it vanish silently
            log.exception("machinlike: renewing the RPC agent of %r", self._endpoint.name)

    def _renew(self, recycle: bool = False, why: Optional[str] = None) -> None:
        self._claims.renewed(lambda: self._endpoint.renew(recycle, why))
        me = self._endpoint.me
        self._events.post("move", me)
        self._roster.apply("move", me)  # this process routes to the new agent at once (the log follows)
        # (a recycling is routine: its reason was logged at INFO; a renewal's at WARNING)
        log.log(logging.INFO if recycle else logging.WARNING, "machinlike: member %r now answers as RPC worker %r",
                me.member, me.worker)

    # ---------------------------------------------------------------- the lost
    def record_alive(self, rec: MemberRecord, wait: float) -> bool:
        """Whether ``rec``'s process lives: ``/proc`` here, else its heartbeat moving within ``wait`` s."""
        local = running_here(rec.identity)
        if local is not None:
            return local
        key = self._keys.heartbeat(rec.member)
        first = self._registry.get_or_empty(key)
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:  # its heartbeat moving within a lease: alive
            self._closing.wait(min(0.1, deadline_left(deadline)))
            if self._registry.get_or_empty(key) != first:
                return True
        return False

    def declare(self, rec: MemberRecord, deadline: float, wait: bool = True, why: str = "") -> None:
        """Make ``rec`` lost everywhere: one member (the first to ask) cleans up after it.

        Args:
            wait: When another member declares it, wait (until ``deadline``) for its keys
                to be free; the monitor does not (the event will come).
            why: How it was found dead, recorded as its exit cause unless its launcher or
                itself told more (see exit_causes), and said in the "is lost" line.
        """
        reg = self._registry
        if reg.add(self._keys.lost(rec.member, rec.incarnation), 1) != 1:
            if wait:
                try:
                    reg.wait_all(self._keys.gone_prefix(rec.member), [str(rec.incarnation)],
                                 max(0.1, deadline_left(deadline)), f"clean-up after member {rec.member!r}")
                    return
                except TimeoutError:
                    pass  # the declarer died or stalls mid-clean-up: finish it here (below)
            else:
                # The monitor never blocks on another's clean-up; it takes over only when
                # the declarer has not finished within a few ticks (it may have died too).
                # (24 ticks of at most 0.25 s: the same 6 s since ticks follow liveness.)
                first = self._declaring.setdefault((rec.member, rec.incarnation), time.monotonic())
                if time.monotonic() - first < 24 * min(self._tick(), 0.25):
                    return
            log.warning("machinlike: finishing the clean-up after member %r (incarnation %d) that another "
                        "member began", rec.member, rec.incarnation)
            deadline = time.monotonic() + 10 * self._tick()
        else:
            known = detected(reg, self._keys, rec, why)  # (the cause recorded, or how this member knew)
            log.warning("machinlike: member %r (incarnation %d, rank %d, host %s) is lost%s", rec.member,
                        rec.incarnation, rec.rank, host_name(rec.identity) or "?", known)
        released, workers = self._release(rec)  # idempotent: releases compare the holder
        # One "lost" event per incarnation, whoever finished the clean-up.
        if reg.add(self._keys.lost_posted(rec.member, rec.incarnation), 1) == 1:
            self._events.post("lost", rec)
            self._departures.record(rec.member, rec.incarnation, released)
        # After the event: the prune waits for torch's membership token, which joins and
        # renewals hold (a death that sends its callers into renewals held it for seconds,
        # and the "lost" event waited behind it: issue 37). Nothing needs it first: the
        # worker's entry is gone (forget), so whoever joins next prunes it anyway.
        self._prune(workers, deadline)

    def free(self, rec: MemberRecord, deadline: float) -> List[str]:
        """Release ``rec``'s keys, clear its claim, mark it gone, drop its worker from RPC;
        returns the keys released (for :class:`Departures`)."""
        released, workers = self._release(rec)
        self._prune(workers, deadline)
        return released

    def _release(self, rec: MemberRecord) -> Tuple[List[str], List[str]]:
        """``free``'s store work: keys, claim, worker entries, ``m/gone``; returns the keys
        released and ``rec``'s worker names (the record's and the claim's).

        ``rec`` may be stale: the incarnation may have renewed its agent (a new worker name,
        its keys moved there) after this view last heard of it. So the claim as the store
        holds it now names the worker whose keys are freed too, and it is cleared by its
        current text; before, a stale record left the claim held for good, and the next
        incarnation's ``enter`` spun on it until its deadline.
        """
        live = self._keys.live(rec.member)
        workers = [rec.worker]
        # Its keys go before its claim: the next incarnation waits for the claim to clear
        # (Membership.enter), then registers the same services at once; with the claim
        # cleared first, it found them still held by its predecessor (a KeyError naming
        # itself, seen in the a3c chaos test).
        released: List[str] = self._claims.free(rec.worker)
        for _ in range(3):  # a renewal between the read and the clear: read again (rare)
            held = self._registry.get_or_empty(live)
            now = MemberRecord.decode(rec.member, held) if held else None
            if now is None or now.incarnation != rec.incarnation:
                break  # already cleared, or a newer incarnation's claim: not ours to touch
            if now.worker not in workers:
                workers.append(now.worker)
                released += self._claims.free(now.worker)
            if self._registry.compare_set(live, held, "") == "":
                break
        if self._elastic:
            for worker in workers:
                # Its entry first: whoever prunes the RPC group's list next (this member
                # in _prune, or the next joiner) then drops its address too.
                self._endpoint.forget(worker)
        self._registry.set(self._keys.gone(rec.member, rec.incarnation), "1")
        return released, workers

    def _prune(self, workers: List[str], deadline: float) -> None:
        """Drop ``workers`` from the dynamic RPC group (briefly, best effort: Endpoint.prune)."""
        if self._elastic:
            for worker in workers:
                self._endpoint.prune(worker, deadline)
