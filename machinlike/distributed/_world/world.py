"""World: this process's membership in the distributed job (one per process).

Two kinds of world share this class: *static* (the default, machin's ``World(name, rank,
world_size)``), a fixed set of ranks, and *elastic* (``elastic=True``), whose members join
a running world by its address and a name, leave it, die and come back.

A World holds two objects and a stop flag:

    World ─┬─ Settings  the validated arguments, frozen                     (_world.settings)
           └─ Session   what start-up built, each step with its undo        (_world.session)
                          store, interface, Membership, RPC, process group
    World(...)  settings(...) -> claim this process's World slot -> start_static /
                start_elastic(session); on failure session.close(), slot released
    stop()      leave_static / leave_elastic (never past the deadline)     (_world.stop)
                then, always: session.close(), slot released

Here are the accessors, membership queries and group creation.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Union

import torch.distributed as dist

from ... import _checks, _descriptors, _mainguard
from .._store import forked as _forked, rendezvous as _rendezvous
from .._groups import CollectiveGroup, CreationOrder, FailureNamer
from .._membership import DEFAULT_LIVENESS
from .._membership import MemberEvent, Membership, record_own_exit
from .._groups import GroupDirectory
from .._groups import create_group, find_group, open_group
from .._groups import RpcGroup
from .session import Session, start_elastic, start_static
from .settings import Settings, no_collectives, settings
from .stop import leave_elastic, leave_static

__all__ = ["World", "MemberEvent", "get_world", "require_world", "is_world_initialized", "get_cur_rank", "get_cur_name"]

log = logging.getLogger(__name__)

_STOP_MARK_LOOK_S = 1.0  # seconds between looks for a static rank's stop mark (wait_for_members(gone=True))


class World:
    """This process's place in a distributed job: RPC, collectives and the group registry.

    Args:
        name: Member name, unique among live members (1-100 letters, digits, ``_:-``).
            None: ``str(rank)``.
        rank: This process's rank. None: the ``RANK`` environment variable (torchrun);
            in an elastic world, None picks a fresh unique rank (never 0), a rank given
            is held by one live member at a time, and ``rank=0`` makes this process host
            the store.
        world_size: Number of processes of a static world. None: ``WORLD_SIZE``. Must be
            None in an elastic world.
        init_method: ``"tcp://host:port"`` (rank 0 hosts the store there), ``"env://"``, or
            None: ``MASTER_ADDR``/``MASTER_PORT`` when set (torchrun), else 127.0.0.1:29500.
        backend: Backend of the default process group (``"gloo"``, ``"nccl"``, ``"mpi"``, ``"ucc"``).
        rpc_timeout: Default timeout of RPC calls, seconds.
        rpc_threads: RPC worker threads serving incoming calls.
        collective: Initialise the default process group (collectives). machin: ``init_dist``.
            Static worlds only (gloo's groups are fixed at creation).
        init_rpc: Initialise RPC (needed by RpcGroups and the servers).
        dist_timeout: Timeout of start-up, collectives and group creation, seconds.
        store: An existing ``TCPStore`` to use instead of ``init_method`` (e.g. the launcher's).
        interface: Network interface that TensorPipe (RPC) and gloo (collectives) use on
            this host, by name (``"eth0"``) or by one of its addresses. None:
            ``MACHINLIKE_SOCKET_IFNAME`` when set, else ``TP_SOCKET_IFNAME`` /
            ``GLOO_SOCKET_IFNAME`` each when set, else the interface this host reaches the
            master through (``lo`` for a loopback master). The chosen one is ``interface``.
        elastic: Join a world whose members come and go (see the module doc); static when False.
        liveness: Seconds within which a member on another host that died without a
            word is detected (its heartbeats in the store stop for 3/4 of it); a member
            on this host is seen dead at once through its process descriptor (a
            pidfd; at the latest within a tick, ``liveness / 8``, at most 0.5 s). A live
            member on another host silent for longer (stopped, starved of CPU, holding
            the GIL) is declared lost too, and then told so on its every call; so is
            one on this host whose process a signal stopped (SIGSTOP, SIGTSTP), while
            one that runs, however busy, is not (nor one a debugger holds). None turns
            detection off. Default 10.
        init_dist: machin's name for ``collective`` (wins over it when given).
        dist_backend: machin's name for ``backend`` (wins over it when given).
        dist_init_method: machin's name for ``init_method``, used when that is None.
        rpc_init_method: machin's separate RPC rendezvous; there is one store, so it is
            used as ``init_method`` only when neither of the two above is given.
        same_host_shm: CPU tensors of RpcGroup calls between members on this host travel
            through shared memory (see the RPC tutorial). False: always through TensorPipe.
        shm_threshold: Bytes from which a tensor takes shared memory (256 KiB: from about
            200 KiB on, one copy through a segment beat the socket; ``benchmarks/shm_threshold.py``).
        shm_cache_bytes: Bound, in bytes, of this process's recycled segments and, again,
            of its cached mappings of peers' memory.
        cuda_ipc_cache_bytes: Bound, in bytes, of this process's CUDA export slabs (GPU
            memory it keeps to send CUDA tensors to processes on this host through CUDA
            IPC) and, again, of what its cached openings of peers' slabs map (their whole
            allocator segments). 0: CUDA tensors are
            staged through the CPU, as between hosts. Default 4 GiB.
        same_host_lane: Calls between members on this host go through a Unix socket of
            machinlike's (its threads sleep until a call comes: an idle member costs no
            CPU, and a small call took a quarter of TensorPipe's time on a 2-core test
            machine), and TensorPipe uses TCP only.
            False: through TensorPipe with its default transports, whose shared-memory
            one polls (each idle process of a host spins). Calls the lane cannot carry
            (CUDA tensors, autograd, RRefs, tensors over 1 MB) take TensorPipe either way.

    Attributes:
        name: This process's member name.
        rank: This process's rank.
        incarnation: 1 for a member's first process, 2 for its first replacement, ...
        rpc_timeout: Default timeout of RPC calls, seconds.
        dist_timeout: Default timeout of start-up, barriers, collectives and group
            creation, seconds.
        interface: The interface TensorPipe uses on this host (None: its own guess from the
            hostname, when neither a setting nor the route to the master tells).
        elastic: Whether members may join and leave.
        store_address: ``"tcp://host:port"`` of the world's store: what a process passes as
            ``init_method`` to join an elastic world.

    Raises:
        ValueError, TypeError: invalid arguments (the message names the parameter), or
            (elastic) a live member already has ``name``, or the ``rank`` given.
        RuntimeError: this process already has a World, or (``collective=True``) torch's
            default process group, or (static) this rank is held in a world running on
            that store by another live process of this host (two jobs given one port).
        OSError: rank 0 cannot listen on the master address and port (both named).
        TimeoutError: the master (address and port named) cannot be reached, or answers
            as no store does, or some rank did not arrive, within ``dist_timeout``.
    """

    def __init__(
        self,
        name: Optional[str] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        *,
        init_method: Optional[str] = None,
        backend: str = "gloo",
        rpc_timeout: float = 60.0,
        rpc_threads: int = 16,
        collective: bool = True,
        init_rpc: bool = True,
        dist_timeout: float = 60.0,
        store: Optional[dist.Store] = None,
        interface: Optional[str] = None,
        elastic: bool = False,
        liveness: Optional[float] = DEFAULT_LIVENESS,
        init_dist: Optional[bool] = None,
        dist_backend: Optional[str] = None,
        dist_init_method: Optional[str] = None,
        rpc_init_method: Optional[str] = None,
        same_host_shm: bool = True,
        shm_threshold: int = 256 << 10,
        shm_cache_bytes: int = 1 << 30,
        cuda_ipc_cache_bytes: int = 4 << 30,
        same_host_lane: bool = True,
    ) -> None:
        _mainguard.check("World(...)")
        self._settings: Settings = settings(
            name, rank, world_size, init_method=init_method, backend=backend, rpc_timeout=rpc_timeout,
            rpc_threads=rpc_threads, collective=collective, init_rpc=init_rpc, dist_timeout=dist_timeout,
            store=store, interface=interface, elastic=elastic, liveness=liveness, init_dist=init_dist,
            dist_backend=dist_backend, dist_init_method=dist_init_method, rpc_init_method=rpc_init_method,
            same_host_shm=same_host_shm, shm_threshold=shm_threshold, shm_cache_bytes=shm_cache_bytes,
            cuda_ipc_cache_bytes=cuda_ipc_cache_bytes, same_host_lane=same_host_lane,
        )
        # After the checks, before anything opens a connection (``_descriptors`` says why);
        # the ranks and pools this process starts later inherit it.
        _descriptors.raise_limit()
        self._session = Session(self._settings)
        self._creation_order: Optional[CreationOrder] = None  # (made at the first collective group)
        self._stopped = False
        self._stop_lock = threading.Lock()
        self._pid = os.getpid()  # (a child forked from this process must not stop it: see stop)
        _claim_current(self)
        try:
            if self._settings.collective and dist.is_initialized():  # (before anything is opened or sent)
                raise RuntimeError(
                    "this process already has torch's default process group (torch.distributed."
                    "init_process_group was called before): World(collective=True) starts its own; pass "
                    "collective=False to keep yours (RpcGroups and the servers need no process group), or call "
                    "torch.distributed.destroy_process_group() first")
            (start_elastic if self._settings.elastic else start_static)(self._session)
        except BaseException:
            self._teardown()
            raise

    # ------------------------------------------------------------------- accessors
    # The attributes of the class docstring, read-only (no docstrings here: the class
    # documents them once).
    @property
    def name(self) -> str:
        return self._settings.name

    @property
    def rank(self) -> int:
        return self._session.rank

    @property
    def incarnation(self) -> int:
        return self._session.incarnation

    @property
    def rpc_timeout(self) -> float:
        return self._settings.rpc_timeout

    @property
    def dist_timeout(self) -> float:
        return self._settings.dist_timeout

    @property
    def liveness(self) -> Optional[float]:
        return self._settings.liveness

    @property
    def elastic(self) -> bool:
        return self._settings.elastic

    @property
    def interface(self) -> Optional[str]:
        return self._session.interface

    @property
    def store_address(self) -> Optional[str]:
        return self._session.store_address

    @property
    def _store_info(self) -> Optional[_rendezvous.StoreInfo]:
        return self._session.store

    def _network_hint(self) -> "contextlib.AbstractContextManager[None]":
        return self._session.network_hint()

    @property
    def membership(self) -> Membership:
        """This world's membership tables (live members, events, registry keys)."""
        members = self._session.membership
        if members is None:
            raise RuntimeError(f"World {self.name!r} is not started")
        return members

    def transport_stats(self) -> Dict[str, Dict[str, int]]:
        """How this process's calls to members on this host travelled, as counters.

        ``shm`` (while ``same_host_shm`` is on): segments for large CPU tensors:
        ``leases``; ``created`` and ``evicted`` segments; ``reclaimed`` (a receiver
        died holding one); ``unread`` (a receiver died before taking one);
        ``fallbacks`` (a tensor sent through TensorPipe because ``shm_cache_bytes`` was
        full, a warning said why once); ``overdue`` (results sent without shared memory
        because their caller's timeout had passed); ``lent`` and ``held_bytes`` now.
        ``lane`` (while ``same_host_lane`` is on): ``calls``, ``not_carried`` (left to
        torch RPC), open ``connections``, ``late`` answers. ``cuda_ipc`` (while CUDA
        tensors may cross through IPC): tensors and bytes sent and received that way,
        and each reason one was staged through the CPU instead (``staged_*``).
        Counts since the process started (its Worlds share them).
        """
        return self._session.transport_stats()

    # Internal: what an RpcGroup handle of this World uses of it (its typed seam).
    @property
    def groups(self) -> GroupDirectory:
        groups = self._session.groups
        if groups is None:
            raise RuntimeError(f"World {self.name!r} is not started")
        return groups

    @property
    def world_size(self) -> int:
        """Number of ranks of a static world; the number of live members of an elastic one."""
        return len(self.membership.members()) if self.elastic else self._settings.size

    def get_members(self) -> List[str]:
        """Names of the live members of the world, sorted."""
        return self.membership.members()

    def get_incarnation(self, member: Optional[str] = None) -> Optional[int]:
        """The incarnation of live ``member`` (None: this process); None when it is not live."""
        return self.incarnation if member is None else self.membership.incarnation_of(member)

    def get_ranks(self) -> List[int]:
        """Ranks of the live members, sorted."""
        return self.membership.roster.ranks()

    def on_member_change(self, callback: Callable[[MemberEvent], None]) -> None:
        """Call ``callback(event)`` on every join, leave and loss from now on.

        Callbacks run one at a time, in the world's event order, on this World's liveness
        thread: keep them short and do not make blocking calls to other members there
        (hand work to your own thread). An exception in a callback is logged and ignored.

        Args:
            callback: Takes a :class:`MemberEvent`.
        """
        if not callable(callback):
            raise TypeError(f"callback must be callable, not {type(callback).__name__}")
        self.membership.subscribe(callback)

    def remove_member_callback(self, callback: Callable[[MemberEvent], None]) -> None:
        """Stop calling ``callback`` (no error if it was not registered)."""
        self.membership.unsubscribe(callback)

    def wait_for_members(self, members: Union[int, Sequence[str]], timeout: Optional[float] = None, *,
                         gone: bool = False) -> List[str]:
        """Block until the named members (or at least ``members`` members) are live.

        Args:
            members: Names that must all be live, or a number of live members to reach.
            timeout: Seconds; None: ``dist_timeout``.
            gone: Wait for the named members' departure instead: each has left or was
                lost (one that has not joined yet is waited for). A static world's members
                leave together (``World.stop`` waits for every rank): waiting for one that
                began its stop lasts until this rank stops too, or it is lost (logged once).

        A named member that left the world cleanly (its function returned, or it stopped
        its World) fails the wait at once: in an elastic world it is live again only if
        started again under its name. One that was lost, or left after raising, is waited
        for: ``launch(..., max_restarts=...)`` restarts it under its name.

        Returns:
            The live members at that moment, sorted.

        Raises:
            TimeoutError: not reached within ``timeout`` (names what was missing, and how
                each missing member that had joined went).
            PeerLostError: a named member left cleanly (named, with when).
        """
        wait = _checks.seconds_or_none("timeout", timeout, self.dist_timeout)
        if isinstance(members, int) and not isinstance(members, bool):
            count = _checks.positive_int("members", members)
            return self._wait_members(lambda live: len(live) >= count, wait,
                                      lambda live: f"{count} live members, {len(live)} are")
        names = set(_checks.sequence_of_str("members", members))
        if gone:
            return self._wait_gone(names, wait)
        return self.membership.wait_live(names, wait)

    def _wait_gone(self, names: Set[str], wait: float) -> List[str]:
        m = self.membership
        deadline = time.monotonic() + wait
        told: Set[str] = set()

        def departed(live: List[str]) -> bool:
            return all(n not in live and m.gone(n) is not None for n in names)

        while True:
            left = deadline - time.monotonic()
            try:
                return m.wait_until(departed, left if self.elastic else min(left, _STOP_MARK_LOOK_S))
            except TimeoutError:
                if time.monotonic() >= deadline:
                    live = m.members()
                    waiting = sorted(n for n in names if n in live or m.gone(n) is None)
                    if not waiting:  # they went just now
                        return live
                    raise TimeoutError(f"wait_for_members: waited {wait:g} s for {waiting} to be gone, still "
                                       f"{'live' if set(waiting) <= set(live) else 'live or not joined yet'} "
                                       f"(live: {live})") from None
            self._tell_stopping(names - told, told)

    def _tell_stopping(self, names: Set[str], told: Set[str]) -> None:
        """(Static world) say once, for each of ``names`` that began its ``World.stop``, why
        waiting for it to be gone takes as long as that stop: it waits for this rank too."""
        m = self.membership
        by_rank = m.roster.names_by_rank()
        for name in sorted(n for n in names if n in by_rank and n != self.name):
            if m.registry.present([m.keys.stop_prefix() + str(by_rank.index(name))]):
                told.add(name)
                log.warning("wait_for_members(gone=True): member %r has begun World.stop, which in a static "
                            "world waits for every rank, this one included: it leaves when this rank stops too "
                            "(return from the function launch() runs, or call world.stop()), or when it is "
                            "lost; members leave one by one only in an elastic world", name)

    def _wait_members(self, reached: Callable[[List[str]], bool], wait: float,
                      missing: Callable[[List[str]], str]) -> List[str]:
        try:
            return self.membership.wait_until(reached, wait)
        except TimeoutError:
            live = self.membership.members()
            raise TimeoutError(f"wait_for_members: waited {wait:g} s for {missing(live)} (live: {live})") from None

    def __repr__(self) -> str:
        state = "stopped" if self._stopped else "running"
        kind = "elastic" if self.elastic else f"rank {self.rank}/{self._settings.size}"
        return f"<World {self.name!r} {kind} {state}>"

    def __reduce__(self) -> Any:
        raise TypeError("a World belongs to its process and cannot be pickled; "
                        "call machinlike.distributed.get_world() in the other process")

    # ---------------------------------------------------------------------- groups
    def create_rpc_group(self, group_name: Optional[str] = None, members: Optional[Sequence[str]] = None,
                         timeout: Optional[float] = None, *, name: Optional[str] = None) -> RpcGroup:
        """Create an RpcGroup; every member must call this, non-members must not.

        Args:
            group_name: Group name (no ``/`` or ``,``), reusable after every member
                ``destroy()``-ed it. (``name=`` is accepted too.)
            members: Member names of the world; must include this process. Every member
                must pass the same names (in any order). None: an *open* group of whoever
                is in the world, now or later; each process that calls this joins it at
                once, without waiting for the others.
            timeout: Seconds to wait for all members. None: ``dist_timeout``.

        Returns:
            This process's handle of the group.

        Raises:
            TypeError: ``group_name`` is not a str or ``members`` not a sequence of str.
            ValueError: bad name, unknown or duplicate members, this process not among
                them, members that passed different lists, or the group already exists
                here, or with other members anywhere in the world (until each of its
                members destroyed it).
            RuntimeError: the World was created with ``init_rpc=False``, or is stopped.
            TimeoutError: naming the members that never came (call it again to go on
                waiting: they meet whoever comes late).
            PeerLostError: a member left or died while it was awaited (named).
        """
        self._require_live()
        if name is not None:
            if group_name is not None:
                raise TypeError("pass the group's name once: group_name=... (machin) or name=...")
            group_name = name
        if group_name is None:
            raise TypeError("create_rpc_group() needs group_name")
        if not self._settings.rpc:
            raise RuntimeError("this World was created with init_rpc=False; RpcGroups need RPC")
        wait = _checks.seconds_or_none("timeout", timeout, self.dist_timeout)
        if members is None:
            return open_group(self.groups, group_name)
        return create_group(self.groups, group_name, _checks.sequence_of_str("members", members), wait)

    def get_rpc_group(self, group_name: str) -> Optional[RpcGroup]:
        """The RpcGroup ``group_name``: this process's own, else a handle if it exists, else None.

        A handle that is not this process's own (it is not a member, has not created the
        group yet, or destroyed its handle) can call the group's services and read its
        values, but cannot register, pair or barrier (RuntimeError, saying which).

        Args:
            group_name: Group name.

        Returns:
            The group, or None when no group of that name exists in the world.

        Raises:
            TypeError, ValueError: ``group_name`` is not a str, or no group name.
            RuntimeError: the World is stopped.
        """
        self._require_live()
        return find_group(self.groups, group_name)

    def create_collective_group(self, ranks: Sequence[int], backend: Optional[str] = None,
                                timeout: Optional[float] = None) -> CollectiveGroup:
        """Create a collective group over ``ranks`` (global ranks); every process must call it.

        Every process of the world calls it, members or not, with the same ranks and in
        the same order as its other group creations (torch's rule for ``new_group``).

        Args:
            ranks: Global ranks of the members, distinct, in ``[0, world_size)``.
            backend: Backend of the group (``"gloo"``, ``"nccl"``). None: the World's.
            timeout: Timeout of the group's operations, seconds. None: ``dist_timeout``.

        Returns:
            The group; in a process outside ``ranks`` its ``is_member()`` is False.

        Raises:
            TypeError: ``ranks`` is not a sequence of int, or ``backend`` not a str.
            ValueError: empty, duplicate or out-of-range ranks, or a non-positive timeout;
                or another process created its collective group of the same rank (its
                first, second...) with other ranks (named): every process creates its
                groups with the same ranks in the same order.
            TimeoutError: a process did not create this group within ``timeout`` (named).
            PeerLostError: a process is gone (named).
            NoCollectivesError: the World was created with ``collective=False`` or is
                elastic (gloo groups are fixed at creation); a RuntimeError.
            RuntimeError: the World is stopped.
        """
        self._require_live()
        if not self._settings.collective:
            raise no_collectives(self._settings)
        m = self.membership
        return CollectiveGroup.create(ranks, self.rank, self._settings.size, backend,
                                      _checks.seconds_or_none("timeout", timeout, self.dist_timeout),
                                      retire=self._session.retired_groups.keep, agree=self._creations().agree,
                                      namer=FailureNamer(m.roster, m.roster.names_by_rank()))

    def _creations(self) -> CreationOrder:
        if self._creation_order is None:
            m = self.membership
            self._creation_order = CreationOrder(m.registry, m.keys, m.waits, self.rank, m.roster.names_by_rank())
        return self._creation_order

    # -------------------------------------------------------------------- shutdown
    def stop(self, timeout: Optional[float] = None) -> None:
        """Leave the world.

        Static world: gracefully when every peer stops too, else locally. Waits at most
        ``timeout`` seconds for every member to call ``stop`` (a member known to be lost is
        not waited for). When all did, RPC shuts down gracefully (pending calls finish);
        otherwise, or when the graceful shutdown fails, locally.

        Elastic world: this member's services and values are withdrawn, the others see it
        leave, and RPC stops locally; the process hosting the store first waits (within
        ``timeout``) for the other members to leave, since they need the store.

        The process hosting the store closes it last: once ``stop`` returns, its port is
        free, and a new World of this process may use it.

        Calls this member still serves get what is left of ``timeout`` (at least 1 s) to
        finish, half a second once the world's store is gone (the world is over); one that
        takes longer (a service that blocks) does not hold the stop: its caller gets an
        error and the RPC agent finishes shutting down in the background.

        Safe to call twice; called on leaving a ``with World(...)`` block. Does nothing
        (a warning) in a child forked from the World's process: the World is its parent's.

        Args:
            timeout: Seconds to wait for the peers. None: ``dist_timeout``.

        Raises:
            ValueError: ``timeout`` is not a positive number.
        """
        wait = _checks.seconds_or_none("timeout", timeout, self.dist_timeout)
        if os.getpid() != self._pid:
            # A child forked from the World's process (os.fork) that unwinds through a
            # ``with World`` block or launch's body: its store connections and pipes are
            # its parent's, and a stop from here would talk over them (and break them).
            log.warning("World %r belongs to process %d; stop() in process %d, forked from it, does nothing "
                        "(end a forked child with os._exit, or start it with the 'spawn' method)",
                        self.name, self._pid, os.getpid())
            return
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        deadline = time.monotonic() + wait
        try:
            if self.elastic:
                leave_elastic(self._session, deadline)
            else:
                if self._settings.collective and self._session.membership is not None:
                    # (a peer waiting to create a collective group this rank never creates
                    # fails now, naming it, not at its timeout)
                    self._creations().end()
                leave_static(self._session, deadline, wait)
        except Exception as err:  # the local teardown below still has to happen
            log.warning("World %r: stop did not complete (%s); tearing down locally", self.name, err)
        finally:
            self._teardown()

    def _teardown(self) -> None:
        """Undo every start step, then free this process's World slot (always completes)."""
        self._stopped = True
        try:
            self._session.close()
        finally:
            _release_current(self)

    def _require_live(self) -> None:
        if self._stopped:
            raise RuntimeError(f"World {self.name!r} has been stopped; create a new World")

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        try:
            if exc_info[1] is not None:
                self.note_exit(exc_info[1])
        finally:  # (a second Ctrl-C during the note still stops the World)
            self.stop()

    def note_exit(self, exc: BaseException) -> None:
        """Record ``exc`` as the reason this member ends, for ``python -m machinlike status``
        (its EXIT column) and the others' "is lost" lines; call it before :meth:`stop`.

        The launchers and ``with World(...)`` call it when the rank function or the block
        raises; a program that manages its World by hand can call it itself. Best effort:
        it waits at most a second for the store, and does nothing in a stopped World, one
        not yet entered, or a process forked from this World's.
        """
        members = self._session.membership
        if members is not None and not self._stopped and os.getpid() == self._pid:
            with contextlib.suppress(RuntimeError):  # (not entered: no incarnation to speak of)
                record_own_exit(members.registry, members.keys, members.endpoint.me, exc)


