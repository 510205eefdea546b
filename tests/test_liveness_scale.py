"""Liveness cost stays flat as the world grows, and detection keeps its bound (issue 37).

CI-sized ``benchmarks/liveness_scale.py``: 32 and then 128 members of the project's own
membership (Membership, Roster, EventLog, Monitor with its liveness thread) on one real
TCPStore, as threads of this process. A counting store around their clients counts the
requests and keys each member sends per tick: with the ring watch they must not grow
with N (the design before read every heartbeat: N - 1 keys per member per tick). Then a
silent member (its thread stops, like a remote host cut off) and a SIGKILLed same-host
member must be named lost to every survivor within their bounds, and nobody else.

Members share a few store connections; a clone (each member's ring watch's, and the
departure bell's, which waits on it, while a store client serialises its requests) is a
connection of its own, as torch's is, made beforehand many at a time.
"""

from __future__ import annotations

import concurrent.futures
import datetime
import random
import re
import subprocess
import sys
import time
from typing import Dict, List, Tuple

import pytest
import torch.distributed as dist

from machinlike.distributed._membership import endpoint as _endpoint
from machinlike.distributed._store import ExitRecord, Keys
from machinlike.distributed._membership import process_identity
from machinlike.distributed._membership import Membership
from machinlike.distributed._membership.processes import tick_of
from machinlike.distributed._membership.watch import WATCH_ENV

LIVENESS = 2.0
TICK = 0.25  # tick_of(2.0)
CLIENTS = 8


def _connect(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30))


def _spares(port: int, n: int) -> List[dist.TCPStore]:
    """``n`` new connections, made 16 at a time (see the module doc)."""
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        return list(pool.map(lambda _: _connect(port), range(n)))


class _Counting(dist.Store):
    """Counts requests and keys, then forwards them to one of the shared clients; a clone
    is a connection of its own, as torch's is (from ``spares``)."""

    def __init__(self, inner: dist.TCPStore, counts: List[int], spares: List[dist.TCPStore]) -> None:
        super().__init__()
        self._inner, self._counts, self._spares = inner, counts, spares

    def _note(self, keys: int) -> None:
        self._counts[0] += 1  # (a race may lose a count now and then: fine for a ratio)
        self._counts[1] += keys

    # The server's address: the members of one world here share a departure bell.
    @property
    def host(self) -> str:
        return self._inner.host

    @property
    def port(self) -> int:
        return self._inner.port

    def clone(self) -> "_Counting":
        own = self._spares.pop() if self._spares else _connect(self._inner.port)
        return _Counting(own, self._counts, self._spares)

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        pass  # shared clients keep their timeout

    def set(self, key, value):
        self._note(1)
        return self._inner.set(key, value)

    def get(self, key):
        self._note(1)
        return self._inner.get(key)

    def add(self, key, value):
        self._note(1)
        return self._inner.add(key, value)

    def compare_set(self, key, expected, desired):
        self._note(1)
        return self._inner.compare_set(key, expected, desired)

    def append(self, key, value):
        self._note(1)
        return self._inner.append(key, value)

    def check(self, keys):
        self._note(len(keys))
        return self._inner.check(keys)

    def multi_get(self, keys):
        self._note(len(keys))
        return self._inner.multi_get(keys)

    def delete_key(self, key):
        self._note(1)
        return self._inner.delete_key(key)

    def wait(self, keys, timeout=None):
        self._note(len(keys))
        return self._inner.wait(keys) if timeout is None else self._inner.wait(keys, timeout)


