"""torch's dynamic agent group, as it lives in the store: its token, its worker list, the
addresses its agents publish.

The store layout of torch's dynamic join: the joiner takes the token
``RpcGroupManagementToken``, reads ``names/_ALL_WORKER_INFOS`` ("name-id," entries) and calls
every listed worker; ``addrs/<worker>`` is the address an agent listens on and
``names/<id>`` the worker that claimed torch id <id>. A worker that died stays listed (and
every later join fails calling it, leaving the token held), so the dead are pruned from
that list under the token, a token left by a dead joiner is released, and a pruned
worker's keys are deleted once it is off the list.

The group's store is remembered here once an agent joins it (``remember``): an agent that
meets a worker it does not know reads that worker's address from it.
"""

from __future__ import annotations

import datetime
import logging
import time
from typing import Callable, Iterable, List, Optional

import torch.distributed as dist

from .workers import worker_id

__all__ = ["remember", "group_store", "published_address", "prune_workers", "prune_locked", "release_token_of",
           "acquire_token", "release_token", "token_holder", "listed_workers", "forget_retired"]


log = logging.getLogger(__name__)


_TOKEN = "RpcGroupManagementToken"


_INFOS = "names/_ALL_WORKER_INFOS"


# The store of the dynamic group the agents joined (where workers' addresses are).
_group_store: List[dist.Store] = []


def remember(store: dist.Store) -> None:
    """Keep ``store`` as the dynamic group's (an agent of this process joins it)."""
    _group_store[:] = [store]


def group_store() -> Optional[dist.Store]:
    """The dynamic group's store, None before an agent of this process joined one."""
    return _group_store[0] if _group_store else None


def _forget(store: dist.Store, worker: str) -> None:
    """Delete what the dynamic group keeps in ``store`` for worker ``worker``, off the list
    now: the address its agent published and its membership-token keys (one set per worker
    that ever joined; left, they grow with every death), and ``names/<id>``, where torch's
    agent claimed its id (which can then be given again: see the membership's endpoint). Best effort: the
    store may be gone."""
    tid = worker_id(worker)
    names = [f"names/{tid}"] if tid is not None else []
    for key in (f"addrs/{worker}", f"Token_for_{worker}_join", f"Token_for_{worker}_prune",
                f"Token_for_{worker}_leave", *names):
        try:
            store.delete_key(key)
        except (RuntimeError, ConnectionError) as err:
            log.debug("forgetting RPC worker %r: %s", worker, err)
            return


# Expected by a compare-and-set that only reads: no address equals it, and a store hands
# back the expected text for a missing key without setting it.
_READ_PROBE = "\x00read"


def published_address(store: dist.Store, worker: str) -> Optional[str]:
    """The listener address worker ``worker``'s agent published, e.g. ``"uv://10.0.0.2:41235"``;
    None when there is none (anymore).

    Read in one compare-and-set that changes nothing: a check then a get would wait the
    store's whole timeout for an address deleted in between (the monitor thread stalled
    5 s in benchmarks/soak.py when a worker was pruned just then).
    """
    held = store.compare_set(f"addrs/{worker}", _READ_PROBE, _READ_PROBE).decode()
    return None if held == _READ_PROBE else held


def forget_retired(store: dist.Store, worker: str) -> bool:
    """Delete the dynamic group's keys of this process's retired, shut-down worker
    ``worker`` (its address and token keys), unless it is still listed (torch reads the
    address of every listed worker while it builds an agent); whether they went."""
    if worker in listed_workers(store):
        return False
    _forget(store, worker)
    return True


def acquire_token(store: dist.Store, mine: str, deadline: float, holder_dead: Callable[[str], bool]) -> None:
    while True:
        held = store.compare_set(_TOKEN, "", mine).decode()
        if held == mine:
            return
        if holder_dead(held):
            release_token_of(store, held)
            continue
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"the RPC membership token stays held by {held!r}")
        try:
            store.wait([held], datetime.timedelta(seconds=min(left, 1.0)))
        except dist.DistStoreError:
            pass  # re-check whether the holder died meanwhile


def release_token(store: dist.Store, mine: str) -> None:
    store.compare_set(_TOKEN, mine, "")
    store.set(mine, "Done")  # wakes whoever waits on this token's key


def release_token_of(store: dist.Store, token: str) -> None:
    """Release the membership token if ``token`` (a dead holder's) still holds it."""
    if store.compare_set(_TOKEN, token, "").decode() == "":
        log.info("released the RPC membership token left by %r", token)
    store.set(token, "Done")


def token_holder(token: str) -> Optional[str]:
    """The worker name inside a token value (``Token_for_<name>_join|leave``), if any."""
    prefix = "Token_for_"
    for suffix in ("_join", "_leave", "_prune"):
        if token.startswith(prefix) and token.endswith(suffix):
            return token[len(prefix):-len(suffix)]
    return None


def prune_workers(store: dist.Store, me: str, gone: Iterable[str], deadline: float,
                  holder_dead: Callable[[str], bool], freed: Optional[Callable[[str], bool]] = None) -> List[str]:
    """Remove workers from the dynamic group's list in ``store``, under torch's token.

    Args:
        store: The agent group's store (the one given to :func:`start_dynamic`).
        me: This process's worker name (names the token).
        gone: Worker names to remove.
        deadline: ``time.monotonic()`` deadline for taking the token.
        holder_dead: Whether the token value's holder is dead (then it is released).
        freed: As for :func:`start_dynamic`.

    Returns:
        The names that were listed and are now removed.

    Raises:
        TimeoutError: the token stayed held by a live joiner until ``deadline``.
    """
    mine = f"Token_for_{me}_prune"
    acquire_token(store, mine, deadline, holder_dead)
    try:
        return prune_locked(store, gone, freed)
    finally:
        release_token(store, mine)


def prune_locked(store: dist.Store, gone: Iterable[str], freed: Optional[Callable[[str], bool]] = None) -> List[str]:
    gone = set(gone)
    if not store.check([_INFOS]):
        return []
    entries = [e for e in store.get(_INFOS).decode().split(",") if e]
    keep = [e for e in entries if e.rpartition("-")[0] not in gone]
    if len(keep) != len(entries):
        store.set(_INFOS, "".join(f"{e}," for e in keep))
    removed = [e.rpartition("-")[0] for e in entries if e not in keep]
    for worker in removed:
        # Only once it is off the list, and under the token: torch's agent reads the
        # address of every listed worker while it is built, with a store get that waits
        # for a missing key (its whole timeout, holding the GIL: the process stood still).
        if freed is not None and freed(worker):
            _forget(store, worker)
    return removed


def listed_workers(store: dist.Store) -> List[str]:
    """Worker names the dynamic group's list holds (read without the token)."""
    if not store.check([_INFOS]):
        return []
    return [e.rpartition("-")[0] for e in store.get(_INFOS).decode().split(",") if e]