#: The running World of this process, None when there is none (World is its only writer).
_current: Optional[World] = None
#: Held while a World claims or releases ``_current``.
_lock = threading.Lock()


def _claim_current(world: World) -> None:
    """Make ``world`` this process's World.

    Raises:
        RuntimeError: this process has one already.
    """
    global _current
    _forked.check("a new World")  # (its parent's World is _current here: not this child's to stop)
    with _lock:
        if _current is not None:
            raise RuntimeError(f"this process already has a World ({_current.name!r}); stop() it before creating another")
        _current = world
        _forked.running(True)


def _release_current(world: World) -> None:
    """This process has no World any more, if ``world`` was it."""
    global _current
    with _lock:
        if _current is world:
            _current = None
            _forked.running(False)


def require_world() -> World:
    """This process's World.

    Raises:
        RuntimeError: there is none.
    """
    world = _current
    if world is None:
        raise RuntimeError("no World in this process: create one first, e.g. World(rank=..., world_size=...)")
    return world


def get_world() -> Optional[World]:
    """This process's World, None if there is none (or it was stopped)."""
    return _current


def is_world_initialized() -> bool:
    """Whether this process has a running World."""
    return _current is not None


def get_cur_rank() -> int:
    """Rank of this process.

    Raises:
        RuntimeError: this process has no World.
    """
    return require_world().rank


def get_cur_name() -> str:
    """Member name of this process.

    Raises:
        RuntimeError: this process has no World.
    """
    return require_world().name
