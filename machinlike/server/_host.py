"""What a versioned host keeps through churn: a checkpoint with a version lease, and a
count of the members it saw come and go.

Why: the ordered server (and the model server built on it, and the gradient server's
primary, see ``_grad.checkpoint``) makes versions that its clients then hold. A host
restarted from a checkpoint older than its death must never show one of those numbers
with other contents, yet writing every version to disk before acknowledging it would
cost a synchronous write per push. So the host *leases* versions:
before a version above the lease becomes visible, the lease is raised by
:data:`LEASE_BLOCK` and written (atomically, like the checkpoint) beside the checkpoint.
A resumed host republishes every key's newest value above the lease, which is above every
version its predecessor ever made visible; one small write per ``LEASE_BLOCK`` versions::

    push(key, v)  under the host's lock:   v > lease?  ── write lease = v + LEASE_BLOCK
                                           new key?    ── checkpoint with it
                                           append      ── visible, acknowledged
                  after, outside the lock: N versions or T seconds since the last?
                                                       ── checkpoint (a snapshot)

    resume:  <dir>/<name>.ckpt   every key's retained (version, value) history
             <dir>/<name>.lease  L >= every version ever visible
             ──► each key's newest value again, as version L + 1; lease raised past it

A key created after the last checkpoint would vanish in a resume and could later be
created again under a number a client holds for other contents: creating a key therefore
writes a checkpoint before the push is acknowledged.
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Hashable, Optional, Tuple

from ..distributed import MemberEvent, get_world
from ._checkpoint import CheckpointError, Checkpointer
from ._common import check_count, check_timeout

__all__ = ["LEASE_BLOCK", "HostCheckpoint", "MemberLog", "check_version", "host_checkpoint"]

log = logging.getLogger(__name__)

LEASE_BLOCK = 1024  # versions per lease write; a resume jumps by at most this much more


def check_version(version: Any, server: str) -> int:
    """A checkpointed host's versions must be ints (so it can choose fresh ones on resume)."""
    if isinstance(version, bool) or not isinstance(version, int):
        raise TypeError(f"ordered server {server!r} keeps a checkpoint, so versions must be ints, not "
                        f"{type(version).__name__} ({version!r}): push int versions or host it without "
                        f"checkpoint_dir")
    return version


def _newest_in_data(state: Dict[str, Any]) -> int:
    return max((v for entries in state["data"].values() for v, _ in entries), default=-1)


def host_checkpoint(directory: Any, kind: str, name: str, every: Any, interval: Any) -> Optional["HostCheckpoint"]:
    """A public entrance's checkpoint arguments checked, as the host's checkpoint.

    ``every`` and ``interval`` are checked even without a directory, so a mistake is
    named before it matters.

    Returns:
        None when ``directory`` is None (no checkpoints).

    Raises:
        TypeError, ValueError: invalid arguments (named).
    """
    every = check_count(every, "checkpoint_every", 1)
    interval = check_timeout(interval, "checkpoint_interval")
    return None if directory is None else HostCheckpoint(directory, kind, name, every, interval)