class _World:
    """``n`` members in namespace ``ns``; who saw whom lost, and when."""

    def __init__(self, pool: List[dist.TCPStore], identity: Dict[str, str], ns: str, n: int, here: int,
                 liveness: float = LIVENESS, extra: int = 0) -> None:
        self.counts = [0, 0]
        self.tick = tick_of(liveness)
        self.lost: Dict[Tuple[str, str], float] = {}
        self.members: Dict[str, Membership] = {}
        self.children: Dict[str, subprocess.Popen] = {}
        self._pool, self._identity, self._liveness = pool, identity, liveness
        self._keys = Keys.elastic_world(ns)
        self._space = process_identity().rpartition("/")[0]
        # Each member's ring watch clones one, the bell one; ``extra`` members join later.
        self._spares = _spares(pool[0].port, n + extra + 2)
        for i in range(n):
            self.add(f"m{i:04d}" if i >= here else f"here{i}", i, here=i < here)

    def add(self, name: str, i: int, here: bool = False) -> None:
        """Member ``name`` enters and announces itself (``here``: with a real process of this host)."""
        if here:  # a real process on this host: its death shows in /proc
            child = subprocess.Popen(["sleep", "1000"])
            self.children[name] = child
            self._identity["now"] = f"{self._space}/{child.pid}"
        else:  # another host as far as /proc can tell: only its heartbeat speaks
            self._identity["now"] = f"elsewhere/1:1/{i}"
        store = _Counting(self._pool[i % len(self._pool)], self.counts, self._spares)
        m = Membership(store, self._keys, "the test's store", name, self._liveness, elastic=False)
        m.subscribe(lambda e, me=name: e.kind == "lost" and self.lost.setdefault((me, e.member), time.time()))
        m.enter(None, time.monotonic() + 30)
        m.announce()
        self.members[name] = m

    def wait_joined(self, timeout: float) -> float:
        n = len(self.members)
        start = time.monotonic()
        while any(len(m.members()) < n for m in self.members.values()):
            assert time.monotonic() - start < timeout, "the members did not all see each other"
            time.sleep(0.05)
        return time.monotonic() - start

    def per_member_tick(self, seconds: float) -> Tuple[float, float]:
        before = list(self.counts)
        time.sleep(seconds)
        ticks = len(self.members) * seconds / self.tick
        return (self.counts[0] - before[0]) / ticks, (self.counts[1] - before[1]) / ticks

    def kill(self, name: str) -> float:
        m = self.members.pop(name)
        if name in self.children:
            self.children[name].kill()
        m._closing.set()  # its liveness thread stops without a word
        return time.time()

    def named_by_all(self, victim: str, timeout: float) -> List[float]:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            seen = [t for (who, whom), t in list(self.lost.items()) if whom == victim and who in self.members]
            if len(seen) == len(self.members):
                return seen
            time.sleep(0.02)
        raise AssertionError(f"{victim} was named lost by {len(seen)} of {len(self.members)} survivors")

    def close(self) -> None:
        for m in self.members.values():
            m._closing.set()
        for m in self.members.values():
            m.monitor.join(2.0)
        for m in self.members.values():
            m.bell.stop(2.0)  # (the last to leave the world's bell thread here rings: it ends)
        for child in self.children.values():
            child.kill()
            child.wait(5)


