"""Departures: a gone member's store records are deleted long after it left, so that a
world whose actors come back under new names keeps a bounded number of keys (real
TCPStore; the end-to-end check is tests/test_soak.py, whose learner's store stays flat).
"""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from machinlike.distributed._membership.departures import Departures
from machinlike.distributed._store.keys import Keys
from machinlike.distributed._store.registry import Registry

BLOCK, LAG = 4, 2


def _world():
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    keys = Keys("mlk/0/e/")
    return store, Registry(store, "the test's store"), keys


def _leave_records(reg: Registry, keys: Keys, member: str, incarnation: int) -> list:
    """The keys a member that joined and was lost leaves: counter, emptied claim, heartbeat,
    silence note, servers' notes and exit cause, its marks, and an emptied service key it had claimed."""
    service = f"{keys.ns}rg/g/o/s/echo/{member}"
    reg.add(keys.incarnations(member), incarnation - int(reg.get_or_empty(keys.incarnations(member)) or 0))
    reg.set(keys.live(member), "")
    reg.add(keys.heartbeat(member), 5)
    reg.set(keys.silence(member), f"{incarnation} 5 1.500")  # a watcher saw it silent
    reg.set(keys.exit_cause(member), f"{incarnation}|0|watcher|heartbeat silent for 7.6 s")  # and said so
    reg.add(keys.lost(member, incarnation), 1)
    reg.add(keys.lost_posted(member, incarnation), 1)
    reg.set(keys.gone(member, incarnation), "1")
    reg.set(keys.server_notes(member), '{"inc":1,"t":0,"s":[]}')  # its servers' last numbers
    reg.set(service, "")
    return [service]


def test_records_of_members_gone_long_enough_are_deleted_and_the_key_count_levels_off():
    store, reg, keys = _world()
    departures = Departures(reg, keys, block=BLOCK, lag=LAG)
    counts = []
    for i in range(10 * BLOCK):
        released = _leave_records(reg, keys, f"actor-{i}", 1)
        departures.record(f"actor-{i}", 1, released)
        if i % BLOCK == BLOCK - 1:
            departures.settle(10)  # reaps run on a thread of their own
            counts.append(store.num_keys())
    # 9 keys per departure plus the blocks; reaped every BLOCK once LAG blocks stand.
    assert counts[-1] == counts[-2] == counts[-3], counts
    assert counts[-1] < 9 * BLOCK * (LAG + 2), counts
    # The first members are gone from the store; the last LAG blocks' are kept.
    for key in (keys.incarnations("actor-0"), keys.heartbeat("actor-0"), keys.silence("actor-0"),
                keys.server_notes("actor-0"), keys.exit_cause("actor-0"), keys.live("actor-0"), keys.lost("actor-0", 1),
                keys.gone("actor-0", 1)):
        assert not store.check([key]), key
    assert not store.check([f"{keys.ns}rg/g/o/s/echo/actor-0"])
    assert store.check([keys.incarnations(f"actor-{10 * BLOCK - 1}")])


def test_a_member_that_came_back_keeps_its_records_and_a_reclaimed_key_stays():
    store, reg, keys = _world()
    departures = Departures(reg, keys, block=BLOCK, lag=LAG)
    released = _leave_records(reg, keys, "learner", 1)
    departures.record("learner", 1, released)
    reg.set(released[0], "s:other_7")  # another member took the service over
    # "learner" comes back as incarnation 2 and is live when its old departure is reaped.
    reg.add(keys.incarnations("learner"), 1)
    reg.set(keys.live("learner"), "2|learner_9|0|host:1:2")
    for i in range(LAG * BLOCK + BLOCK):
        departures.record(f"actor-{i}", 1, _leave_records(reg, keys, f"actor-{i}", 1))
    departures.settle(10)
    assert not store.check([keys.incarnations("actor-0")])  # its block was reaped
    assert reg.get_or_empty(keys.incarnations("learner")) == "2"
    assert reg.get_or_empty(keys.live("learner")).startswith("2|")
    assert reg.get_or_empty(released[0]) == "s:other_7"


def test_a_returning_name_after_the_reap_starts_from_a_fresh_counter_and_clean_marks():
    store, reg, keys = _world()
    departures = Departures(reg, keys, block=BLOCK, lag=LAG)
    departures.record("actor-x", 3, _leave_records(reg, keys, "actor-x", 3))
    for i in range(LAG * BLOCK + BLOCK):
        departures.record(f"a-{i}", 1, _leave_records(reg, keys, f"a-{i}", 1))
    departures.settle(10)
    # A new incarnation's loss must be electable again: no mark of the old ones is left.
    assert reg.add(keys.incarnations("actor-x"), 1) == 1
    assert reg.add(keys.lost("actor-x", 1), 1) == 1
    assert not store.check([keys.lost("actor-x", 3), keys.lost_posted("actor-x", 3), keys.gone("actor-x", 2)])


def test_the_kept_departures_come_from_the_environment_and_are_checked(monkeypatch):
    store, reg, keys = _world()
    monkeypatch.setenv("MACHINLIKE_DEPARTURES_KEPT", "16")
    departures = Departures(reg, keys)
    for i in range(40):
        departures.record(f"a-{i}", 1, _leave_records(reg, keys, f"a-{i}", 1))
    departures.settle(10)
    assert not store.check([keys.incarnations("a-0")]) and store.check([keys.incarnations("a-39")])
    monkeypatch.setenv("MACHINLIKE_DEPARTURES_KEPT", "3")
    with pytest.raises(ValueError, match="at least 8"):
        Departures(reg, keys)
