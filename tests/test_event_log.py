"""The event log in segments: bounded keys, a new reader that starts from a snapshot, a
reader that fell far behind, and posters racing, all on a real TCPStore.

Before segments, the log was one key that every post appended to and every catch-up read
whole: after 100,000 joins a member read megabytes per event, and the key never shrank.
"""

from __future__ import annotations

import datetime
import threading
import time
from typing import List, Sequence, Tuple

import torch.distributed as dist

from machinlike.distributed._membership import log_state as _log_state
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

    def _deliver(self, run: Sequence[Tuple[int, LogEntry]]) -> None:
        self.got += [(seq, entry.kind, entry.record.member, entry.record.incarnation) for seq, entry in run]


def _rec(member: str, inc: int = 1) -> MemberRecord:
    return MemberRecord(member, inc, f"{member}_{inc}", 0, "host:1:2")


def _keys_in(store: dist.Store, keys: Keys, prefix: str, upto: int) -> int:
    return sum(1 for k in range(upto) if store.check([f"{keys.ns}{prefix}{k}"]))


def test_a_long_churn_keeps_few_keys_and_a_new_reader_sees_the_members_as_they_stand(monkeypatch):
    monkeypatch.setattr(_log_state, "GONE_KEPT", 16)  # snapshots keep the last 16 departed
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
    # Positions and snapshots behind the newest snapshot are deleted.
    assert _keys_in(store, keys, "m/e/", 402) <= (KEEP + 2) * SEG
    assert _keys_in(store, keys, "m/snap/", 60) <= KEEP + 1
    # A reader joining now reads a snapshot and a segment, not 402 events.
    new = _Reader(store, keys)
    new.log.catch_up()
    members = {(kind, m) for _, kind, m, _ in new.got}
    assert ("join", "learner") in members and ("join", "actor7") in members
    assert ("lost", "actor199") in members and ("lost", "actor150") not in members
    assert len(new.got) <= 2 + 2 * 16 + 2 * SEG  # the snapshot lags one range
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


class _Counting(dist.Store):
    """Forwards to a real TCPStore client, counting requests (the test reads the cost of
    a post off it; the store and its answers are real)."""

    def __init__(self, inner: dist.TCPStore) -> None:
        super().__init__()
        self.inner = inner
        self.requests = 0

    def _n(self) -> None:
        self.requests += 1

    def clone(self) -> "_Counting":
        return self  # the test's posters each have a client of their own

    def add(self, key, value):
        self._n()
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self._n()
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        self._n()
        return self.inner.check(keys)

    def multi_get(self, keys):
        self._n()
        return self.inner.multi_get(keys)

    def get(self, key):
        self._n()
        return self.inner.get(key)

    def set(self, key, value):
        self._n()
        self.inner.set(key, value)

    def delete_key(self, key):
        self._n()
        return self.inner.delete_key(key)


