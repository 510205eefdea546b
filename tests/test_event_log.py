"""The event log in segments: bounded keys, a new reader that starts from a snapshot, a
reader that fell far behind, and posters racing, all on a real TCPStore.

Before segments, the log was one key that every post appended to and every catch-up read
whole: after 100,000 joins a member read megabytes per event, and the key never shrank.
"""

from __future__ import annotations

import datetime
import threading
from typing import List, Tuple

import torch.distributed as dist

from machinlike.distributed._membership import event_log as _event_log
from machinlike.distributed._membership.event_log import KEEP, EventLog, read_history
from machinlike.distributed._store.keys import Keys, LogEntry, MemberRecord
from machinlike.distributed._store.registry import Registry

SEG = 8


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)


class _Reader:
    """An EventLog with what it delivered."""

    def __init__(self, store: dist.Store, keys: Keys) -> None:
        self.got: List[Tuple[int, str, str, int]] = []
        self.log = EventLog(Registry(store, "the test's store"), keys, self._deliver, segment=SEG)

    def _deliver(self, entry: LogEntry, seq: int) -> None:
        self.got.append((seq, entry.kind, entry.record.member, entry.record.incarnation))


def _rec(member: str, inc: int = 1) -> MemberRecord:
    return MemberRecord(member, inc, f"{member}_{inc}", 0, "host:1:2")


def _keys_in(store: dist.Store, keys: Keys, prefix: str, upto: int) -> int:
    return sum(1 for k in range(upto) if store.check([f"{keys.ns}{prefix}{k}"]))


def test_a_long_churn_keeps_few_keys_and_a_new_reader_sees_the_members_as_they_stand(monkeypatch):
    monkeypatch.setattr(_event_log, "GONE_KEPT", 16)  # snapshots keep the last 16 departed
    store, keys = _store(), Keys.elastic_world("0")
    old = _Reader(store, keys)
    old.log.post("join", _rec("learner"))
    for i in range(200):  # 200 actors join and die: 400 events, 50 segments
        old.log.post("join", _rec(f"actor{i}"))
        old.log.post("lost", _rec(f"actor{i}"))
        if i % 7 == 0:
            old.log.catch_up()
    old.log.post("join", _rec("actor7", 2))
    old.log.catch_up()
    # Every event reached the old reader once, in order.
    assert [g[0] for g in old.got] == list(range(402))
    assert old.got[-1] == (401, "join", "actor7", 2)
    # Segments and snapshots behind the head are deleted.
    assert _keys_in(store, keys, "m/log/", 60) <= KEEP + 1
    assert _keys_in(store, keys, "m/snap/", 60) <= KEEP + 1
    # A reader joining now reads a snapshot and a segment, not 402 events.
    new = _Reader(store, keys)
    new.log.catch_up()
    members = {(kind, m) for _, kind, m, _ in new.got}
    assert ("join", "learner") in members and ("join", "actor7") in members
    assert ("lost", "actor199") in members and ("lost", "actor150") not in members
    assert len(new.got) <= 2 + 2 * 16 + SEG
    seqs = [g[0] for g in new.got]
    assert seqs == sorted(seqs) and seqs[-1] == 401
    # Counts survive the condensing.
    counts = read_history(lambda key: store.get(key).decode() if store.check([key]) else None, keys).counts
    assert (counts.events, counts.deaths, counts.rejoins, counts.leaves) == (402, 200, 1, 0)


def test_a_reader_that_fell_behind_its_deleted_segment_catches_up_from_a_snapshot():
    store, keys = _store(), Keys.elastic_world("0")
    writer, sleeper = _Reader(store, keys), _Reader(store, keys)
    writer.log.post("join", _rec("learner"))
    sleeper.log.catch_up()
    for i in range(SEG * (KEEP + 3)):
        writer.log.post("join", _rec(f"a{i}"))
    writer.log.post("lost", _rec("learner"))
    sleeper.log.catch_up()
    assert sleeper.got[0] == (0, "join", "learner", 1)
    assert sleeper.got[-1][1:3] == ("lost", "learner")
    seqs = [g[0] for g in sleeper.got]
    assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_posters_racing_lose_no_event():
    store, keys = _store(), Keys.elastic_world("0")
    clients = [dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=30))
               for _ in range(4)]

    def post(n: int) -> None:
        log = _Reader(clients[n], keys).log
        for i in range(40):
            log.post("join", _rec(f"p{n}x{i}"))

    threads = [threading.Thread(target=post, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    reader = _Reader(store, keys)
    old = _Reader(store, keys)
    reader.log.catch_up()
    history = read_history(lambda key: store.get(key).decode() if store.check([key]) else None, keys)
    assert history.counts.events == 160
    assert {e.record.member for _, e in history.entries} == {f"p{n}x{i}" for n in range(4) for i in range(40)}
    old.log.catch_up()
    assert len({g[2] for g in old.got}) == 160
