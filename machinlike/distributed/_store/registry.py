"""The world's shared tables, kept in the c10d store under the ``mlk/`` prefix.

Every ``(group, key) -> owner`` entry, group join record and barrier arrival is a store
key, so no Python process is a hot spot: the store is torch's C++ server (hosted by rank
0, by the launcher, or by torchrun's agent).

Ownership uses the store's atomic compare-and-set; a released key keeps an empty value
(a tombstone) so that claim, release and look-up are each one round trip:

    claim    compare_set(k, "", me)   absent or tombstone -> me ; held -> holder
    release  compare_set(k, me, "")   held by me -> "" ; otherwise -> not ours
    look up  compare_set(k, P, P)     P is a probe no owner can be: absent -> P

Blocking waits (barriers, group joins) use a per-thread connection of their own,
because a store client serialises its operations and one thread's wait would otherwise
stall every other thread of the process.
"""

from __future__ import annotations

import datetime
import threading
from typing import Iterable, List, Optional, Sequence

import torch.distributed as dist

from ...exception import PeerLostError
from . import forked
from .client import PROBE as _PROBE, multi_get, own_client, value_or_empty
from .main_waits import MainWaits
from .lookups import BoundedLookups

__all__ = ["Registry", "STORE_OF_RANK0"]

#: How errors name the store's host before its name is known: a static world's rank 0
#: (``Membership.enter_static`` names it once the members' names are exchanged).
STORE_OF_RANK0 = "rank 0"


