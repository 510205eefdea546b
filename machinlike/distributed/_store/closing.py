"""A store whose host is closing it, told apart from the next world's store on the same port.

::

    rank 0 (hosts the store)                 rank r (a client), back from its own stop()
    stop(): mark_closing ──► CLOSING key      new World on the same address:
            the others leave                    connect ─► closing or gone? ─► drop it, wait, connect
            the store closes                               again (until the store that answers
    new World: a fresh store, no CLOSING                   is a fresh one, within dist_timeout)

Why: a static stop releases the other ranks before the host closes its store (the host
waits for them to leave first: they still talk to it inside their own stop). A rank that
then made a new World on the same address joined the old store, registered there, and lost
it a moment later, when the host's stop ended; the host's new World waited its whole
dist_timeout for that rank (cold trial 31: a second World after stop() in a 2-rank job).

A store that stops answering right after the connect (its host closed it between the
connect and the look) is no open store either: it is let go and tried again the same way
(CI of stop 90: the look's read was reset by the closing host, was taken for "not closing",
and the new World's first write then broke on the dead connection).
"""

from __future__ import annotations

import time
from typing import Callable, Optional

import torch.distributed as dist

from ...exception import SilentStoreError

__all__ = ["CLOSING", "mark_closing", "connect_open"]

#: Set in a store by the process that hosts it, once its world stops (outside any world's
#: namespace: a store serves one world at a time, and a closing one serves no new world).
CLOSING = "machinlike/store-closing"


def mark_closing(store: dist.Store) -> None:
    """Say in ``store`` that its host is closing it (best effort: a store that cannot be
    reached serves no new world anyway)."""
    try:
        store.set(CLOSING, "1")
    except (RuntimeError, ConnectionError, TimeoutError):
        pass


#: What a look at a freshly connected store finds (see _look).
OPEN, CLOSING_NOW, GONE = "open", "closing", "gone"


def _look(store: dist.Store) -> str:
    """OPEN, CLOSING_NOW (its host marked it), or GONE (the read failed: the store closed
    or stopped answering under the connection)."""
    try:
        return CLOSING_NOW if store.check([CLOSING]) else OPEN
    except (RuntimeError, ConnectionError, TimeoutError):
        return GONE


def connect_open(connect: Callable[[str, int, float], dist.Store], host: str, port: int, timeout: float) -> dist.Store:
    """A client of the store at ``host:port`` that is not closing: one whose host is
    stopping its world, or that closes under the new connection, is let go, and
    ``connect(host, port, seconds)`` tried again, all within ``timeout`` seconds.

    Raises:
        TimeoutError: nothing answered, or only a closing store, within ``timeout``; the
            first connect's own error (``connect`` waits for a store that is not up yet)
            as it was raised.
    """
    deadline = time.monotonic() + timeout
    wait = timeout  # (the first try's error quotes the caller's timeout as it was given)
    seen = ""  # what the last look found, once a store was let go
    failed: Optional[TimeoutError] = None  # the last connect's error, after a store was let go
    while True:
        try:
            store = connect(host, port, wait)
        except SilentStoreError:
            raise  # (what answers there is no store: waiting does not change that)
        except TimeoutError as exc:
            # A connect that fails after a store was let go may have met that store's last
            # moment (its handshake reset): the next store comes up within the deadline.
            # Out of time, it is the closing store that the caller is told of (the last
            # connect had only what was left of the deadline: CI saw one given 0.01 s).
            if not seen:
                raise
            failed = exc
        else:
            failed = None
            seen = _look(store)
            if seen == OPEN:
                return store
            del store  # (its connection closes with it)
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the store at {host}:{port} belongs to a world whose rank 0 is stopping "
                               f"(the last look found it {seen}), and no new one answered there within "
                               f"{timeout:g} s: start rank 0 of the new world, or give it time to stop its last "
                               f"one (dist_timeout)") from failed
        time.sleep(min(0.05, left))  # (the old store closes within the host's stop)
        wait = max(0.01, deadline - time.monotonic())
