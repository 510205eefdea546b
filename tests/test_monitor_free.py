"""Monitor.free with a stale record: a lost member that renewed its RPC agent after the
declarer last heard of it (recycling does that after every few dead peers).

The declarer's record names the member's old worker; the store's claim ``m/live/<name>``
and the member's keys name the new one. Before the fix, the claim stayed held for good
(cleared by the old text only) and the keys claimed under the new worker were never
freed, so the member's next incarnation spun in ``enter`` until its deadline: the
servers' churn test with recycling on failed about one run in three.
"""

from __future__ import annotations

import datetime
import threading
import time
from types import SimpleNamespace
from typing import Callable

import torch.distributed as dist

from machinlike.distributed._membership.claims import Claims
from machinlike.distributed._membership.departures import Departures
from machinlike.distributed._store.keys import Keys, MemberRecord, OwnedKey
from machinlike.distributed._membership.monitor import Monitor
from machinlike.distributed._store.registry import Registry


def _world():
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    registry = Registry(store, "the test's store")
    keys = Keys.elastic_world("0")
    claims = Claims(registry, keys, SimpleNamespace(worker="declarer_0"))  # type: ignore[arg-type]
    monitor = Monitor(registry, keys, None, None, claims, None, Departures(registry, keys),  # type: ignore[arg-type]
                      None, False, threading.Event())
    return store, registry, keys, monitor


def test_a_stale_record_of_a_renewed_member_frees_its_claim_and_its_moved_keys():
    store, registry, keys, monitor = _world()
    try:
        renewed = MemberRecord("c1", 1, "c1_7", 3, "host:123:456")
        registry.set(keys.live("c1"), renewed.encode())
        assert registry.claim("svc/c1", "s:c1_7") is None
        registry.append(keys.owned("c1_7"), OwnedKey("svc/c1", "s:c1_7").encode())

        stale = MemberRecord("c1", 1, "c1_1", 3, "host:123:456")  # before the renewal
        monitor.free(stale, time.monotonic() + 5)

        assert registry.get_or_empty(keys.live("c1")) == ""  # the next incarnation can claim
        assert registry.owner("svc/c1") is None  # the key claimed under the new worker is free
        assert registry.get_or_empty(keys.gone("c1", 1)) == "1"
        assert registry.claim(keys.live("c1"), MemberRecord("c1", 2, "c1_8", 3, "x").encode()) is None
    finally:
        registry.close()
        del store


def test_free_never_clears_the_claim_of_a_newer_incarnation():
    store, registry, keys, monitor = _world()
    try:
        newer = MemberRecord("c1", 2, "c1_9", 3, "host:1:2")
        registry.set(keys.live("c1"), newer.encode())
        monitor.free(MemberRecord("c1", 1, "c1_1", 3, "host:1:1"), time.monotonic() + 5)
        assert registry.get_or_empty(keys.live("c1")) == newer.encode()
        assert registry.get_or_empty(keys.gone("c1", 1)) == "1"
    finally:
        registry.close()
        del store


def test_the_first_workers_entry_outlives_a_renewal_and_goes_when_the_incarnation_is_freed():
    # A gradient server tags pushes by the incarnation's first worker and asks the store
    # about it (server/_churn), so its entry must stay while the incarnation lives; the
    # renewal notes it under the new worker, so that freeing the incarnation deletes it.
    store, registry, keys, monitor = _world()
    try:
        first = MemberRecord("c1", 1, "c1_1", 3, "host:1:1")
        registry.set(keys.worker("c1_1"), "c1")
        registry.set(keys.live("c1"), first.encode())
        forgotten = []
        endpoint = SimpleNamespace(worker="c1_1", first_worker="c1_1", name="c1", me=first,
                                   forget_group_keys=forgotten.append)
        claims = Claims(registry, keys, endpoint)  # type: ignore[arg-type]

        def renew_to(worker: str) -> Callable[[], MemberRecord]:
            def renew() -> MemberRecord:
                old = first.with_worker(endpoint.worker)
                endpoint.worker = worker
                registry.set(keys.worker(worker), "c1")
                registry.set(keys.live("c1"), first.with_worker(worker).encode())
                return old
            return renew

        claims.renewed(renew_to("c1_5"))
        assert registry.get_or_empty(keys.worker("c1_1")) == "c1"  # kept while it lives
        # c1_5 retires too and its agent is reaped (Endpoint.forget_retired deletes its
        # entry); c1_7 retires and the member dies before its agent is reaped.
        claims.renewed(renew_to("c1_7"))
        registry.delete([keys.worker("c1_5")])
        claims.renewed(renew_to("c1_9"))
        notes = registry.get_or_empty(keys.owned("c1_9"))
        assert keys.worker("c1_5") not in notes, "a reaped worker's note is dropped, not carried for good"
        released = claims.free("c1_9")
        assert released == [] and registry.get_or_empty(keys.worker("c1_1")) == ""
        assert not store.check([keys.worker("c1_1")]) and not store.check([keys.worker("c1_7")])
        # Their RPC group keys go too: the torch ids they claimed can be given again.
        assert sorted(forgotten) == ["c1_1", "c1_7"]
    finally:
        registry.close()
        del store
