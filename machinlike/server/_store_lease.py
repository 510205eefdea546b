"""StoreLease: a version lease kept in the world's store, for hosts without a checkpoint.

    host starts    floor = the lease its predecessors left (-1: none, a first host)
    store(key, v)  v > lease?  ── store lease = v + LEASE_BLOCK   (one write per block)
                   a new key, v <= floor?  ── stored as floor + 1 instead (``renumber``)

Why: a model server's or gradient server's host restarted in an elastic world without a
checkpoint starts an empty chain, and its versions began at the same small numbers as its
predecessor's. A client holding version 3 of the old chain then pulled "nothing new" from
the new chain's version 3 and kept stale weights, and its push on top of it was accepted
over another client's work (cold trial 28). The store outlives a host (``launch`` or the
store's own host keeps it), so the lease there bounds every version a predecessor made
visible, as the checkpoint's lease file does on disk (``_host``). A pusher whose first
version was renumbered is told the number (``OrderedServerSimple._push_as``), so a version
never names two contents.
"""

from __future__ import annotations

from typing import Any

from ..distributed import get_world
from ._host import LEASE_BLOCK

__all__ = ["StoreLease"]


class StoreLease:
    """The lease of the chain of the server whose host key is ``key`` (see the module doc).

    Args:
        key: A store key of the world's, kept for the server's name (not removed when the
            host closes: a host made again later must start above it too).

    Raises:
        RuntimeError: no World in this process.
    """

    def __init__(self, key: str) -> None:
        world = get_world()
        if world is None:
            raise RuntimeError("a server's store lease needs a World in this process")
        self._registry = world.membership.registry
        self._key = key
        held = self._registry.get_or_empty(key)
        self.floor = int(held) if held else -1  # every version up to it may have been visible
        self._lease = self.floor

    def renumber(self, version: Any, new_key: bool) -> Any:
        """The version to store ``version`` of a push as (itself, but for a new key's int
        version at or below the floor); leased before it becomes visible. Call under the
        host's lock."""
        if isinstance(version, bool) or not isinstance(version, int):
            return version  # (only int chains are leased: the model and gradient servers')
        if new_key and version <= self.floor:
            version = self.floor + 1
        if version > self._lease:
            lease = version + LEASE_BLOCK
            self._registry.set(self._key, str(lease))
            self._lease = lease
        return version
