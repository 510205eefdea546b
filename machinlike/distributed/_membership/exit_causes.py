"""Exit causes: how a member's incarnation ended, written where ``python -m machinlike status`` reads it.

Three writers know three things, and each writes what it knows into one key per member
name, ``m/exit/<name>`` (an :class:`ExitRecord` naming the incarnation and its pid)::

    the member itself     raised an exception it could report     "raised ValueError: bad thing"
      (World.__exit__, the launchers' rank body: record_own_exit, best effort, OWN_EXIT_WAIT s)
    its launcher          saw its exit status                     "killed by signal SIGKILL (9)"
      (launch()'s parent of every rank: _launch.exits)
    its declarer          how the loss was detected               "process gone", "heartbeat
      (Monitor.declare: the one member elected to clean up)        silent for 7.6 s"

    record_exit: compare-and-set; a record of the same incarnation gives way only to a
    better-placed writer (member > launcher > watcher), a newer incarnation's always wins

Why compare-and-set: the three race (a SIGKILLed rank's launcher and its same-host watcher
hear of it in the same millisecond), and the most precise account must stay, whichever
came first. What it costs: one store round trip per departure that has a cause (none
while members live); the key is deleted with the name's other records (``Departures``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Callable, Optional

from .._store import ExitRecord, Keys, MemberRecord, Registry
from .processes import pid_in

__all__ = ["OWN_EXIT_WAIT", "describe_exception", "detected", "record_exit", "record_own_exit"]

log = logging.getLogger(__name__)

#: Seconds a member waits, at most, for the store to take its own exit cause.
OWN_EXIT_WAIT = 2.0
_TRIES = 4  # compare-and-set rounds against concurrent writers before giving up


def describe_exception(exc: BaseException) -> str:
    """``"raised <type>: <message>"`` (``"raised <type>"`` without a message)."""
    text = str(exc)
    return f"raised {type(exc).__name__}{': ' + text if text else ''}"


def record_exit(compare_set: Callable[[str, str, str], str], keys: Keys, member: str,
                record: ExitRecord) -> Optional[ExitRecord]:
    """Write ``record`` for ``member`` unless the store holds a record that outranks it.

    Args:
        compare_set: ``compare_set(key, expected, desired)`` of a store, returning the
            value after (``""`` expected also matches an absent key).
        keys: The world's keys.
        member: The member's name.
        record: What to write.

    Returns:
        The record the key holds afterwards (``record``, or the one that outranks it);
        None when concurrent writers kept it changing.

    Raises:
        Exception: what ``compare_set`` raises (the store is gone).
    """
    key = keys.exit_cause(member)
    text = record.encode()
    expected = ""
    for _ in range(_TRIES):
        now = compare_set(key, expected, text)
        if now == text:
            return ExitRecord.decode(text)
        held = ExitRecord.decode(now)
        if held is not None and not record.outranks(held):
            return held
        expected = now  # (a worse record, or text of another form: replace exactly that)
    return None


def detected(registry: Registry, keys: Keys, rec: MemberRecord, why: str) -> str:
    """The declarer of ``rec``'s loss records how it knew (``why``), unless a better account
    is there; what to add to its "is lost" line: ``": <the cause now recorded>"``, or "".

    One round trip, no wait: a cause the launcher or the member records later is not
    awaited (the line then says what the declarer knew).

    Raises:
        PeerLostError: the store is lost.
    """
    held = record_exit(registry.compare_set, keys, rec.member,
                       ExitRecord(rec.incarnation, pid_in(rec.identity), "watcher", why or "lost"))
    return f": {held.cause}" if held is not None and held.incarnation == rec.incarnation else ""


def record_own_exit(registry: Registry, keys: Keys, me: MemberRecord, exc: BaseException,
                    timeout: float = OWN_EXIT_WAIT) -> bool:
    """This member (``me``, its claim) ends with ``exc``: record it for its incarnation (best effort).

    The write runs on a thread of its own, waited for at most ``timeout`` seconds: a
    store that stopped answering must not hold up a process on its way out (the thread,
    a daemon, is left behind then).

    Returns:
        Whether the store took it (or already held a better account) in time.
    """
    record = ExitRecord(me.incarnation, os.getpid(), "member", describe_exception(exc))
    done = threading.Event()

    def write() -> None:
        try:
            # (a connection of its own: left behind in a silent store's request, this thread
            # must not hold up the World's stop on the main one)
            store = registry.short_connection(timeout)
            if record_exit(lambda k, old, new: store.compare_set(k, old, new).decode(), keys, me.member,
                           record) is not None:
                done.set()
        except Exception as err:  # the store is gone or closed: nothing to tell it
            log.debug("machinlike: member %r could not record its exit cause: %s", me.member, err)

    thread = threading.Thread(target=write, name=f"machinlike-exit-{me.member}", daemon=True)
    thread.start()
    thread.join(timeout)
    return done.is_set()
