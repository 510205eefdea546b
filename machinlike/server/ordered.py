"""Ordered key-value server: a versioned store with compare-and-set pushes.

Data flow::

    accessor (any process)                          host (OrderedServerSimpleImpl)
    ----------------------                          ------------------------------
    push(key, value, v, prev)  ── registered_sync ─► under one lock: accept iff the key is
                                                    new or its newest version == prev; keep
                                                    the newest + version_depth older ones
    pull(key, v=None)          ── registered_sync ─► (value, version) or None
    pull_if_changed(key, have) ── registered_sync ─► None when ``have`` is the newest version,
                                                    so an up-to-date client receives nothing

Every call is one RPC round trip to the host (the group caches who hosts the services).
Values travel through torch RPC, tensors in its tensor table, and come back as copies:
nothing a client does to a pulled value reaches the server, even on the host itself.
"""

from __future__ import annotations

import abc
import threading
from collections import deque
from typing import Any, Callable, Deque, Dict, Hashable, Optional, Tuple

from ..distributed import RpcGroup
from ._common import check_count, check_group, check_name, check_timeout

__all__ = ["OrderedServerBase", "OrderedServerSimple", "OrderedServerSimpleImpl"]


def _check_key(key: Any) -> Hashable:
    try:
        hash(key)
    except TypeError:
        raise TypeError(f"key must be hashable (e.g. a str), not {type(key).__name__}") from None
    return key


class OrderedServerBase(abc.ABC):
    """Interface of an ordered key-value server.

    Versions are compared with ``==`` only, so any picklable value with ordinary equality
    can be a version; machin's convention (and the model and gradient servers') is ints.
    """

    @abc.abstractmethod
    def push(self, key: Hashable, value: Any, version: Any, prev_version: Any) -> bool:
        """Store ``value`` as ``version`` of ``key`` on top of ``prev_version``.

        A new key accepts any version. An existing key accepts the push only when its
        newest version equals ``prev_version``; among concurrent pushers with the same
        ``prev_version`` exactly one wins. ``version == prev_version`` is allowed (the
        newest entry is then succeeded by another with the same version).

        Args:
            key: Any hashable key (the servers use str).
            value: The value to store (picklable).
            version: The version this value becomes.
            prev_version: The version it must succeed; ignored for a new key.

        Returns:
            True if stored, False if rejected.
        """

    @abc.abstractmethod
    def pull(self, key: Hashable, version: Any = None) -> Optional[Tuple[Any, Any]]:
        """The ``(value, version)`` of ``key``.

        Args:
            key: The key.
            version: The version wanted; None: the newest.

        Returns:
            A copy of the value with its version, or None when the key is unknown or that
            version is not (or no longer) retained.
        """

    def pull_if_changed(self, key: Hashable, have_version: Any) -> Optional[Tuple[Any, Any]]:
        """The newest ``(value, version)`` of ``key`` unless ``have_version`` is the newest.

        Args:
            key: The key.
            have_version: The version the caller holds (None: none).

        Returns:
            None when the key is unknown or its newest version equals ``have_version``.
            This default pulls and compares; :class:`OrderedServerSimple` decides on the
            host, so an up-to-date caller receives no value at all.
        """
        got = self.pull(key)
        if got is None or got[1] == have_version:
            return None
        return got


class OrderedServerSimple(OrderedServerBase):
    """Accessor of an :class:`OrderedServerSimpleImpl`; picklable, usable from any process.

    Get it with ``group.get_paired(server_name).to_here()`` or build it directly.

    Args:
        server_name: Name the host was created with.
        group: The host's RpcGroup.
        timeout: Seconds per call; None: the world's ``rpc_timeout``.

    Every method raises what :meth:`RpcGroup.registered_sync` raises: ``KeyError`` when no
    host serves ``server_name``, ``TimeoutError``, or
    :class:`~machinlike.exception.PeerLostError` naming the host when it is gone.
    """

    def __init__(self, server_name: str, group: RpcGroup, timeout: Optional[float] = None) -> None:
        self.server_name = check_name(server_name, "server_name")
        self.group = check_group(group)
        self.timeout = check_timeout(timeout)

    def __repr__(self) -> str:
        return f"<OrderedServerSimple {self.server_name!r} of group {self.group.get_group_name()!r}>"

    def push(self, key: Hashable, value: Any, version: Any, prev_version: Any) -> bool:
        return self.group.registered_sync(f"{self.server_name}/_push",
                                          (_check_key(key), value, version, prev_version), timeout=self.timeout)

    def pull(self, key: Hashable, version: Any = None) -> Optional[Tuple[Any, Any]]:
        return self.group.registered_sync(f"{self.server_name}/_pull", (_check_key(key), version),
                                          timeout=self.timeout)

    def pull_if_changed(self, key: Hashable, have_version: Any) -> Optional[Tuple[Any, Any]]:
        return self.group.registered_sync(f"{self.server_name}/_pull_if_changed", (_check_key(key), have_version),
                                          timeout=self.timeout)


