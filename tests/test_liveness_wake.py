"""The liveness thread wakes when a watched process of this host exits, and nothing the
RPC agent group waits for in the store holds up its heartbeat (issue 37).

Real processes (``sleep``, SIGKILLed), the kernel's pidfds, a real TCPStore.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from machinlike.distributed._membership import Membership, process_identity
from machinlike.distributed._membership.pidwatch import PidWatch, WakingEvent
from machinlike.distributed._store import Keys, MemberRecord

needs_pidfd = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="no pidfd_open (Linux 5.3+)")


def _record(name: str, pid: int) -> MemberRecord:
    return MemberRecord(name, 1, name, 0, f"{process_identity().rpartition('/')[0]}/{pid}")


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@needs_pidfd
def test_a_sleep_ends_when_a_watched_process_here_is_killed():
    child = subprocess.Popen(["sleep", "100"])
    pids = PidWatch()
    closing = WakingEvent(pids)
    try:
        pids.watch([_record("a", child.pid), MemberRecord("b", 1, "b", 1, "elsewhere/1:1/7")])
        threading.Timer(0.2, child.kill).start()
        began = time.monotonic()
        assert pids.sleep(10.0, closing) is False
        assert time.monotonic() - began < 1.0
        assert pids.woken == 1
        # The fired pidfd is not polled again (it stays readable): the next sleep lasts.
        began = time.monotonic()
        pids.watch([_record("a", child.pid)])
        pids.sleep(0.3, closing)
        assert time.monotonic() - began >= 0.25
    finally:
        child.kill()
        child.wait(5)
        pids.close()


@needs_pidfd
def test_closing_ends_a_sleep_at_once_and_descriptors_come_back():
    before = _fds()
    children = [subprocess.Popen(["sleep", "100"]) for _ in range(3)]
    pids = PidWatch()
    closing = WakingEvent(pids)
    try:
        pids.watch([_record(f"m{i}", c.pid) for i, c in enumerate(children)])
        pids.watch([_record("m0", children[0].pid)])  # the others' pidfds are closed
        threading.Timer(0.2, closing.set).start()
        began = time.monotonic()
        assert pids.sleep(10.0, closing) is True
        assert time.monotonic() - began < 1.0
    finally:
        pids.close()
        for c in children:
            c.kill()
            c.wait(5)
    assert _fds() == before


def test_the_heartbeat_goes_on_while_the_agent_group_waits_in_the_store():
    # A join waits in the store for torch's membership token, a second at a time, for as
    # long as other members' joins hold it. On the world's connection those waits held up
    # the heartbeat (one request at a time per connection): the member went silent, or
    # missed the deaths posted meanwhile.
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    store = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=30))
    m = Membership(store, Keys.elastic_world("hb"), "the test's store", "a", 1.0, elastic=False)
    m.enter(None, time.monotonic() + 10)
    m.announce()
    beat = m.keys.heartbeat("a")
    agent_store = m.endpoint._rpc_store
    waiting = threading.Thread(target=lambda: _wait_quietly(agent_store, "never", 2.0), daemon=True)
    try:
        waiting.start()
        time.sleep(0.2)  # the agent group's wait is under way
        first = int(server.get(beat))
        time.sleep(1.0)  # 8 ticks of liveness=1
        assert waiting.is_alive()
        assert int(server.get(beat)) >= first + 4
    finally:
        waiting.join(5)
        m.close()


def _wait_quietly(store: dist.Store, key: str, seconds: float) -> None:
    try:
        store.wait([key], datetime.timedelta(seconds=seconds))
    except dist.DistStoreError:
        pass


def test_a_member_whose_first_catch_up_outlasts_the_silence_bound_is_not_declared_lost(monkeypatch):
    # A member's join is posted before it has read the log so far; its watchers time its
    # heartbeat from the moment they see the join. Here that first read takes 1.6 s (a
    # subscriber slow on each join), beyond the 0.625 s silence bound of liveness=1: the
    # member must beat meanwhile. Its identity names another host, so only its heartbeat
    # can tell its watcher it lives (not /proc).
    from machinlike.distributed._membership import endpoint as _endpoint

    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    keys = Keys.elastic_world("slowstart")

    def member(name: str) -> Membership:
        client = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=30))
        return Membership(client, keys, "the test's store", name, 1.0, elastic=False)

    watcher = member("a")
    losses = []
    watcher.subscribe(lambda e: e.kind == "lost" and losses.append(e.member))
    watcher.enter(None, time.monotonic() + 10)
    watcher.announce()
    slow = member("b")
    slow.subscribe(lambda e: e.kind == "join" and time.sleep(0.8))
    monkeypatch.setattr(_endpoint, "process_identity", lambda: "elsewhere/1:1/4242")
    slow.enter(None, time.monotonic() + 10)
    try:
        began = time.monotonic()
        slow.announce()  # returns once its first catch-up is done (two joins: 1.6 s)
        assert time.monotonic() - began >= 1.5
        assert slow.members() == ["a", "b"]
        time.sleep(1.0)  # the watcher ticks on: its heartbeat moves
        assert watcher.members() == ["a", "b"] and losses == []
        assert slow.roster.cut_off is None
    finally:
        slow.close()
        watcher.close()


_EXITS_WITHOUT_CLOSING = """
import datetime, sys, time
import torch.distributed as dist
from machinlike.distributed._membership import Membership
from machinlike.distributed._store import Keys
port, ns = int(sys.argv[1]), sys.argv[2]
members = []
for i in range(64):
    client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=30))
    m = Membership(client, Keys.elastic_world(ns), "the test's store", f"m{i}", 0.5, elastic=False)
    m.enter(None, time.monotonic() + 30)
    m.announce()
    members.append(m)
time.sleep(0.5)
sys.exit(3)  # without closing them: 64 liveness threads tick every 62 ms
"""


def test_a_process_that_exits_without_closing_its_members_exits_with_its_own_code():
    # Before the exit hook, a liveness thread inside a store request at finalization made
    # torch abort the process ("terminate called without an active exception"): 6 runs in 6.
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    for run in range(2):
        done = subprocess.run([sys.executable, "-c", _EXITS_WITHOUT_CLOSING, str(server.port), f"exit{run}"],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 3, (done.returncode, done.stderr[-2000:])
        assert "terminate called" not in done.stderr


def test_a_member_whose_first_catch_up_fails_stops_beating():
    # The liveness thread starts before the first catch-up; if that fails, the member never
    # started, and its thread must not go on beating as if it were in the world.
    server = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=30))
    m = Membership(client, Keys.elastic_world("failstart"), "the test's store", "a", 1.0, elastic=False)
    m.enter(None, time.monotonic() + 10)

    def broken(*args, **kwargs):
        raise RuntimeError("the log cannot be read")

    m.events.catch_up = broken  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="cannot be read"):
        m.monitor.start()
    m.monitor.join(5.0)
    assert m.monitor._thread is not None and not m.monitor._thread.is_alive()
