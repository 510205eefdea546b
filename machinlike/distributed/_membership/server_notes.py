"""ServerNotesPublisher: the numbers of this member's servers, written into the store
every few seconds for ``python -m machinlike status``.

    server built ──► add(server._notes) ──► (first one) the publisher's thread starts
    server closed ─► its withdraw()     ──► (last one) the key is deleted, the thread ends

    thread, every interval           its own store connection (requests end after 5 s)
      each live source's notes ────► set m/srv/<name> = ServerNotes(incarnation, time, notes)
      no source left / closing ────► delete m/srv/<name>; the thread ends
    Membership.leave / close ──► close(): wakes the thread at once (an Event, not a sleep)

    each write: compare-and-set against what this thread wrote last
      the key is gone (reaped: this member was declared lost) ─┐
      a later incarnation of this name holds it ───────────────┴► superseded: never writes again
      an earlier incarnation's leftover ──► replaced

Why one key per member, overwritten: the store is one thread serving the whole world;
a thousand members each writing every 5 s is 200 small writes a second, a tenth of what
their heartbeats cost, and the keys never grow past one per member name (a lost member's
goes with its other records, see ``departures``). Why a connection of its own: its
requests get a short timeout, and a slow write never queues behind, or ahead of, the
heartbeat on the World's connection. Why the sources are held weakly: a server dropped
without ``close()`` leaves the notes instead of being kept alive by them.

A world without servers pays nothing: no thread, no connection, no key. A failed write
(the store gone or silent) is logged once and never reaches a server; the next interval
tries again on a fresh connection, once a plain connection to the store succeeds (torch's
client would print its C++ warnings for every refused attempt). Why compare-and-set: a
member paused past the loss bound (SIGSTOP, a swapping host) is declared lost and may be
restarted under its name; when the old process resumes, its thread must neither bring back
the key the others reaped nor overwrite its successor's numbers, which the status view would
then hide as another incarnation's. Its delete at the end removes only what it wrote.
"""

from __future__ import annotations

import datetime
import itertools
import logging
import math
import os
import socket
import threading
import time
import weakref
from typing import Callable, Dict, List, Optional, Sequence, Set

import torch.distributed as dist

from .._store import Keys, ServerNote, ServerNotes, own_client, store_address, value_or_empty
from ..._deadline import deadline_left
from . import exits

__all__ = ["ServerNotesPublisher", "INTERVAL_ENV", "DEFAULT_INTERVAL", "MIN_INTERVAL", "stats_interval"]

log = logging.getLogger(__name__)

#: Seconds between two writes of a member's server numbers; "0" turns them off.
INTERVAL_ENV = "MACHINLIKE_SERVER_STATS_INTERVAL"
DEFAULT_INTERVAL = 5.0
#: The shortest interval taken (a shorter one would cost the store more than the heartbeats).
MIN_INTERVAL = 0.1
#: Seconds each store request of the publisher may take (its connection's timeout).
STORE_TIMEOUT_S = 5.0

Summary = Callable[[], Sequence[ServerNote]]


def stats_interval() -> float:
    """The interval from ``MACHINLIKE_SERVER_STATS_INTERVAL`` (seconds; default 5; 0: off).

    Raises:
        ValueError: it is not 0 nor a number of seconds of at least ``MIN_INTERVAL``.
    """
    text = os.environ.get(INTERVAL_ENV, "")
    if not text:
        return DEFAULT_INTERVAL
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (value == 0 or (math.isfinite(value) and value >= MIN_INTERVAL)):
        raise ValueError(f"{INTERVAL_ENV}={text!r} must be a number of seconds of at least {MIN_INTERVAL:g} "
                         f"(0 turns the servers' numbers off); unset it for the default {DEFAULT_INTERVAL:g}")
    return value