class Registry:
    """Owner table, join records and barriers of one world, on its store.

    Args:
        store: The world's store (a TCPStore, so it can be cloned per thread).
        store_owner: Who hosts it, for error messages (e.g. ``"rank 0"``).
    """

    def __init__(self, store: dist.Store, store_owner: str) -> None:
        self._store = store
        self._store_owner = store_owner
        self._local = threading.local()
        self._lookups = BoundedLookups(store, store_owner)
        # The main thread's waits run on helpers, so that a Ctrl-C ends them (see main_waits).
        self._main_waits = MainWaits(self._connection)
        self._silent: Optional[str] = None  # why the store was declared silent (mark_silent)
        # The error that broke the main connection: torch's client never reconnects (a new
        # server on the same port included), so later requests on it fail here, at once and
        # without torch's C++ warning and stack for each.
        self._broken: Optional[BaseException] = None

    @property
    def store_owner(self) -> str:
        """Who hosts the store, as errors name it."""
        return self._store_owner

    def name_store_owner(self, owner: str) -> None:
        """Name the store's host anew (a static world's rank 0, once its name is known)."""
        self._store_owner = owner
        self._lookups.store_owner = owner

    # ------------------------------------------------------------------ connections
    def _waiter(self) -> dist.Store:
        forked.check("a store request")
        store = getattr(self._local, "store", None)
        if store is None:
            store = self._local.store = self._connection()
        return store

    def _connection(self) -> dist.Store:
        # A new connection with the main one's timeout (own_client: TCPStore.clone held
        # the GIL for 250 ms under load); the main one where the store cannot make one.
        timeout = getattr(self._store, "timeout", None)  # (in torch, not in its stubs)
        own = own_client(self._store, timeout) if isinstance(timeout, datetime.timedelta) else None
        return own or self._store

    def short_connection(self, seconds: float) -> dist.Store:
        """A new connection whose requests end after ``seconds`` (the main one where the
        store cannot make one): a write that must not hold up the main connection."""
        return own_client(self._store, datetime.timedelta(seconds=seconds)) or self._store

    def warm(self) -> None:
        """Open the look-up thread's store connection now (see ``BoundedLookups.warm``);
        :meth:`close` ends it."""
        self._lookups.warm()

    def close(self) -> None:
        """End this process's look-up thread (see ``_store.lookups``) and let go of the
        threads' waiter connections (a later wait opens a new one); the main connection
        stays open."""
        self._lookups.close()
        self._main_waits.close()
        # (a fresh local drops every thread's waiter now, not when the World's reference
        # cycles are collected)
        self._local = threading.local()

    @property
    def unreachable(self) -> bool:
        """Whether a request on the main connection failed for the network, or the store
        was declared silent: from then on every request fails at once."""
        return self._broken is not None

    def mark_silent(self, why: str) -> None:
        """Say ``why`` in every error from now on: the store did not answer, and this
        process is about to cut its connections to it (``_membership.store_watch``); the
        main connection's requests fail at once from now on."""
        self._silent = why
        if self._broken is None:
            self._broken = ConnectionError(why)

    def _main(self) -> dist.Store:
        """The main connection; PeerLostError once a request on it failed for the network."""
        forked.check("a store request")
        if self._broken is not None:
            raise self._lost(self._broken)
        return self._store

    def _lost_main(self, err: BaseException) -> PeerLostError:
        if self._broken is None:
            self._broken = err
        return self._lost(err)

    def _lost(self, err: BaseException) -> PeerLostError:
        if self._silent is not None:
            return PeerLostError(self._store_owner, self._silent)
        return PeerLostError(self._store_owner, f"the world's store is unreachable ({err})")

    # ------------------------------------------------------------------------ owners
    def claim(self, key: str, owner: str) -> Optional[str]:
        """Take ``key`` for ``owner``; return the current holder if someone else has it."""
        store = self._main()
        try:
            held = store.compare_set(key, "", owner).decode()
        except (dist.DistNetworkError, ConnectionError) as err:
            raise self._lost_main(err) from err
        return None if held == owner else held

    def release(self, key: str, owner: str) -> bool:
        """Free ``key`` if ``owner`` holds it; False when it does not."""
        store = self._main()
        try:
            return store.compare_set(key, owner, "") == b""
        except (dist.DistNetworkError, ConnectionError) as err:
            raise self._lost_main(err) from err

    def owner(self, key: str, timeout: Optional[float] = None) -> Optional[str]:
        """Who holds ``key`` right now, None if nobody.

        Args:
            timeout: Seconds the caller has left; None: the store client's own timeout.

        Raises:
            TimeoutError: the store did not answer within ``timeout``.
            PeerLostError: the store is gone.
        """
        if timeout is None:
            store = self._main()
            try:
                held = store.compare_set(key, _PROBE, _PROBE).decode()
            except (dist.DistNetworkError, ConnectionError) as err:
                raise self._lost_main(err) from err
        else:
            try:  # (on the look-up thread's connection, not the main one)
                held = self._lookups.run(lambda own: own.compare_set(key, _PROBE, _PROBE).decode(), timeout,
                                         "the owner look-up")
            except (dist.DistNetworkError, ConnectionError) as err:
                raise self._lost(err) from err
        return None if held in ("", _PROBE) else held

    def set(self, key: str, value: str) -> None:
        store = self._main()
        try:
            store.set(key, value)
        except (dist.DistNetworkError, ConnectionError) as err:
            raise self._lost_main(err) from err

    def add(self, key: str, amount: int) -> int:
        """Atomically add ``amount`` to counter ``key`` (0 when absent); the new value."""
        store = self._main()
        try:
            return int(store.add(key, amount))
        except (dist.DistNetworkError, ConnectionError) as err:
            raise self._lost_main(err) from err

    def append(self, key: str, text: str) -> None:
        store = self._main()
        try:
            store.append(key, text)  # type: ignore[attr-defined]  # in torch, not in its stubs
        except (dist.DistNetworkError, ConnectionError) as err:
            raise self._lost_main(err) from err

    def compare_set(self, key: str, expected: str, desired: str) -> str:
        """Set ``key`` to ``desired`` if it holds ``expected`` ("" also matches absent); the value after."""
        store = self._main()
        try:
            return store.compare_set(key, expected, desired).decode()
        except (dist.DistNetworkError, ConnectionError) as err:
            raise self._lost_main(err) from err

    def get_or_empty(self, key: str) -> str:
        """The value of ``key``, "" when absent (never waits)."""
        store = self._main()
        try:  # (a retired worker's entry may be deleted while it is read: see value_or_empty)
            return value_or_empty(store, key)
        except (dist.DistNetworkError, ConnectionError) as err:
            raise self._lost_main(err) from err

    def values_or_empty(self, prefix: str, names: Sequence[str]) -> List[str]:
        """Values of ``prefix + name`` for each name, "" for absent ones; never waits.

        Why one probe per key: a check, then a multi_get, waited the store's whole timeout
        (60 s) for a key deleted between the two (a departed worker's claims list, a reaped
        heartbeat), which a CI run hit."""
        store = self._waiter()
        try:
            return [value_or_empty(store, prefix + n) for n in names]
        except (dist.DistNetworkError, ConnectionError) as err:
            raise self._lost(err) from err

    # ---------------------------------------------------------------- rendezvous-ish
    def wait_all(self, prefix: str, names: Sequence[str], timeout: float, what: str,
                 stated: Optional[float] = None) -> None:
        """Block until ``prefix + name`` exists for every name, or raise ``TimeoutError``.

        ``stated`` is the timeout to quote in the error (the caller's own, when ``timeout``
        is what is left of it); None quotes ``timeout``.

        Raises:
            TimeoutError: naming the names whose key never appeared and the wait.
            PeerLostError: the store itself is gone.
        """
        keys = [prefix + name for name in names]
        try:
            if threading.current_thread() is threading.main_thread():
                forked.check("a store request")
                self._main_waits.wait(keys, timeout)
            else:
                self._waiter().wait(keys, datetime.timedelta(seconds=max(timeout, 0.001)))
            return
        except dist.DistStoreError:
            pass
        except (dist.DistNetworkError, ConnectionError) as err:
            raise self._lost(err) from err
        absent = self.absent(prefix, names)
        if not absent:  # everyone arrived just as the wait expired
            return
        raise TimeoutError(
            f"{what}: {', '.join(repr(n) for n in absent)} did not arrive within "
            f"{timeout if stated is None else stated:g} s"
        )

    def absent(self, prefix: str, names: Iterable[str]) -> List[str]:
        store = self._waiter()
        try:
            return [n for n in names if not store.check([prefix + n])]
        except (dist.DistNetworkError, ConnectionError) as err:
            raise self._lost(err) from err

    def present(self, keys: Sequence[str]) -> bool:
        """Whether every key exists: one request, on the main connection (a per-thread
        clone costs 250 ms of GIL in torch, too much for one look)."""
        store = self._main()
        try:
            return bool(store.check(list(keys)))
        except (dist.DistNetworkError, ConnectionError) as err:
            raise self._lost_main(err) from err

    def read(self, keys: Sequence[str]) -> List[str]:
        """Values of ``keys``, which exist (see :meth:`present`), in one request.

        Raises:
            torch.distributed.DistStoreError: a key was absent for the store's timeout.
        """
        store = self._main()
        try:
            return [v.decode() for v in multi_get(store, keys)]
        except (dist.DistNetworkError, ConnectionError) as err:
            raise self._lost_main(err) from err

    def values(self, prefix: str, names: Sequence[str]) -> List[str]:
        try:
            return [v.decode() for v in multi_get(self._waiter(), [prefix + n for n in names])]
        except (dist.DistNetworkError, ConnectionError) as err:
            raise self._lost(err) from err

    def delete(self, keys: Iterable[str]) -> None:
        """Best-effort removal of bookkeeping keys (the store may be gone at shutdown)."""
        store = self._waiter()
        for key in keys:
            try:
                store.delete_key(key)
            except (RuntimeError, ConnectionError):
                return