def _hold_the_gil(seconds: float) -> None:
    """Stop every other thread of this process for ``seconds`` (as a stopped process)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(10.0)
    try:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:  # no I/O, no sleep: the GIL stays here
            pass
    finally:
        sys.setswitchinterval(before)


@pytest.fixture
def world_factory(monkeypatch):
    monkeypatch.setenv(WATCH_ENV, "ring")
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    pool = [dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=30))
            for _ in range(CLIENTS)]
    made: List[_World] = []
    identity: Dict[str, str] = {}  # the identity the member entering now gets
    monkeypatch.setattr(_endpoint, "process_identity", lambda: identity["now"])

    def make(ns: str, n: int, here: int = 0, liveness: float = LIVENESS, extra: int = 0) -> _World:
        made.append(_World(pool, identity, ns, n, here, liveness, extra))
        return made[-1]

    yield make
    for w in made:
        w.close()


def test_the_cost_per_member_does_not_grow_with_the_world(world_factory):
    figures = {}
    for n in (32, 128):
        w = world_factory(f"s{n}", n)
        w.wait_joined(30)
        time.sleep(2 * TICK)  # every ring is built
        figures[n] = w.per_member_tick(3.0)
        assert not w.lost, f"a live member was declared lost: {sorted(w.lost)[:5]}"
        w.close()
    (req32, keys32), (req128, keys128) = figures[32], figures[128]
    # One heartbeat (1 key) and one multi_get (the log counter and 3 successors) per tick.
    assert req128 <= 2.2 and keys128 <= 5.5, figures
    assert req128 <= 1.25 * req32 and keys128 <= 1.25 * keys32, figures


def test_a_silent_and_a_killed_member_are_named_to_all_within_their_bounds(world_factory):
    w = world_factory("d", 64, here=2)
    w.wait_joined(30)
    time.sleep(2 * TICK)
    killed = w.kill("m0030")
    remote = max(w.named_by_all("m0030", 3 * LIVENESS)) - killed
    killed = w.kill("here1")
    local = max(w.named_by_all("here1", 3 * LIVENESS)) - killed
    false = {whom for (_, whom) in w.lost} - {"m0030", "here1"}
    assert not false, f"live members declared lost: {false}"
    # Its declarer recorded how it knew (for the status view): silence there, the process here.
    survivor = next(iter(w.members.values()))
    causes = {name: ExitRecord.decode(survivor.registry.get_or_empty(survivor.keys.exit_cause(name)))
              for name in ("m0030", "here1")}
    assert causes["here1"] is not None and causes["here1"][::2] == (1, "watcher") and \
        causes["here1"].cause == "process gone", causes
    assert causes["m0030"] is not None and causes["m0030"][::2] == (1, "watcher") and \
        re.fullmatch(r"heartbeat silent for \d+\.\d s", causes["m0030"].cause), causes
    # Bounds with room for a loaded CI machine: the benchmark measures the p99.
    assert remote < LIVENESS + 0.5, remote
    # Same host: the pidfd wakes the watcher at once, and its ring wakes every other
    # member's bell thread, which reads the log then (20 ms here when quiet; before the
    # bell they read it at their next tick, up to 0.25 s later).
    assert local < 0.5, local


def test_a_process_starved_for_half_of_liveness_declares_nobody(world_factory):
    # Every member's thread stops for liveness / 2 (this process holds the GIL): the
    # heartbeats stop, and so do the watchers' looks; when they run again nobody may be
    # declared lost (a watcher's late look restarts its timers).
    w = world_factory("p", 16)
    w.wait_joined(30)
    time.sleep(4 * TICK)
    _hold_the_gil(LIVENESS / 2)
    time.sleep(3 * LIVENESS)
    assert not w.lost, f"live members declared lost after a {LIVENESS / 2:g} s pause: {sorted(w.lost)[:5]}"


def test_where_the_silence_spans_8_ticks_a_member_beats_every_other_tick(world_factory):
    # liveness 6: ticks of 0.5 s, a silence bound of 4.5 s (9 ticks). A member beats every
    # other tick (1.5 requests a tick, not 2), stays live through a pause of half its
    # liveness (its first tick after the pause beats at once), and a silent member is still
    # named within the bound.
    liveness = 6.0
    w = world_factory("b", 24, liveness=liveness)
    w.wait_joined(30)
    time.sleep(3 * tick_of(liveness))
    beats = {name: m.registry.get_or_empty(m.keys.heartbeat(name)) for name, m in w.members.items()}
    requests, _ = w.per_member_tick(3.0)
    moved = [int(m.registry.get_or_empty(m.keys.heartbeat(name))) - int(beats[name]) for name, m in w.members.items()]
    # 0.5 heartbeat and 1 multi_get a tick (2 before: a beat every tick); fewer when a
    # loaded machine makes ticks late, so only a loose floor.
    assert 0.8 <= requests <= 1.75, requests
    mean = sum(moved) / len(moved)
    assert 1.5 <= mean <= 4.5, moved  # 6 ticks in 3 s (and the reads' time): about 3 beats each
    _hold_the_gil(liveness / 2)
    killed = w.kill("m0011")
    named = max(w.named_by_all("m0011", 3 * liveness)) - killed
    time.sleep(4 * tick_of(liveness))
    false = {whom for (_, whom) in w.lost} - {"m0011"}
    assert not false, f"live members declared lost after a {liveness / 2:g} s pause: {sorted(false)[:5]}"
    assert named < liveness + 0.5, named


def test_ten_joins_and_ten_deaths_a_second_are_all_named_and_nobody_else(world_factory):
    # CI-sized churn of benchmarks/liveness_scale.py --churn: for 3 s, each 0.1 s a random
    # member dies silently and a new one joins. Every death must be named by every member
    # present at it that lives on, within its bound, and no live member named lost.
    rate, deaths = 10.0, 30
    w = world_factory("c", 48, extra=deaths)
    w.wait_joined(30)
    time.sleep(2 * TICK)
    rng = random.Random(5)
    victims = rng.sample(sorted(w.members), deaths)
    present: Dict[str, set] = {}
    killed_at: Dict[str, float] = {}
    start = time.monotonic()
    for i, victim in enumerate(victims):
        time.sleep(max(0.0, start + i / rate - time.monotonic()))
        present[victim] = set(w.members) - {victim}
        killed_at[victim] = w.kill(victim)
        w.add(f"c{i:04d}", 1000 + i)
    took = time.monotonic() - start
    end = time.monotonic() + 3 * LIVENESS + 2.0  # after the last death: its bound, and room
    while time.monotonic() < end:
        owed = {(o, v) for v, there in present.items() for o in there & set(w.members)}
        if owed <= set(w.lost):
            break
        time.sleep(0.05)
    missing = owed - set(w.lost)
    assert not missing, f"{len(missing)} (survivor, death) pairs never named, e.g. {sorted(missing)[:5]}"
    slowest = max(w.lost[pair] - killed_at[pair[1]] for pair in owed)
    false = {whom for (_, whom) in w.lost} - set(victims)
    assert not false, f"live members declared lost under churn: {sorted(false)[:5]}"
    # A fifth of this small world dies each second, so a death's watchers are often dead
    # too: 4-5 s here at the slowest (the ring looks past them); before, 146 pairs were
    # still unnamed 4 s after the last death.
    assert slowest < 3 * LIVENESS, slowest
    assert took < 3 * deaths / rate, f"the churn ran at {deaths / took:.1f} deaths a second"
    w.wait_joined(10)  # and every member sees every joiner


def test_a_block_of_neighbours_dying_together_is_named_within_about_one_bound(world_factory):
    # A host's members, named alike, die together, and with them some of their watchers
    # (the members before them in the ring: in name order all of them, until session 25
    # scattered names over the ring). The ring looks past the silent ones, so the last of
    # a block of 12 is timed within a fraction of the bound; before, each pair was timed
    # only once the pair before it was declared: 6 bounds in a row.
    w = world_factory("k", 40)
    w.wait_joined(30)
    time.sleep(2 * TICK)
    block = [f"m{i:04d}" for i in range(10, 22)]
    killed = {victim: w.kill(victim) for victim in block}
    slowest = max(max(w.named_by_all(victim, 8 * LIVENESS)) - killed[victim] for victim in block)
    false = {whom for (_, whom) in w.lost} - set(block)
    assert not false, f"live members declared lost: {sorted(false)[:5]}"
    assert slowest < 2 * LIVENESS + 1.0, slowest  # about 3 s here (10 s before)


def test_a_death_whose_watchers_all_die_after_it_is_timed_on_from_their_note(world_factory):
    # Every watcher of a death (the 3 members before it in the ring) dies after it, half
    # a bound into its silence, before declaring it. The next watcher, which comes to it
    # by looking past them, goes on from the silence they noted (m/hush/<name>): the death
    # is named about a bound after it, where timing it from scratch took that half bound
    # more (about 11 s here; session 25).
    liveness = 8.0  # ticks of 0.5 s, a silence bound of 6 s, a note every 1.5 s of silence
    w = world_factory("h", 24, liveness=liveness)
    w.wait_joined(30)
    time.sleep(2 * tick_of(liveness))
    victim = "m0012"
    # (the members whose ring successors it is: its watchers)
    watchers = [name for name, m in w.members.items() if victim in [r.member for r in m.roster.successors(name, 3)]]
    assert len(watchers) == 3, watchers
    registry = w.members["m0000"].registry
    note = w.members["m0000"].keys.silence(victim)
    killed = w.kill(victim)
    deadline = time.monotonic() + 6.0
    while True:  # (its nearest watcher writes it at 1.5 s and 3 s of silence; they declare after 6 s)
        parts = registry.get_or_empty(note).split()
        if len(parts) == 3 and float(parts[2]) >= 3.0:
            break
        assert time.monotonic() < deadline, f"no note of half the bound: {parts}"
        time.sleep(0.05)
    assert not any(whom == victim for (_, whom) in w.lost), "declared before its watchers died"
    for name in watchers:
        w.kill(name)
    named = max(w.named_by_all(victim, 3 * liveness)) - killed
    false = {whom for (_, whom) in w.lost} - {victim, *watchers}
    assert not false, f"live members declared lost: {sorted(false)[:5]}"
    assert sum(m.monitor.silences.resumed for m in w.members.values()) >= 1
    assert named < 10.0, named  # about 8.5 s (the bound, a look past, a tick); 11 s from scratch