class HostCheckpoint:
    """A host's checkpoint file, its version lease and when the next one is due.

    Args:
        directory: ``checkpoint_dir``.
        kind: What is checkpointed (``"ordered-server"``, ``"model-server"``).
        name: The server's name.
        every: ``checkpoint_every``, checked: a checkpoint every this many versions (>= 1).
        interval: ``checkpoint_interval``, checked: also one when this many seconds passed
            since the last, checked when a version is made; None: by versions only.

    Raises:
        TypeError, ValueError: ``directory`` is not a usable path (named).
    """

    def __init__(self, directory: Any, kind: str, name: str, every: int, interval: Optional[float]) -> None:
        self.file = Checkpointer(directory, kind, name)
        self._lease_file = Checkpointer(directory, kind, name, suffix=".lease")
        self.every = every
        self.interval = interval
        self.lease = -1  # no version above it was ever visible
        self.written = 0
        self._io = threading.Lock()  # one writer at a time; an older snapshot never overwrites a newer
        self._saved = 0  # sequence number (versions made) of the newest snapshot written
        self._when = time.monotonic()
        # The newest snapshot taken for writing (due() said so) and when: a write outlasts the
        # pushes that come meanwhile, and each would have found a checkpoint due and written
        # the whole history again (cold trial 29: 3x as many as checkpoint_every asks).
        self._claimed, self._claimed_when = 0, -math.inf

    @property
    def path(self) -> str:
        return self.file.path

    def load(self, newest: Optional[Callable[[Dict[str, Any]], int]] = None) -> Optional[Tuple[Dict[str, Any], int]]:
        """The saved state and lease; None when there is no checkpoint.

        Args:
            newest: The highest version a saved state holds; None: the newest of every
                key's history (``state["data"]``, the ordered server's layout).

        Raises:
            CheckpointError: a file is corrupt or another server's, the lease is missing,
                or the checkpoint holds a version above the lease.
            OSError: the directory cannot be made or written in (named).
        """
        self.file.probe()  # (the host builds itself on this: its first save must not fail)
        state = self.file.load()
        if state is None:
            self._starting_afresh()
            return None
        lease = self._lease_file.load()
        if lease is None:
            raise CheckpointError(f"checkpoint {self.file.path!r} has no lease file {self._lease_file.path!r}, so the "
                                  f"versions handed out after it cannot be bounded: restore the lease file, or "
                                  f"delete the checkpoint to start afresh")
        top = _newest_in_data(state) if newest is None else newest(state)
        if top > lease["lease"]:
            raise CheckpointError(f"checkpoint {self.file.path!r} holds version {top}, above the lease "
                                  f"{lease['lease']} in {self._lease_file.path!r}: the files do not belong together")
        self.lease = lease["lease"]
        return state, self.lease

    def _starting_afresh(self) -> None:
        # A directory holding other servers' checkpoints but not this one's is most often a
        # renamed server or a mistyped path: a run that looks resumed and is not.
        directory = self.file.directory
        try:
            others = sorted(f for f in os.listdir(directory) if f.endswith(".ckpt"))
        except OSError:  # (not made yet: a first run)
            others = []
        if others:
            log.warning("%s %r: no checkpoint %r in %r, which holds %s; starting afresh (pass the same "
                        "server name as the run that wrote them to resume it)", self.file.kind, self.file.name,
                        os.path.basename(self.file.path), directory, ", ".join(others[:5]))
        else:
            log.info("%s %r: no checkpoint in %r yet; starting afresh", self.file.kind, self.file.name, directory)

    def restore(self, state: Dict[str, Any], lease: int, depth: int,
                adopt: Optional[Callable[[Hashable, Any], Any]]) -> Tuple[Dict[Hashable, Deque], int]:
        """Every key's history from ``state``, its newest value again above ``lease``.

        Returns:
            The keys' ``(version, value)`` deques (``maxlen=depth + 1``) and the version
            the newest values were republished under (leased here before it is visible).
        """
        # Every version up to the lease may have been visible before the crash, some of
        # them (after the checkpoint) with contents lost now: a number above it names
        # nothing yet, so no number ever names two contents.
        fresh = lease + 1
        self.cover(fresh)
        data: Dict[Hashable, Deque] = {}
        for key, entries in state["data"].items():
            kept: Deque = deque(maxlen=depth + 1)
            for version, value in entries:
                kept.append((version, value if adopt is None else adopt(key, value)))
            kept.append((fresh, kept[-1][1]))
            data[key] = kept
        return data, fresh

    def cover(self, version: int) -> None:
        """Make ``version`` leased before it becomes visible (the caller serialises calls)."""
        if version > self.lease:
            lease = version + LEASE_BLOCK
            self._lease_file.save({"lease": lease})
            self.lease = lease

    def due(self, seq: int) -> bool:
        """Whether a checkpoint is due after ``seq`` versions made; True claims it: the
        caller writes it (:meth:`save`), and later calls count from ``seq`` (the caller
        serialises calls)."""
        now = time.monotonic()
        if seq - max(self._saved, self._claimed) < self.every and (
                self.interval is None or now - max(self._when, self._claimed_when) < self.interval):
            return False
        self._claimed, self._claimed_when = seq, now
        return True

    def save(self, seq: int, state: Dict[str, Any]) -> None:
        """Write the snapshot of ``seq`` versions made, unless a newer one was written."""
        with self._io:
            if seq < self._saved or (seq == self._saved and self.written):
                return
            try:
                self.file.save(state)
            except BaseException:
                # (unclaimed: the next version made tries again, not the one every versions on)
                self._claimed, self._claimed_when = self._saved, -math.inf
                raise
            self._saved, self._when = seq, time.monotonic()
            self.written += 1


class MemberLog:
    """Counts the losses and rejoins of other members a host sees (elastic worlds only).

    Args:
        what: How the host is named in log lines (e.g. ``"ordered server 'kv'"``).
    """

    def __init__(self, what: str) -> None:
        self._what = what
        self.counts = {"losses": 0, "rejoins": 0}
        world = get_world()
        self.active = world is not None and world.elastic
        self._me = world.name if world is not None else ""
        if world is not None and self.active:
            world.on_member_change(self._on_member)

    def _on_member(self, event: MemberEvent) -> None:
        # On the liveness thread: count and log only.
        if event.member == self._me:
            return
        if event.kind == "lost":
            self.counts["losses"] += 1
            log.info("%s on %r: member %r (incarnation %d) was lost", self._what, self._me, event.member,
                     event.incarnation)
        elif event.kind == "join" and event.incarnation > 1:
            self.counts["rejoins"] += 1
            log.info("%s on %r: member %r rejoined (incarnation %d)", self._what, self._me, event.member,
                     event.incarnation)

    def stats(self) -> Optional[Dict[str, int]]:
        """``{"losses": n, "rejoins": m}``; None outside an elastic world."""
        return dict(self.counts) if self.active else None

    def close(self) -> None:
        world = get_world()
        if self.active and world is not None:
            world.remove_member_callback(self._on_member)
        self.active = False
