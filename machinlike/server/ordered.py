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
(The model and gradient servers' own pullers alone read the memory of their hosted chain
in place, on the same host: ``_pull_in_place``, see ``_state_pool``; a plain ``pull`` of
such a chain copies the tensors of memory the host rewrites.)

Churn. The host writes its member name in the world's store; a call that finds the
services gone while that member is lost (or back but not serving yet) raises
:class:`~machinlike.exception.PeerLostError` naming it, and the same accessor reaches
the host again once it serves. With ``checkpoint_dir`` a restarted host resumes every
key's history and continues above every version its predecessor made visible (a version
lease, see ``_host``); a model or gradient server's host without one, in an elastic world,
leases its versions in the world's store instead (``_store_lease``).
"""

from __future__ import annotations

import abc
import copy
import logging
import threading
import time
from collections import deque
from typing import Any, Callable, Deque, Dict, Hashable, List, Optional, Set, Tuple

from ..distributed import RpcGroup
from ..exception import PeerLostError, raised_remotely
from ._common import ServerNote, check_count, check_group, check_name, check_timeout, current_world, publish_notes
from ._host import HostCheckpoint, MemberLog, check_version, host_checkpoint
from ._ordered_host import check_runner, host_key, register_all, unserved
from ._ordered_values import check_key as _check_key
from ._ordered_values import check_version as _check_version
from ._ordered_values import private as _private
from ._store_lease import StoreLease
from ._version_words import HostWords, PullerWords

__all__ = ["OrderedServerBase", "OrderedServerSimple", "OrderedServerSimpleImpl"]

log = logging.getLogger(__name__)


def _nothing() -> None:
    pass


class OrderedServerBase(abc.ABC):
    """Interface of an ordered key-value server.

    Versions are compared with ``==`` only, so any picklable value with ordinary equality
    can be a version; machin's convention (and the model and gradient servers') is ints.
    """

    #: Seconds per call; None: the World's ``rpc_timeout`` (what the model and gradient
    #: servers' calls through this server take when not given a timeout of their own).
    timeout: Optional[float] = None

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
        return None if got is None or got[1] == have_version else got

    def _pull_in_place(self, key: Hashable, have_version: Any) -> Optional[Tuple[Any, Any]]:
        """:meth:`pull_if_changed` for a model or gradient server's own pullers, which copy
        what they receive at once and check it was not rewritten meanwhile (``_state_pool``):
        a host may send them its memory by reference. This default: ``pull_if_changed``."""
        return self.pull_if_changed(key, have_version)

    def _push_as(self, key: Hashable, value: Any, version: Any, prev_version: Any) -> Tuple[bool, Any]:
        """:meth:`push`, and the version the value was stored as (a host may store a new
        key's first version above its predecessors', see ``_store_lease``). This default:
        ``version``."""
        return self.push(key, value, version, prev_version), version

    def _bounded(self, seconds: float) -> "OrderedServerBase":
        """This server with its calls bounded by ``seconds`` each, where it can be (the
        model and gradient servers' steps of one call share a deadline); a server of the
        user's own bounds its calls itself: this one."""
        return self


class OrderedServerSimple(OrderedServerBase):
    """Accessor of an :class:`OrderedServerSimpleImpl`; picklable, usable from any process.

    Get it with ``group.get_paired(server_name).to_here()`` or build it directly.

    Args:
        server_name: Name the host was created with.
        group: The host's RpcGroup.
        timeout: Seconds per call; None: the world's ``rpc_timeout``.

    Every method raises what :meth:`RpcGroup.registered_sync` raises: ``KeyError`` when no
    host serves ``server_name`` (and none ever did), ``TimeoutError``, or
    :class:`~machinlike.exception.PeerLostError` naming the host when it is gone, or came
    back and does not serve yet (the same accessor works again once it does).
    """

    def __init__(self, server_name: str, group: RpcGroup, timeout: Optional[float] = None) -> None:
        self.server_name = check_name(server_name, "server_name")
        self.group = check_group(group)
        self.timeout = check_timeout(timeout)

    @classmethod
    def _checked(cls, server_name: str, group: RpcGroup, timeout: Optional[float] = None) -> "OrderedServerSimple":
        """Built from values a host checked already."""
        self = cls.__new__(cls)
        self.server_name, self.group, self.timeout = server_name, group, timeout
        return self

    def __repr__(self) -> str:
        return f"<OrderedServerSimple {self.server_name!r} of group {self.group.get_group_name()!r}>"

    def push(self, key: Hashable, value: Any, version: Any, prev_version: Any, *,
             timeout: Optional[float] = None) -> bool:
        """See :meth:`OrderedServerBase.push`; ``timeout``: seconds (None: the accessor's)."""
        return self._call("_push", (_check_key(key), value, _check_version(version), prev_version), timeout)

    def _push_as(self, key: Hashable, value: Any, version: Any, prev_version: Any) -> Tuple[bool, Any]:
        got: Tuple[bool, Any] = self._call("_push", (_check_key(key), value, _check_version(version), prev_version),
                                           None, in_place=(True,))
        return got

    def pull(self, key: Hashable, version: Any = None, *, timeout: Optional[float] = None) -> Optional[Tuple[Any, Any]]:
        """See :meth:`OrderedServerBase.pull`; ``timeout``: seconds (None: the accessor's)."""
        return self._call("_pull", (_check_key(key), version), timeout)

    def pull_if_changed(self, key: Hashable, have_version: Any, *,
                        timeout: Optional[float] = None) -> Optional[Tuple[Any, Any]]:
        """See :meth:`OrderedServerBase.pull_if_changed`; ``timeout``: seconds (None: the accessor's)."""
        return self._call("_pull_if_changed", (_check_key(key), have_version), timeout)

    def _pull_in_place(self, key: Hashable, have_version: Any) -> Optional[Tuple[Any, Any]]:
        # On this host, a version word may answer "nothing new" without a call (_version_words).
        words = PullerWords.of(self)
        known, ask = words.answer(_check_key(key), have_version)
        if known:
            return None
        got = self._call("_pull_if_changed", (key, have_version), None, in_place=(True, ask))
        if ask:
            got, offer = got
            words.keep(key, offer)
        return got

    def _bounded(self, seconds: float) -> "OrderedServerSimple":
        PullerWords.of(self)  # (made first: the bounded copies share them)
        bounded = copy.copy(self)  # (a subclass's overrides kept)
        bounded.timeout = seconds
        return bounded

    def _call(self, service: str, args: Tuple[Any, ...], timeout: Any, in_place: Tuple[bool, ...] = ()) -> Any:
        wait = self.timeout if timeout is None else check_timeout(timeout)
        try:
            return self.group.registered_sync(f"{self.server_name}/{service}",
                                              (*args, self.group.get_cur_name(), *in_place), timeout=wait)
        except (KeyError, PeerLostError) as err:
            if raised_remotely(err):  # the host's own KeyError (its adopt hook): not a lost host
                raise
            # A call that found the host gone must not be followed by a pull that says
            # "nothing new" from a version word while the World's verdict is on its way.
            PullerWords.of(self).forget()
            if isinstance(err, KeyError):
                # The services vanish with a lost host's claims: say who is gone, not "not found".
                raise unserved(self.group, self.server_name, service, err) from err
            raise


class OrderedServerSimpleImpl:
    """Host of an ordered key-value server, in the process that constructs it.

    It registers its services in ``group`` and pairs an :class:`OrderedServerSimple`
    accessor under ``server_name``. The process must be a member of ``group``.

    Args:
        server_name: Name of the server, unique in ``group``.
        group: The RpcGroup clients reach the server through.
        version_depth: How many versions older than the newest are retained per key
            (0: only the newest). ``pull(key, v)`` of an evicted version returns None.
        adopt: Called as ``adopt(key, value)`` on each value pushed through RPC (and on
            each value restored from a checkpoint); what it returns is stored. None: the
            value is stored as it arrived.
        checkpoint_dir: Directory where the host keeps an atomic checkpoint of every
            key's retained history, and its version lease; a host whose directory holds
            one resumes from it here, each key's newest value republished under a
            version above every version ever visible. Versions must then be ints.
            None: no checkpoints.
        checkpoint_every: With ``checkpoint_dir``: write one every this many versions
            made (accepted pushes); creating a key always writes one.
        checkpoint_interval: With ``checkpoint_dir``: also write one when a version is
            made this many seconds or more after the last; None: by versions only.
        server_runner: machin's name of the member that serves the server: this process
            serves it, so a name given must be its own. None: this member.

    Raises:
        KeyError: ``server_name`` is already used in ``group``.
        TypeError, ValueError: invalid arguments (``server_runner`` naming another member).
        CheckpointError: the checkpoint is corrupt or another server's (named).
    """

    def __init__(self, server_name: str, group: RpcGroup, version_depth: int = 1,
                 adopt: Optional[Callable[[Hashable, Any], Any]] = None, checkpoint_dir: Any = None,
                 checkpoint_every: int = 100, checkpoint_interval: Optional[float] = None,
                 server_runner: Optional[str] = None) -> None:
        check_name(server_name, "server_name")
        if "/" in server_name:
            # A host's own servers are "<name>/ordered": "m/ordered" took model server m's.
            raise ValueError(f"server_name={server_name!r} holds a '/': those names belong to the servers a model "
                             f"or gradient server hosts ('<name>/ordered'); pick a name without '/'")
        if adopt is not None and not callable(adopt):
            raise TypeError(f"adopt must be callable or None, not {type(adopt).__name__}")
        check_group(group)
        check_runner(server_runner, group)
        depth = check_count(version_depth, "version_depth", 0)
        checkpoint = host_checkpoint(checkpoint_dir, "ordered-server", server_name, checkpoint_every,
                                     checkpoint_interval)
        self._open(server_name, group, depth, adopt, checkpoint)
        # Its own numbers in the status view; a host's (model, gradient server) are its host's.
        self._unnote = publish_notes(self._notes)

    @classmethod
    def _checked(cls, server_name: str, group: RpcGroup, version_depth: int,
                 adopt: Optional[Callable[[Hashable, Any], Any]] = None,
                 checkpoint: Optional[HostCheckpoint] = None, lease_in_store: bool = True
                 ) -> "OrderedServerSimpleImpl":
        """Built from values a host (a model or gradient server) checked already.

        Args:
            checkpoint: Where the history is kept, under the building server's name and
                kind; None: no checkpoints.
            lease_in_store: Without ``checkpoint``, in an elastic world: lease the
                versions in the world's store (``_store_lease``: a restarted host starts
                its int chains above every version its predecessors made visible). False
                where the building server leases its versions itself (the gradient
                server's checkpoint).
        """
        self = cls.__new__(cls)
        self._open(server_name, group, version_depth, adopt, checkpoint)
        if checkpoint is None and lease_in_store and current_world().elastic:
            self._lease = StoreLease(host_key(group, server_name) + "/lease")
        return self

    def _open(self, server_name: str, group: RpcGroup, version_depth: int,
              adopt: Optional[Callable[[Hashable, Any], Any]], checkpoint: Optional[HostCheckpoint]) -> None:
        self.server_name = server_name
        self._adopt = adopt
        self.group = group
        self.version_depth = version_depth
        self._checkpoint = checkpoint
        self._lease: Optional[StoreLease] = None  # (a host's chain without a checkpoint: see _checked)
        self._lock = threading.Lock()
        self._words = HostWords()  # (before the services: a pull may ask for a word at once)
        # key -> (version, value), oldest first; maxlen does the eviction.
        self._data: Dict[Hashable, Deque[Tuple[Any, Any]]] = {}
        self._counts = {"pushes_accepted": 0, "pushes_rejected": 0, "pulls": 0, "pulls_unchanged": 0}
        self._clients: Set[str] = set()
        self._seq = 0  # versions made by this host since it started (checkpoint cadence)
        self._made_at = time.monotonic()
        self._ckpt_failures = 0
        self.resumed_version: Optional[int] = None
        if checkpoint is not None:
            loaded = checkpoint.load()
            if loaded is not None:
                self._resume(checkpoint, *loaded)
        self._keys = [f"{server_name}/_push", f"{server_name}/_pull", f"{server_name}/_pull_if_changed"]
        self._closed = False
        services: List[Callable[..., Any]] = [self._push_service, self._pull_service, self._pull_if_changed_service]
        register_all(group, server_name, dict(zip(self._keys, services, strict=True)))
        try:
            # Once the name is ours: a client that finds the services gone can name this member.
            current_world().membership.registry.set(host_key(group, server_name), group.get_cur_name())
            group.pair(server_name, OrderedServerSimple._checked(server_name, group))
        except BaseException:
            for key in self._keys:
                group.deregister(key)
            raise
        self._members = MemberLog(f"ordered server {server_name!r}")
        self._unnote = _nothing  # (a host's own: see __init__)

    def __repr__(self) -> str:
        return f"<OrderedServerSimpleImpl {self.server_name!r} version_depth={self.version_depth}>"

    # ------------------------------------------------------------ checkpoints
    def _resume(self, checkpoint: HostCheckpoint, state: Dict[str, Any], lease: int) -> None:
        self._data, resumed = checkpoint.restore(state, lease, self.version_depth, self._adopt)
        self.resumed_version = resumed
        checkpoint.save(0, self._snapshot())
        # (named as checkpointed: a model server's chain is its own ordered server's)
        log.warning("%s %r resumed %d key(s) from %r, newest versions republished as %d", checkpoint.file.kind,
                    checkpoint.file.name, len(self._data), checkpoint.path, resumed)

    def _snapshot(self) -> Dict[str, Any]:
        # Under the lock (or before serving). Shallow: a stored value is never edited.
        return {"data": {key: list(entries) for key, entries in self._data.items()}}

    def _save(self, checkpoint: HostCheckpoint, seq: int, snapshot: Dict[str, Any]) -> None:
        try:
            checkpoint.save(seq, snapshot)
        except OSError as err:  # the push is stored and visible already: keep serving, say so
            with self._lock:
                self._ckpt_failures += 1
            log.error("ordered server %r could not write checkpoint %r: %s", self.server_name,
                      checkpoint.path, err)

    # ------------------------------------------------------------------ the store
    def store(self, key: Hashable, value: Any, version: Any, prev_version: Any) -> bool:
        """Compare-and-set in this process; ``value`` is kept as is (the caller hands it over).

        Used by servers hosted in the same process (the gradient server's primary) to
        publish a fresh snapshot without an RPC to itself.

        Args:
            key, value, version, prev_version: As for :meth:`OrderedServerBase.push`.

        Returns:
            True if stored, False if rejected.

        Raises:
            TypeError: with a checkpoint, ``version`` is not an int.
            OSError: with a checkpoint, the lease or the new key's checkpoint could not
                be written (nothing was stored).
        """
        return self._store_as(key, value, version, prev_version)[0]

    def _store_as(self, key: Hashable, value: Any, version: Any, prev_version: Any) -> Tuple[bool, Any]:
        """:meth:`store`, and the version ``value`` was stored as: ``version``, but for a
        new key's first version on a host restarted without a checkpoint (``_store_lease``)."""
        ckpt = self._checkpoint
        if ckpt is not None:
            check_version(version, self.server_name)
        snapshot = None
        with self._lock:  # what is appended here is visible only once the lock is released
            entries = self._data.get(key)
            if entries is not None and entries[-1][0] != prev_version:
                self._counts["pushes_rejected"] += 1
                return False, version
            if ckpt is not None:
                ckpt.cover(version)
            elif self._lease is not None:
                version = self._lease.renumber(version, entries is None)
            new = entries is None
            if entries is None:
                entries = self._data[key] = deque(maxlen=self.version_depth + 1)
            entries.append((version, value))
            self._words.store(key, version)
            self._seq += 1
            if ckpt is not None and new:
                try:  # a key must outlive a crash once a client may have seen it (see _host)
                    ckpt.save(self._seq, self._snapshot())
                except BaseException:
                    del self._data[key]
                    self._seq -= 1
                    raise
            elif ckpt is not None and ckpt.due(self._seq):
                snapshot = (self._seq, self._snapshot())
            self._counts["pushes_accepted"] += 1
            self._made_at = time.monotonic()
        if ckpt is not None and snapshot is not None:  # outside the lock: pulls go on while a model is written
            self._save(ckpt, *snapshot)
        return True, version

    def newest_version(self, key: Hashable) -> Any:
        """The newest version of ``key`` held here; None when the key is unknown."""
        with self._lock:
            entries = self._data.get(key)
            return entries[-1][0] if entries else None

    def stats(self) -> Dict[str, Any]:
        """Counters since this host started.

        ``keys``, ``pushes_accepted``, ``pushes_rejected``, ``pulls`` and
        ``pulls_unchanged`` (pull_if_changed calls that sent no value; a model or gradient
        server's puller on this machine that holds the newest version makes no call, see
        ``_version_words``); ``clients`` (the members that called it, sorted);
        ``since_version`` (seconds since the last version was made, or since the host
        started). With ``checkpoint_dir`` also
        ``checkpoints`` (written), ``checkpoint_failures`` (writes after a version that
        failed, logged) and ``resumed_version`` (the version the newest values were
        republished under on resume, None if it started afresh). In an elastic world also
        ``members``: ``losses`` and ``rejoins`` of other members seen.
        """
        with self._lock:
            out: Dict[str, Any] = dict(self._counts, keys=len(self._data), clients=sorted(self._clients),
                                       since_version=time.monotonic() - self._made_at)
            if self._checkpoint is not None:
                out.update(checkpoints=self._checkpoint.written, checkpoint_failures=self._ckpt_failures,
                           resumed_version=self.resumed_version)
        members = self._members.stats()
        if members is not None:
            out["members"] = members
        return out

    @property
    def checkpoint_path(self) -> Optional[str]:
        """The checkpoint file; None without ``checkpoint_dir``."""
        return None if self._checkpoint is None else self._checkpoint.path

    def checkpoint(self) -> str:
        """Write the checkpoint of every key's history now, e.g. when the job is told to
        stop (SIGTERM); nothing is rewritten when the file holds the newest version already.
        Call it from the program's loop (a SIGTERM handler sets an event): from a handler
        it could wait for a lock its own thread holds.

        Returns:
            The checkpoint file's path.

        Raises:
            RuntimeError: no ``checkpoint_dir``, or closed.
            OSError: the file could not be written.
        """
        if self._checkpoint is None:
            raise RuntimeError(f"ordered server {self.server_name!r} keeps no checkpoint: create it with "
                               f"checkpoint_dir=<a directory> to write one")
        if self._closed:
            raise RuntimeError(f"ordered server {self.server_name!r} is closed (it wrote its last checkpoint then)")
        with self._lock:
            seq, snapshot = self._seq, self._snapshot()
        self._checkpoint.save(seq, snapshot)  # (an older snapshot never overwrites a newer one)
        return self._checkpoint.path

    def _notes(self) -> List[ServerNote]:
        """Its numbers for the status view (see ``_common.publish_notes``)."""
        with self._lock:
            counts, made = dict(self._counts), self._made_at
        return [ServerNote("ordered", self.server_name, self.group.get_group_name(), "host",
                           accepted=counts["pushes_accepted"], refused=counts["pushes_rejected"],
                           since=time.monotonic() - made)]

    def close(self) -> None:
        """Withdraw the services and the paired accessor (the name can then be reused).

        With ``checkpoint_dir``, first writes a checkpoint of what is held, so that a host
        started again later resumes from it.
        """
        if self._closed:
            return
        self._closed = True
        self._unnote()
        self._members.close()
        for key in self._keys:
            self.group.deregister(key)
        self.group.unpair(self.server_name)
        with self._lock:  # (not while a pull offers a word)
            self._words.close()
        current_world().membership.registry.delete([host_key(self.group, self.server_name)])
        if self._checkpoint is not None:
            with self._lock:
                seq, snapshot = self._seq, self._snapshot()
            self._save(self._checkpoint, seq, snapshot)

    # ------------------------------------------------------------------- services
    # The value arrived through RPC, so it is already this process's own copy; what goes
    # back is serialised by RPC, so the caller gets a copy too. ``client``: the caller's name.
    def _push_service(self, key: Hashable, value: Any, version: Any, prev_version: Any, client: str = "",
                      numbered: bool = False) -> Any:
        """``numbered``: a model server's pusher, told the version stored (see ``_store_as``)."""
        self._note(client)
        if self._adopt is not None:
            value = self._adopt(key, value)  # outside the lock: it may copy a whole model
        stored = self._store_as(key, value, version, prev_version)
        return stored if numbered else stored[0]

    def _note(self, client: str) -> None:
        if client and client not in self._clients:
            with self._lock:
                self._clients.add(client)

    def _pull_service(self, key: Hashable, version: Any, client: str = "") -> Optional[Tuple[Any, Any]]:
        self._note(client)
        found = None
        with self._lock:
            self._counts["pulls"] += 1
            entries = self._data.get(key)
            if entries and version is None:
                found = entries[-1]
            elif entries:
                found = next((entry for entry in reversed(entries) if entry[0] == version), None)
        return None if found is None else (_private(found[1]), found[0])

    def _pull_if_changed_service(self, key: Hashable, have_version: Any, client: str = "", in_place: bool = False,
                                 word: bool = False) -> Any:
        """``in_place``: a model or gradient server's puller (see ``_pull_in_place``);
        ``word``: it asks for the key's version word too (the reply is a pair then)."""
        self._note(client)
        got = offer = None
        with self._lock:
            self._counts["pulls"] += 1
            entries = self._data.get(key)
            if word:
                offer = self._words.offer(key, entries[-1][0] if entries else None, self.group.get_cur_name(),
                                          current_world().incarnation)
            if entries and entries[-1][0] == have_version:
                self._counts["pulls_unchanged"] += 1
            elif entries:
                got = entries[-1]
        if got is not None:
            got = (got[1] if in_place else _private(got[1])), got[0]
        return (got, offer) if word else got
