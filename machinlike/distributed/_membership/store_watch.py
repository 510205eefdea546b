"""StoreWatch: a world's store that stops answering is lost to this process within a
bound, as a store that died is.

One watch per store address per process, shared by the members of the process (a test or
benchmark may run hundreds in one), from the first member's ``watch_store`` to the last
one's leave:

    probe thread   every bound / 4, unless some member's liveness thread had an answer
                   from the store since the last look (the usual case: then no request
                   at all): ``check`` of one key, on a connection of its own (notes when
                   the probe began; None once answered)
    watch thread   every bound / 8: a probe unanswered for the bound, counted only while
                   this thread itself ran on time (a stopped or starved process blames
                   nobody) ──► silent:
                     each member's Registry.mark_silent(why)
                     shut down this process's TCP connections to the store ──► every
                     request in flight or to come fails at once (DistNetworkError)
                     ──► each monitor cuts its member off: PeerLostError naming the
                         store's host, as when it died

Why: torch's TCPStore client does not honour its timeout against a server that holds the
connection but does not answer (its host stopped or hung, or cut off without a reset).
Measured on torch 2.13 with a 2 s client timeout and the server SIGSTOPped: ``get``,
``wait`` (given 1 s), ``add``, ``compare_set``, ``check``, ``multi_get``, ``delete_key`` and
``num_keys`` were all still blocked after 12 s, and an RpcGroup's ``register`` after 40 s.
A store that died fails every request at once, which machinlike handles already.

Why a floor under the bound (``SILENCE_MIN``): a store serving many members answers a
request late now and then, and a process of many members' threads can hold the probe's
answer back behind the GIL; a false verdict would cut every member of the process off.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Callable, Dict, List, Optional, Set, Tuple

import torch.distributed as dist

from ..._deadline import deadline_left
from .._store import IP, Registry, connections_to, own_client, shut_down, store_address
from . import exits

__all__ = ["SILENCE_MIN", "StoreWatch", "watch_store"]

log = logging.getLogger(__name__)

#: Seconds a store may go unanswered at least, whatever the members' liveness bound.
SILENCE_MIN = 5.0

# Seconds the probe's connection may take to open. Why not the bound: torch's client gives
# its timeout to the connection too, and looks up the store's name on each connection (a
# lost query: 5 s, then the retry), so with a bound of 5 s a World failed to start with
# "The client socket has timed out after 5000ms" where raw torch starts.
PROBE_CONNECT_S = 30.0

# (never created: a check of an absent key answers as fast as any request)
_PROBE_KEY = "mlk/store-probe"


class StoreWatch:
    """The watch of one store address in this process (see the module doc).

    Args:
        client: A connection of the watch's own to the store.
        address: The store's ``(host, port)``.
        bound: Seconds a probe may go unanswered.
    """

    def __init__(self, client: dist.Store, address: Tuple[str, int], bound: float) -> None:
        self._client: Optional[dist.Store] = client  # None once the probe thread ended
        self._address = address
        self._bound = bound
        self._closing = threading.Event()
        self._lock = threading.Lock()
        # member token -> (its registry, when its liveness thread last had an answer, its
        # closing event: a member whose event is set is dropped at the next look, as if it left)
        self._members: Dict[int, Tuple[Registry, Callable[[], float], threading.Event]] = {}
        self._began: Optional[float] = None  # when the probe in flight began; None: none is
        self._threads: List[threading.Thread] = []
        #: Why the store was declared silent; None while it answers.
        self.silenced: Optional[str] = None
        #: Connections shut down at the verdict.
        self.shut = 0
        #: Requests sent to the store (only when no liveness thread had an answer of late).
        self.probes = 0

    def add(self, token: int, registry: Registry, answered: Callable[[], float], closing: threading.Event) -> None:
        with self._lock:
            self._members[token] = (registry, answered, closing)
            if self.silenced is not None:
                registry.mark_silent(self.silenced)

    def remove(self, token: int) -> bool:
        """Forget a member; True when it was the last (the threads are asked to end)."""
        with self._lock:
            self._members.pop(token, None)
            if self._members:
                return False
        self._closing.set()
        return True

    @property
    def ended(self) -> bool:
        """Whether its threads end or ended (last member gone, store dead or declared silent)."""
        return self._closing.is_set() or self.silenced is not None

    def start(self) -> None:
        # The probe may be inside a store request when the interpreter exits: it ends
        # first, as the liveness threads do (see exits).
        exits.running(self)
        self._threads = [threading.Thread(target=self._probe, daemon=True, name="machinlike-store-probe"),
                         threading.Thread(target=self._watch, daemon=True, name="machinlike-store-watch")]
        for thread in self._threads:
            thread.start()

    def ask_to_end(self) -> None:
        """Both threads end at their next look (the interpreter's exit)."""
        self._closing.set()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds in all for both threads (after ``ask_to_end``)."""
        deadline = time.monotonic() + timeout
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(deadline_left(deadline))

    def _last_answer(self) -> float:
        """When a member's liveness thread last had an answer; members that closed are
        dropped (the watch ends with the last)."""
        with self._lock:
            for token in [t for t, (_, _, closing) in self._members.items() if closing.is_set()]:
                del self._members[token]
            members = list(self._members.values())
        if not members:
            self._closing.set()
        return max((answered() for _, answered, _ in members), default=float("-inf"))

    def _probe(self) -> None:
        client = self._client
        assert client is not None  # (only this thread clears it, as it ends)
        try:
            period = self._bound / 4
            while not self._closing.wait(period):
                last = self._last_answer()
                if self._closing.is_set():
                    return  # (its last member closed)
                if time.monotonic() - last < period:
                    continue  # (the store answered a liveness thread since the last look)
                self.probes += 1
                self._began = time.monotonic()
                try:
                    client.check([_PROBE_KEY])
                except Exception:  # (the store died or was shut down: the monitors say so)
                    self._closing.set()  # (nothing left to watch: the watch thread ends too)
                    return
                self._began = None
        finally:
            # Its connection closes now, not when a cycle holding the watch is collected.
            self._client = None
            exits.stopped(self)

    def _watch(self) -> None:
        tick = self._bound / 8
        # Which hosts answer as the store (as the kernel names them), read once the
        # probe's connection is up: no name lookup at the verdict, when the network may
        # be what failed.
        peers = set(far for _, far in connections_to(self._address[1])) or None
        looked = time.monotonic()
        since: Optional[float] = None
        while not self._closing.wait(tick):
            now = time.monotonic()
            late, looked = now - looked > 3 * tick, now
            began = self._began
            if began is None:
                since = None
            elif late:
                since = now  # (this thread did not run: count from now)
            elif since is None or since < began:
                since = began
            if since is not None and now - since > self._bound:
                # (its last answer came before the probe began: up to a probe period more)
                last = self._last_answer()
                self._declare(peers, now - (last if float("-inf") < last < since else since))
                return

    def _declare(self, peers: Optional[Set[IP]], silent: float) -> None:
        host, port = self._address
        why = (f"the world's store at {host}:{port} did not answer for {silent:.1f} s (the bound is "
               f"{self._bound:g} s; its host stopped, hung or was cut off from this one), so this process "
               f"closed its connections to it")
        with self._lock:
            self.silenced = why
            registries = [registry for registry, _, _ in self._members.values()]
        for registry in registries:
            registry.mark_silent(why)
        self.shut = sum(shut_down(fd) for fd, _ in connections_to(port, peers))
        log.error("machinlike: %s (%d connections)", why, self.shut)


_watches: Dict[Tuple[str, int], StoreWatch] = {}
_watches_lock = threading.Lock()


def watch_store(store: dist.Store, registry: Registry, liveness: float,
                answered: Callable[[], float], closing: threading.Event) -> Callable[[], None]:
    """Have this process's watch of ``store`` cover a member (starting the watch for the
    first member of the process that uses that store).

    Args:
        store: The member's client of the world's store.
        registry: The member's tables: told why, at a verdict.
        liveness: The member's liveness bound, seconds (the watch's bound is the first
            member's, and ``SILENCE_MIN`` at least).
        answered: When the member's liveness thread last had an answer from the store
            (monotonic seconds).
        closing: The member's closing event: once set, the member is dropped as if it left.

    Returns:
        What leaves the watch (the last member's leave ends it); idempotent. A store
        with no address (a HashStore in this process) is not watched.
    """
    address = store_address(store)
    if address is None:
        return lambda: None
    token = id(registry)
    with _watches_lock:
        watch = _watches.get(address)
        if watch is None or watch.ended:
            bound = max(liveness, SILENCE_MIN)
            client = own_client(store, datetime.timedelta(seconds=bound), datetime.timedelta(seconds=PROBE_CONNECT_S))
            if client is None:
                return lambda: None
            watch = _watches[address] = StoreWatch(client, address, bound)
            watch.start()
        watch.add(token, registry, answered, closing)

    def leave() -> None:
        with _watches_lock:
            last = watch.remove(token)
            if last and _watches.get(address) is watch:
                del _watches[address]
        if last:
            # Its threads end at once (the closing event wakes them) and the probe's
            # connection with them: a stopped World leaves no connection of the watch's
            # open. (A probe stuck on a silent store is left behind after 1 s.)
            watch.join(1.0)

    return leave
