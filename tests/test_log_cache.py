"""The log cache: the members of one process read and decode each log position once.

Real TCPStore servers; the readers are the project's EventLog. A proxy around each
reader's client counts its requests (the store and its answers are real).
"""

from __future__ import annotations

import datetime
import gc
import threading
from typing import List, Sequence, Tuple

import torch.distributed as dist

from machinlike.distributed._membership import log_cache as _log_cache
from machinlike.distributed._membership.event_log import EventLog
from machinlike.distributed._membership.log_cache import LogCache
from machinlike.distributed._store import Keys, LogEntry, MemberRecord, Registry, server_of


def _server() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)


def _client(server: dist.TCPStore) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=30))


class _Counting(dist.Store):
    """A client's requests, counted by kind."""

    def __init__(self, inner: dist.TCPStore) -> None:
        super().__init__()
        self.inner = inner
        self.reads = 0  # check and multi_get: reads of log positions
        self.requests = 0

    def add(self, key, value):
        self.requests += 1
        return self.inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self.requests += 1
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        self.requests += 1
        self.reads += 1
        return self.inner.check(keys)

    def multi_get(self, keys):
        self.requests += 1
        self.reads += 1
        return self.inner.multi_get(keys)

    def set(self, key, value):
        self.requests += 1
        self.inner.set(key, value)

    def delete_key(self, key):
        self.requests += 1
        return self.inner.delete_key(key)


class _Reader:
    def __init__(self, store: dist.Store, keys: Keys, server: object) -> None:
        self.got: List[Tuple[int, str, str]] = []
        self.log = EventLog(Registry(store, "the test's store"), keys, self._deliver, server=server)

    def _deliver(self, run: Sequence[Tuple[int, LogEntry]]) -> None:
        self.got += [(seq, entry.kind, entry.record.member) for seq, entry in run]


def _rec(member: str) -> MemberRecord:
    return MemberRecord(member, 1, f"{member}_1", 0, "host:1:2")


def test_the_members_of_one_process_read_each_position_once():
    server, keys = _server(), Keys.elastic_world("c1")
    poster = _Reader(_client(server), keys, None)
    for i in range(40):
        poster.log.post("join", _rec(f"a{i}"))
    stores = [_Counting(_client(server)) for _ in range(4)]
    readers = [_Reader(s, keys, server_of(server)) for s in stores]
    readers[0].log.catch_up()
    first = stores[0].reads
    assert first >= 1
    for r in readers[1:]:
        r.log.catch_up()
    # The others delivered the same, in order, without reading one position.
    want = [(i, "join", f"a{i}") for i in range(40)]
    assert all(r.got == want for r in readers), [len(r.got) for r in readers]
    assert [s.reads for s in stores[1:]] == [0, 0, 0]
    # New positions: the first to catch up reads them, the rest find them.
    for i in range(40, 50):
        poster.log.post("lost", _rec(f"a{i - 40}"))
    for r in readers[::-1]:
        r.log.catch_up()
    assert [s.reads for s in stores[:3]] == [first, 0, 0] and stores[3].reads >= 1
    assert all(r.got[40:] == [(i, "lost", f"a{i - 40}") for i in range(40, 50)] for r in readers)


def test_members_catching_up_at_the_same_moment_take_turns_and_read_each_position_once():
    # While a world fills, every member's tick finds positions nobody has read yet, at once:
    # one reads them, the others wait their turn and find them in the cache.
    server, keys = _server(), Keys.elastic_world("c4")
    poster = _Reader(_client(server), keys, None)
    stores = [_Counting(_client(server)) for _ in range(8)]
    readers = [_Reader(s, keys, server_of(server)) for s in stores]
    for r in readers:
        r.log.catch_up()  # (each started: its first catch-up reads the log's token)
    for round_ in range(3):
        for i in range(30):
            poster.log.post("join", _rec(f"r{round_}-{i}"))
        before = sum(s.reads for s in stores)
        start = threading.Barrier(len(readers))

        def catch_up(reader: _Reader) -> None:
            start.wait(10)
            reader.log.catch_up()

        threads = [threading.Thread(target=catch_up, args=(r,)) for r in readers]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        # One reader read them: a check and a multi_get (the others none).
        assert sum(s.reads for s in stores) - before <= 2, [s.reads for s in stores]
        assert all(r.got == readers[0].got for r in readers)
        assert len(readers[0].got) == 30 * (round_ + 1)


def test_a_new_store_at_the_same_address_is_never_served_from_the_old_ones_cache():
    # A store restarted at the same address begins a new log at position 0: told the same
    # server, its readers must still read its own entries (the log's token differs).
    keys = Keys.elastic_world("c2")
    old, new = _server(), _server()
    same = ("the same host", 4242)
    _Reader(_client(old), keys, None).log.post("join", _rec("old-member"))
    _Reader(_client(new), keys, None).log.post("join", _rec("new-member"))
    on_old = _Reader(_client(old), keys, same)
    on_old.log.catch_up()
    on_new = _Reader(_client(new), keys, same)
    on_new.log.catch_up()
    assert on_old.got == [(0, "join", "old-member")]
    assert on_new.got == [(0, "join", "new-member")]
    # The same store, asked again: one cache (one token), whatever the server is called.
    again = _Reader(_client(old), keys, same)
    again.log.catch_up()
    assert again.log._cache is on_old.log._cache


def test_a_cache_keeps_the_newest_positions_and_goes_with_its_last_reader():
    cache = LogCache(cap=8)
    lines = [LogEntry("join", _rec(f"m{i}")).encode() for i in range(30)]
    for lo in range(0, 30, 5):
        cache.put(lo, lines[lo:lo + 5])
    assert len(cache) == 8
    assert cache.run(0, 30) == [] and cache.run(21, 30) == []  # 21 is gone, 22 .. 29 kept
    assert [e.record.member for e in cache.run(22, 30) if e is not None] == [f"m{i}" for i in range(22, 30)]
    cache.put(3, lines[3:4])  # a reader far behind: not kept
    assert len(cache) == 8 and cache.run(3, 4) == []

    server, keys = _server(), Keys.elastic_world("c3")
    gc.collect()
    before = len(_log_cache._CACHES)
    readers = [_Reader(_client(server), keys, server_of(server)) for _ in range(3)]
    for r in readers:
        r.log.catch_up()
    assert len(_log_cache._CACHES) == before + 1  # one for the three
    del readers, r
    gc.collect()
    assert len(_log_cache._CACHES) == before