def test_many_posters_at_once_each_post_costs_a_constant_number_of_requests():
    # Before: posters compare-and-set one segment; racing, each retry re-read and rewrote
    # it, and 1,024 members joining at once never finished.
    store, keys = _store(), Keys.elastic_world("0")
    posters, each = 16, 25
    counting = [_Counting(dist.TCPStore("127.0.0.1", store.port, None, False, datetime.timedelta(seconds=30)))
                for _ in range(posters)]
    barrier = threading.Barrier(posters)

    def post(n: int) -> None:
        log = EventLog(Registry(counting[n], "the test's store"), keys, lambda run: None, segment=SEG)
        barrier.wait(30)
        for i in range(each):
            log.post("join", _rec(f"p{n}x{i}"))

    threads = [threading.Thread(target=post, args=(n,)) for n in range(posters)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    total = posters * each
    # Two requests a post (claim, write), plus the sealing of a range every SEG posts
    # (folding it, deleting an old one: SEG + 1, waiting for the sealer before), amortised:
    # about 5 a post here at SEG = 8, 2 at 256. The segment design took 22 here.
    assert sum(c.requests for c in counting) <= total * 8
    reader = _Reader(store, keys)
    reader.log.catch_up()
    assert sorted(g[2] for g in reader.got) == sorted(f"p{n}x{i}" for n in range(posters) for i in range(each))
    assert [g[0] for g in reader.got] == list(range(total))


def test_a_poster_killed_between_claim_and_write_leaves_a_skip_every_reader_agrees_on():
    store, keys = _store(), Keys.elastic_world("0")
    a, b = _Reader(store, keys), _Reader(store, keys)
    for r in (a, b):
        r.log._hole_wait = 0.3
    a.log.post("join", _rec("first"))
    # What a SIGKILL between the poster's two requests leaves: a claimed, empty position.
    dead = store.add(keys.log_count(), 1) - 1
    a.log.post("join", _rec("after"))
    a.log.catch_up()
    assert [g[2] for g in a.got] == ["first"]  # waits behind the hole, for now
    deadline = time.monotonic() + 5
    while len(a.got) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
        a.log.catch_up()
    assert [(g[0], g[2]) for g in a.got] == [(0, "first"), (2, "after")]
    assert a.log.skipped == 1
    # The dead poster's write, had it come late, loses to the skip (first writer wins).
    late = LogEntry("join", _rec("ghost")).encode()
    assert store.compare_set(keys.log_entry(dead), "", late).decode() != late
    b.log.catch_up()  # another reader: the same events at the same positions
    assert [(g[0], g[2]) for g in b.got] == [(0, "first"), (2, "after")]
    assert b.log.skipped == 0


def test_a_hole_in_a_full_range_is_skipped_by_its_sealer_and_new_readers_start_past_it():
    store, keys = _store(), Keys.elastic_world("0")
    writer = _Reader(store, keys)
    writer.log._hole_wait = 0.2
    store.add(keys.log_count(), 1)  # position 0: claimed by a poster that died
    began = time.monotonic()
    for i in range(SEG * 3):  # position 3 * SEG opens range 3: ranges 0 and 1 are sealed
        writer.log.post("join", _rec(f"a{i}"))
    assert time.monotonic() - began < 5  # the sealer waited once, bounded
    assert int(store.get(keys.log_head())) == 2
    new = _Reader(store, keys)
    new.log.catch_up()
    assert {g[2] for g in new.got} == {f"a{i}" for i in range(SEG * 3)}
    seqs = [g[0] for g in new.got]
    assert seqs == sorted(seqs) and 0 not in seqs
    counts = read_history(lambda key: store.get(key).decode() if store.check([key]) else None, keys).counts
    assert counts.events == SEG * 3


def test_a_catch_up_within_a_bound_waits_for_another_threads_read_then_reads_what_it_missed():
    """CI of stop 113: wait_paired found a restarted member's value and caught up, while the
    liveness tick was reading the log (it had read the counter before that member's join).
    That catch-up returned at once, the view kept the dead incarnation, the call went to it."""
    store, keys = _store(), Keys.elastic_world("0")
    inside, go, told_inside = threading.Event(), threading.Event(), []

    class _Held(_Reader):
        def _deliver(self, run):
            super()._deliver(run)
            if not inside.is_set():
                inside.set()
                started = time.monotonic()
                self.log.catch_up(within=5.0)  # the thread delivering: its own lock, no wait
                told_inside.append(time.monotonic() - started)
                go.wait(30)

    reader = _Held(store, keys)
    reader.log.post("join", _rec("p"))
    tick = threading.Thread(target=reader.log.catch_up, daemon=True)
    tick.start()  # the tick: it read one position, and delivers it
    assert inside.wait(30)
    reader.log.post("join", _rec("p", 2))  # posted after the tick read the counter
    reader.log.catch_up(wait=False)  # a tick's way: it does not wait for the other
    assert [g[3] for g in reader.got] == [1]
    began = time.monotonic()
    threading.Timer(0.2, go.set).start()
    reader.log.catch_up(within=10.0)
    assert [g[3] for g in reader.got] == [1, 2] and 0.15 <= time.monotonic() - began < 5
    assert told_inside and told_inside[0] < 1.0
    tick.join(10)
    assert not tick.is_alive()
    assert reader.log._holder is None
