"""Releases of result handles: put on a queue by the collector, sent in batches by one thread.

Why: a collected handle used to tell its keeper with a torch RPC call made inside the
garbage collector (a weakref finalizer) of whichever thread dropped it: some 70 us of
that thread's time and about 190 us a handle of the two processes' CPU on the 2-core box
(``BENCHMARKS.md``, RPC, session 48), and a call made from a collector runs under
whatever lock that thread held. Now the finalizer only queues the release
(``SimpleQueue.put`` is reentrant: safe in a finalizer); one thread a process takes what
queued, groups it by keeper and sends each keeper one call, the way every call goes (the
lane to a member on this host)::

    handle made ─► started() (the releaser: one thread, started outside any collection)
    handle collected ─► put(keeper, rid, token, creation) ─► the releaser
                                                              get: everything queued, at once
                                                              creation not answered yet: queued
                                                                again once it is (its callback)
                                                              creation failed: nothing is kept
                                                              per keeper (member, incarnation)
                                                                still in the world:
                                                                send_async(_release_all, pairs)

Best effort, as before: a release that cannot be sent (the keeper left, the World stops)
is counted, and the keeper frees a result once every member holding it is gone.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
from typing import Dict, List, Optional, Tuple

from . import context as _context, ref_owner as _ref_owner
from .future import RpcFuture
from .results import Holder
from .send import send_async

__all__ = ["release_later", "started", "stats"]

_Release = Tuple[Holder, str, str, Optional[RpcFuture]]

_queue: "queue.SimpleQueue[_Release]" = queue.SimpleQueue()
_started = False
_start_lock = threading.Lock()
# sent: releases sent; calls: the calls that carried them; not_sent: releases dropped
# (keeper gone, no World, a send that failed); creation_failed: nothing was kept.
_counts = {"sent": 0, "calls": 0, "not_sent": 0, "creation_failed": 0}


def release_later(keeper: Holder, rid: str, token: str, created: Optional[RpcFuture]) -> None:
    """(A handle's finalizer) tell the keeper (member, incarnation) that hold ``token`` on
    result ``rid`` is gone; ``created``: the creation, whose answer names the keeper (None:
    ``keeper`` is it). Queues only: safe in a garbage collection."""
    if not sys.is_finalizing():
        _queue.put((keeper, rid, token, created))  # (nothing else: no lock a collection could hold)


def stats() -> Dict[str, int]:
    """This process's release counters (see the module doc)."""
    return dict(_counts)


def started() -> None:
    """Start the releaser unless it runs (a handle's constructor calls this: never a
    finalizer, which could run inside this very start, under its locks)."""
    global _started
    if _started:
        return
    with _start_lock:
        if not _started:
            threading.Thread(target=_run, name="machinlike-releases", daemon=True).start()
            _started = True


def _run() -> None:
    while True:
        batch = [_queue.get()]
        while True:  # (everything queued meanwhile goes out with it)
            try:
                batch.append(_queue.get_nowait())
            except queue.Empty:
                break
        try:
            _send(batch)
        except Exception:  # (a bug must not end the thread: the keepers free at the holders' end)
            _counts["not_sent"] += len(batch)
        del batch


def _send(batch: List[_Release]) -> None:
    by_keeper: Dict[Holder, List[Tuple[str, str]]] = {}
    for keeper, rid, token, created in batch:
        if created is not None:
            if not created.done():  # queued again once answered (the callback runs on its completer)
                created.add_done_callback(lambda _, k=keeper, r=rid, t=token, c=created: _queue.put((k, r, t, c)))
                continue
            try:
                keeper = created.wait()  # the creation's answer names the keeper
            except Exception:  # it failed: nothing is kept
                _counts["creation_failed"] += 1
                continue
        by_keeper.setdefault(tuple(keeper), []).append((rid, token))  # type: ignore[arg-type]
    context = _context.current()
    for (owner, incarnation), pairs in by_keeper.items():
        try:
            if context is None:
                raise LookupError("no World")
            roster = context.roster
            if roster.incarnation_of(owner) != incarnation:
                raise LookupError("that incarnation is gone, and its results with it")
            send_async(roster, roster.worker_of(owner), _ref_owner._release_all, (pairs,), context.timeout)
        except Exception:  # the keeper is gone, or no agent (the World stops): nothing to free
            _counts["not_sent"] += len(pairs)
            continue
        _counts["sent"] += len(pairs)
        _counts["calls"] += 1


def _after_fork_in_child() -> None:
    global _queue, _started, _start_lock
    _queue = queue.SimpleQueue()  # (the parent's thread is not running here)
    _started = False
    _start_lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
