"""Membership's waits: each ends as soon as a member it needs is gone, not at its timeout.

    wait_all(prefix, names, members)        noted in _waits; a store wait on <prefix><name> for each
      a member it needs leaves or is lost   _apply (in _membership) writes LOST_MARK into that
                                            member's key and WOKEN_MARK into the other absent ones:
                                            the store wait ends, LOST_MARK names who is gone
    wait_call(fut, worker)                  an Event set by the future, or by _apply when the
                                            worker goes (the future is then still pending)
    wait_until(predicate)                   the Condition _changed, notified by every applied event

Why keys are written to end a wait: a store wait blocks in torch's C++ client until every
key exists (or its timeout), and writing them is the only way to end it early.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Iterable, List, Optional, Sequence

import torch

from ..exception import PeerLostError
from ._keys import LOST_MARK, WOKEN_MARK

__all__ = ["MembershipWaits"]


class MembershipWaits:
    """The waits of :class:`~machinlike.distributed.Membership` (a mixin it inherits).

    Holds no state of its own: what these methods use (``_lock``, ``_changed``, ``_live``,
    ``_waits``, ``_wait_ids``, ``_pending``, ``_gone_transports``, ``registry``) is
    initialised in ``Membership.__init__``, which owns it.
    """

    # ------------------------------------------------------------------ waits
    def wait_all(self, prefix: str, names: Sequence[str], members: Sequence[str], timeout: float, what: str,
                 stated: Optional[float] = None, incarnations: Optional[Dict[str, int]] = None) -> None:
        """``Registry.wait_all`` that fails fast when a member it waits for is gone.

        ``names[i]`` is the key suffix member ``members[i]`` writes.

        Args:
            incarnations: The incarnation each member must have (a member that came back
                as a later one counts as gone); None: any.

        Raises:
            PeerLostError: a member it waits for left or was lost (named).
            TimeoutError: as ``Registry.wait_all``.
        """
        mapping = dict(zip(members, names))
        with self._lock:
            self._wait_ids += 1
            wid = self._wait_ids
            self._waits[wid] = (prefix, mapping, incarnations)
            already = [m for m in members if m not in self._live
                       or (incarnations is not None and self._live[m].incarnation != incarnations.get(m))]
        try:
            if already:
                self._wake(prefix, [mapping[m] for m in already], list(names))
            self.registry.wait_all(prefix, names, timeout, what, stated)
            marked = [m for m, v in zip(members, self.registry.values(prefix, names)) if v == LOST_MARK]
        finally:
            with self._lock:
                self._waits.pop(wid, None)
        if marked:
            gone = ", ".join(repr(m) for m in marked)
            raise PeerLostError(marked[0], f"{what}: {gone} left or died while being waited for")

    def incarnations(self, members: Iterable[str]) -> Dict[str, int]:
        """The current incarnation of each live member among ``members``."""
        with self._lock:
            return {m: self._live[m].incarnation for m in members if m in self._live}

    def _wake(self, prefix: str, lost: Sequence[str], names: Sequence[str]) -> None:
        """Mark ``lost`` keys of a wait as gone and fill its other absent keys, so it ends."""
        try:
            for name in lost:
                self.registry.compare_set(prefix + name, "", LOST_MARK)
            for name in names:
                self.registry.compare_set(prefix + name, "", WOKEN_MARK)
        except PeerLostError:
            pass

    def wait_until(self, predicate: Callable[[List[str]], bool], timeout: float) -> List[str]:
        """Block until ``predicate(live members)`` holds; return the members then.

        Raises:
            TimeoutError: it did not hold within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                members = sorted(self._live)
                if predicate(members):
                    return members
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"membership condition not met within {timeout:g} s (members: {members})")
                self._changed.wait(left)

    def wait_call(self, fut: "torch.futures.Future", worker: str, what: str) -> object:
        """The result of ``fut``, a call to ``worker``; PeerLostError as soon as it is lost.

        Raises:
            PeerLostError: the worker left or was lost while the call was pending.
            RuntimeError: what ``fut`` raised (torch's text errors, timeouts included).
        """
        done = threading.Event()
        with self._lock:
            if worker in self._gone_transports:
                raise PeerLostError(self.member_of(worker), f"{what}: it left or was lost")
            self._pending.setdefault(worker, set()).add(done)
        try:
            fut.add_done_callback(lambda _: done.set())
            done.wait()  # bounded: torch completes the future at the call's own timeout
            if not fut.done():
                raise PeerLostError(self.member_of(worker), f"{what}: it was lost while the call was pending")
            return fut.wait()
        finally:
            with self._lock:
                self._pending.get(worker, set()).discard(done)