class OrderedServerSimpleImpl:
    """Host of an ordered key-value server, in the process that constructs it.

    It registers its services in ``group`` and pairs an :class:`OrderedServerSimple`
    accessor under ``server_name``. The process must be a member of ``group``.

    Args:
        server_name: Name of the server, unique in ``group``.
        group: The RpcGroup clients reach the server through.
        version_depth: How many versions older than the newest are retained per key
            (0: only the newest). ``pull(key, v)`` of an evicted version returns None.
        adopt: Called as ``adopt(key, value)`` on each value pushed through RPC; what it
            returns is stored. None: the value is stored as it arrived.

    Raises:
        KeyError: ``server_name`` is already used in ``group``.
        TypeError, ValueError: invalid arguments.
    """

    def __init__(self, server_name: str, group: RpcGroup, version_depth: int = 1,
                 adopt: Optional[Callable[[Hashable, Any], Any]] = None) -> None:
        self.server_name = check_name(server_name, "server_name")
        if adopt is not None and not callable(adopt):
            raise TypeError(f"adopt must be callable or None, not {type(adopt).__name__}")
        self._adopt = adopt
        self.group = check_group(group)
        self.version_depth = check_count(version_depth, "version_depth", 0)
        self._lock = threading.Lock()
        # key -> (version, value), oldest first; maxlen does the eviction.
        self._data: Dict[Hashable, Deque[Tuple[Any, Any]]] = {}
        self._counts = {"pushes_accepted": 0, "pushes_rejected": 0, "pulls": 0, "pulls_unchanged": 0}
        self._keys = [f"{server_name}/_push", f"{server_name}/_pull", f"{server_name}/_pull_if_changed"]
        self._closed = False
        services = [self._push_service, self._pull_service, self._pull_if_changed_service]
        done = []
        try:
            for key, service in zip(self._keys, services, strict=True):
                group.register(key, service)
                done.append(key)
            group.pair(server_name, OrderedServerSimple(server_name, group))
        except BaseException:
            for key in done:
                group.deregister(key)
            raise

    def __repr__(self) -> str:
        return f"<OrderedServerSimpleImpl {self.server_name!r} version_depth={self.version_depth}>"

    # ------------------------------------------------------------------ the store
    def store(self, key: Hashable, value: Any, version: Any, prev_version: Any) -> bool:
        """Compare-and-set in this process; ``value`` is kept as is (the caller hands it over).

        Used by servers hosted in the same process (the gradient server's primary) to
        publish a fresh snapshot without an RPC to itself.

        Args:
            key, value, version, prev_version: As for :meth:`OrderedServerBase.push`.

        Returns:
            True if stored, False if rejected.
        """
        with self._lock:
            entries = self._data.get(key)
            if entries is None:
                entries = self._data[key] = deque(maxlen=self.version_depth + 1)
            elif entries[-1][0] != prev_version:
                self._counts["pushes_rejected"] += 1
                return False
            entries.append((version, value))
            self._counts["pushes_accepted"] += 1
            return True

    def stats(self) -> Dict[str, int]:
        """Counters since creation: ``keys``, ``pushes_accepted``, ``pushes_rejected``,
        ``pulls`` and ``pulls_unchanged`` (pull_if_changed calls that sent no value)."""
        with self._lock:
            return dict(self._counts, keys=len(self._data))

    def close(self) -> None:
        """Withdraw the services and the paired accessor (the name can then be reused)."""
        if self._closed:
            return
        self._closed = True
        for key in self._keys:
            self.group.deregister(key)
        self.group.unpair(self.server_name)

    # ------------------------------------------------------------------- services
    # The value arrived through RPC, so it is already this process's own copy; what goes
    # back is serialised by RPC, so the caller gets a copy too.
    def _push_service(self, key: Hashable, value: Any, version: Any, prev_version: Any) -> bool:
        if self._adopt is not None:
            value = self._adopt(key, value)  # outside the lock: it may copy a whole model
        return self.store(key, value, version, prev_version)

    def _pull_service(self, key: Hashable, version: Any) -> Optional[Tuple[Any, Any]]:
        with self._lock:
            self._counts["pulls"] += 1
            entries = self._data.get(key)
            if not entries:
                return None
            if version is None:
                found_version, value = entries[-1]
                return value, found_version
            for found_version, value in reversed(entries):
                if found_version == version:
                    return value, found_version
            return None

    def _pull_if_changed_service(self, key: Hashable, have_version: Any) -> Optional[Tuple[Any, Any]]:
        with self._lock:
            self._counts["pulls"] += 1
            entries = self._data.get(key)
            if not entries:
                return None
            version, value = entries[-1]
            if version == have_version:
                self._counts["pulls_unchanged"] += 1
                return None
            return value, version