class ServerNotesPublisher:
    """Writes this member's servers' notes into ``m/srv/<name>``, from a thread started
    by the first :meth:`add`.

    Args:
        store: The world's store (the thread opens a connection of its own to it).
        keys: The world's keys.
        name: This member's name.
        incarnation: This member's current incarnation (read at each write).
        interval: Seconds between writes; 0: never write (``add`` does nothing).
    """

    def __init__(self, store: dist.Store, keys: Keys, name: str, incarnation: Callable[[], int],
                 interval: float) -> None:
        self._store = store
        self._key = keys.server_notes(name)
        self._name = name
        self._incarnation = incarnation
        self.interval = interval
        self._lock = threading.Lock()  # guards the three below
        self._sources: Dict[int, Callable[[], Optional[Summary]]] = {}
        self._thread: Optional[threading.Thread] = None
        self._closed = False
        self._started: Optional[threading.Thread] = None  # the newest thread started, for join
        self._tokens = itertools.count()
        # Set to wake the thread before its interval is up: a source withdrawn, or closing.
        self._wake = threading.Event()
        self._told: Set[str] = set()  # the failures logged (once each: "store", a server's own; only the thread)
        self._mine: Optional[str] = None  # the text the key holds from this member's last write (only the thread)
        #: Whether another incarnation of this name took the key over (or the others reaped it
        #: after declaring this one lost): nothing is written from then on.
        self.superseded = False

    def add(self, summarize: Summary) -> Callable[[], None]:
        """Publish ``summarize()``'s notes from now on (a bound method is held weakly).

        Returns:
            ``withdraw()``: stop publishing them (safe to call twice); the last withdrawn
            deletes the key.
        """
        if not self.interval:
            return lambda: None
        ref: Callable[[], Optional[Summary]]
        if hasattr(summarize, "__self__") and hasattr(summarize, "__func__"):
            ref = weakref.WeakMethod(summarize)
        else:
            ref = lambda: summarize  # noqa: E731  (a plain function: nothing to outlive)
        with self._lock:
            if self._closed:
                return lambda: None
            token = next(self._tokens)
            self._sources[token] = ref
            if self._thread is None:
                self._thread = self._started = threading.Thread(target=self._run, name="machinlike-server-notes",
                                                                daemon=True)
                exits.running(self)  # (a thread inside a store request must not meet the interpreter's end)
                self._thread.start()
        return lambda: self._withdraw(token)

    def _withdraw(self, token: int) -> None:
        with self._lock:
            if self._sources.pop(token, None) is None:
                return
        self._wake.set()

    def ask_to_end(self) -> None:
        """Make the thread delete the key and end now (it is not waited for)."""
        with self._lock:
            self._closed = True
        self._wake.set()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the thread to end."""
        thread = self._started
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def close(self, timeout: float) -> None:
        """End publishing for good: the key is deleted, the thread ends (waited for at
        most ``timeout`` seconds; one held by a silent store ends with its request)."""
        self.ask_to_end()
        self.join(timeout)

    # ------------------------------------------------------------------ the thread
    def _live(self) -> Optional[List[Summary]]:
        """The live sources' summaries (the collected servers' entries dropped); None once
        closing or when none is left."""
        with self._lock:
            summaries = []
            for token, ref in list(self._sources.items()):
                summarize = ref()
                if summarize is None:  # its server was collected without close()
                    del self._sources[token]
                else:
                    summaries.append(summarize)
            return summaries if summaries and not self._closed else None

    def _run(self) -> None:
        try:
            self._loop()
        finally:
            with self._lock:
                if self._thread is threading.current_thread():  # (it ended on an error)
                    self._thread = None
                    exits.stopped(self)

    def _loop(self) -> None:
        conn: Optional[dist.Store] = None  # (dropped with this frame: the connection closes)
        written = False
        last = -math.inf
        while True:
            self._wake.clear()  # (before the look: a wake after it ends the wait below)
            summaries = self._live()
            if summaries is None:
                if written:  # the key goes first; then look again (a server may come meanwhile)
                    conn = self._write(conn, None)
                    written = False
                    continue
                with self._lock:
                    if self._closed or not self._sources:
                        self._thread = None
                        exits.stopped(self)
                        return
                continue
            if time.monotonic() - last >= self.interval:
                last = time.monotonic()
                notes = [note for summarize in summaries for note in self._notes_of(summarize)]
                conn = self._write(conn, ServerNotes(self._incarnation(), time.time(), tuple(notes)).encode())
                written = written or conn is not None
                if self.superseded:
                    self.ask_to_end()
                    written = False  # (the key is not this member's to delete)
                    continue
            summaries = None  # (held over the wait, they would keep a dropped server alive for good)
            self._wake.wait(deadline_left(last + self.interval))

    def _notes_of(self, summarize: Summary) -> Sequence[ServerNote]:
        try:
            return summarize()
        except Exception as err:  # one server's failure leaves out its notes only
            owner = getattr(summarize, "__self__", summarize)
            self._tell(f"the stats of {owner!r} failed ({type(err).__name__}: {err})", repr(owner))
            return ()

    def _write(self, conn: Optional[dist.Store], text: Optional[str]) -> Optional[dist.Store]:
        """Set the key to ``text`` (None: delete it, if it still holds this member's last
        write); the connection to use next time (None after a failure: a fresh one then)."""
        try:
            if conn is None:
                conn = self._connect()
                if conn is None:
                    return None
            if text is None:
                if self._mine is not None and value_or_empty(conn, self._key) == self._mine:
                    conn.delete_key(self._key)  # (between the two, only a stale successor could write)
                self._mine = None
            else:
                self._set(conn, text)
            return conn
        except Exception as err:  # the store is gone or silent: never the servers' problem
            self._tell(f"the store did not take them ({type(err).__name__}: {str(err).strip()[:200]})")
            return None

    def _set(self, conn: dist.Store, text: str) -> None:
        """Compare-and-set the key to ``text``: over this member's last write, an absent key
        (the first write) or an earlier incarnation's; anything else supersedes this member."""
        expected = self._mine or ""
        for _ in range(3):
            now = conn.compare_set(self._key, expected, text).decode()
            if now == text:
                self._mine = text
                return
            # torch's store answers a compare with a missing key by echoing the expected text
            reaped = now == expected
            held = None if reaped else ServerNotes.decode(now)
            if reaped or (held is not None and held.incarnation > self._incarnation()):
                self.superseded, self._mine = True, None
                log.info("machinlike: member %r stops publishing its servers' numbers: %s", self._name,
                         "the others reaped its key (it was declared lost)" if held is None else
                         f"incarnation {held.incarnation} of its name publishes them now")
                return
            expected = now  # an earlier incarnation's leftover (or unreadable text): replace exactly that
        raise RuntimeError(f"the key {self._key!r} kept changing under compare-and-set")

    def _connect(self) -> Optional[dist.Store]:
        address = store_address(self._store)
        if address is not None:
            try:  # a plain connection first (see the module doc)
                socket.create_connection(address, timeout=STORE_TIMEOUT_S).close()
            except OSError as err:
                self._tell(f"the store at {address[0]}:{address[1]} does not answer ({err})")
                return None
        own = own_client(self._store, datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return own if own is not None else self._store

    def _tell(self, what: str, about: str = "store") -> None:
        if about in self._told or len(self._told) > 64:  # (a store's failure, each server's: said once)
            log.debug("machinlike: member %r: servers' numbers not published: %s", self._name, what)
            return
        self._told.add(about)
        log.warning("machinlike: member %r could not publish its servers' numbers for `python -m machinlike "
                    "status`: %s (said once; it tries again every %g s)", self._name, what, self.interval)
