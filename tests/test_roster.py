"""Roster.moved_from: where a caller refused by a member's old RPC agent goes next.

The end-to-end case (a member whose listener closed renews its agent while a joiner
calls it) is tests/test_elastic.py::test_a_member_whose_rpc_listener_closed_renews_it;
these pin the decision itself, across a real second process for the dead-process case.
"""

import subprocess
import sys
import threading
import time

from machinlike.distributed._store.keys import MemberRecord
from machinlike.distributed._membership.processes import process_identity
from machinlike.distributed._transport.pipes import PipeLedger
from machinlike.distributed._membership.roster import Roster, ring_key


def _roster_with(identity: str) -> Roster:
    roster = Roster(PipeLedger(0))
    roster.apply("join", MemberRecord("host", 1, "host_0", 0, identity))
    return roster


def test_a_move_logged_later_is_waited_for():
    roster = _roster_with(process_identity())
    mover = threading.Timer(0.2, roster.apply, ("move", MemberRecord("host", 1, "host_3", 0, process_identity())))
    mover.start()
    start = time.monotonic()
    assert roster.moved_from("host_0", 5.0) == "host_3"
    assert time.monotonic() - start < 2.0
    assert roster.worker_gone("host_0") and not roster.worker_gone("host_3")
    mover.join()


def test_no_move_within_the_time_left_keeps_the_error():
    roster = _roster_with(process_identity())
    start = time.monotonic()
    assert roster.moved_from("host_0", 0.3) is None
    assert 0.25 < time.monotonic() - start < 2.0


def test_a_dead_process_here_is_not_waited_for():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)  # reaped: its pid names no live process
    identity = process_identity().rpartition("/")[0] + f"/{child.pid}"
    roster = _roster_with(identity)
    start = time.monotonic()
    assert roster.moved_from("host_0", 10.0) is None
    assert time.monotonic() - start < 1.0


def test_a_gone_member_or_a_static_world_is_not_waited_for():
    roster = _roster_with(process_identity())
    roster.apply("lost", MemberRecord("host", 1, "host_0", 0, process_identity()))
    assert roster.moved_from("host_0", 10.0) is None
    assert roster.moved_from("nobody_9", 10.0) is None
    static = Roster(PipeLedger(0))
    static.seed_static([MemberRecord("0", 0, "0", 0, process_identity())])
    start = time.monotonic()
    assert static.moved_from("0", 10.0) is None
    assert time.monotonic() - start < 1.0


def test_a_view_remembers_a_bounded_number_of_gone_workers_and_members(monkeypatch):
    from machinlike.distributed._membership import roster as _roster

    monkeypatch.setattr(_roster, "GONE_KEPT", 50)
    roster = _roster_with(process_identity())
    for i in range(400):  # 400 actors under their own names come and die; the host recycles
        roster.apply("join", MemberRecord(f"a{i}", 1, f"a{i}_{i + 10}", 1, "elsewhere:1:2"))
        roster.apply("lost", MemberRecord(f"a{i}", 1, f"a{i}_{i + 10}", 1, "elsewhere:1:2"))
        if i % 40 == 0:
            roster.apply("move", MemberRecord("host", 1, f"host_{1000 + i}", 0, process_identity()))
    assert len(roster._gone_workers) <= 50 and len(roster._gone) <= 50
    assert len(roster._by_worker) <= 50 + 1
    # The recent past is still known; the live member still routes.
    assert roster.worker_gone("a399_409") and roster.gone("a399") == "lost"
    assert roster.worker_of("host") == "host_1360" and roster.member_of("host_1360") == "host"
    assert len(roster._moved_to) <= 50
    # The index of each member's workers follows the table it indexes.
    assert sum(len(w) for w in roster._workers_of.values()) == len(roster._by_worker)
    assert all(roster._by_worker[w] == m for m, ws in roster._workers_of.items() for w in ws)


def test_a_loss_names_its_members_workers_old_and_new_and_no_other():
    roster = _roster_with(process_identity())
    roster.apply("join", MemberRecord("hostess", 1, "hostess_2", 1, "elsewhere:1:2"))
    roster.apply("move", MemberRecord("host", 1, "host_4", 0, process_identity()))
    assert roster.apply("lost", MemberRecord("host", 1, "host_4", 0, process_identity())) == ["host_0", "host_4"]
    assert roster.apply("lost", MemberRecord("hostess", 1, "hostess_2", 1, "elsewhere:1:2")) == ["hostess_2"]
    # A worker id that came round, under a name that maps to the same text ("a-b", "a_b").
    roster.apply("join", MemberRecord("a-b", 1, "a_b_5", 2, "elsewhere:1:2"))
    roster.apply("lost", MemberRecord("a-b", 1, "a_b_5", 2, "elsewhere:1:2"))
    roster.apply("join", MemberRecord("a_b", 1, "a_b_5", 3, "elsewhere:1:2"))
    assert roster.apply("lost", MemberRecord("a_b", 1, "a_b_5", 3, "elsewhere:1:2")) == ["a_b_5"]
    assert "a-b" not in roster._workers_of


def test_a_call_picked_before_a_move_goes_to_the_new_worker_and_a_gone_one_nowhere():
    # A caller (or an owner cache) that picked "host_0" just before the member renewed its
    # agent twice reaches the newest worker; once the member is lost, nothing does, and
    # its next incarnation (another process) is never a redirect target.
    roster = _roster_with(process_identity())
    assert roster.resolve("host_0") == "host_0"
    roster.apply("move", MemberRecord("host", 1, "host_4", 0, process_identity()))
    roster.apply("move", MemberRecord("host", 1, "host_7", 0, process_identity()))
    assert roster.resolve("host_0") == "host_7" and roster.resolve("host_4") == "host_7"
    roster.apply("lost", MemberRecord("host", 1, "host_7", 0, process_identity()))
    roster.apply("join", MemberRecord("host", 2, "host_9", 0, process_identity()))
    assert roster.resolve("host_0") is None and roster.resolve("host_7") is None
    assert roster.resolve("host_9") == "host_9"


def test_a_run_of_joins_is_applied_at_once_in_order_and_replays_are_not_news():
    roster = Roster(PipeLedger(0))
    roster.apply("join", MemberRecord("b", 1, "b_1", 1, "x"))
    version = roster.version
    run = [MemberRecord(name, 1, f"{name}_1", i, "x") for i, name in enumerate(["z", "a", "m", "c", "y", "d"])]
    run += [MemberRecord("b", 1, "b_1", 1, "x"),  # a replay
            MemberRecord("a", 2, "a_2", 0, "x")]  # a newer incarnation of one in this run
    told = roster.apply_joins(run)
    assert told == [True] * 6 + [False, True]
    assert roster.version == version + 1  # one change for the run
    assert roster.members() == ["a", "b", "c", "d", "m", "y", "z"]
    assert roster.incarnation_of("a") == 2 and roster.worker_gone("a_1") and not roster.worker_gone("a_2")
    ring = sorted(roster.members(), key=ring_key)  # (names in the order of a stable hash)
    assert ring != sorted(ring)
    i = ring.index("d")
    assert [r.member for r in roster.successors("d", 2)] == [ring[(i + 1) % 7], ring[(i + 2) % 7]]
    assert [r.member for r in roster.successors(ring[-1], 2)] == ring[:2]  # (the ring wraps round)
    # A short run is inserted name by name; the table and the ring are the same.
    roster.apply_joins([MemberRecord("e", 1, "e_1", 9, "x")])
    assert roster.members() == ["a", "b", "c", "d", "e", "m", "y", "z"]
    ring = sorted(roster.members(), key=ring_key)
    assert [[r.member for r in roster.successors(name, 7)] for name in ring] == \
        [ring[i + 1:] + ring[:i] for i in range(8)]


def test_a_run_of_joiners_named_in_sequence_is_scattered_over_the_liveness_ring():
    # In name order every joiner of a run ("c00000", "c00001", ...) stood just before the
    # same members, so their watchers (the 3 members before each in the ring) changed at
    # every join, and deaths there went unnamed while the joins went on (session 25).
    roster = Roster(PipeLedger(0))
    roster.apply_joins([MemberRecord(f"m{i:05d}", 1, f"m{i:05d}_0", i, "elsewhere/1:1/1") for i in range(256)])

    def watchers() -> dict:
        out: dict = {}
        for name in roster.members():
            for rec in roster.successors(name, 3):
                out.setdefault(rec.member, set()).add(name)
        return out

    before = watchers()
    changes = dict.fromkeys(before, 0)
    for i in range(100):
        roster.apply("join", MemberRecord(f"c{i:05d}", 1, f"c{i:05d}_0", 256 + i, "elsewhere/1:1/1"))
        now = watchers()
        for member in changes:
            changes[member] += now[member] != before[member]
        before = now
    assert all(len(w) == 3 for w in before.values())
    # a member's watchers change when a joiner lands among the 3 before it: 100 x 3/256
    # times on average; in name order, "m00000"'s changed at all 100 joins
    assert max(changes.values()) <= 6, sorted(changes.values())[-5:]  # (4: the hash is fixed)
    roster.apply("lost", roster.successors("m00000", 1)[0])
    assert all(len(roster.successors(name, 3)) == 3 for name in roster.members())


def test_an_agent_made_due_by_a_leave_recycles_after_the_grace_by_a_loss_at_once():
    pipes = PipeLedger(8)
    for worker in ("a_1", "b_2", "c_3"):
        pipes.called(worker)
    pipes.gone("a_1", left=True)  # (the first agent: due at its first gone worker)
    assert not pipes.due() and pipes.dead() == 1
    pipes.gone("b_2")  # lost (or moved): no grace
    assert pipes.due()
    pipes.reset()
    assert not pipes.due()


def test_a_caller_newer_than_the_view_may_run_and_an_older_or_gone_one_may_not():
    """Roster.may_run: what the inference server and the results table ask of a caller."""
    roster = _roster_with(process_identity())
    assert roster.may_run("host", 1)
    assert roster.may_run("host", 2)  # restarted; this view still lists incarnation 1
    roster.apply("lost", MemberRecord("host", 1, "host_0", 0, process_identity()))
    assert not roster.may_run("host", 1)
    assert roster.may_run("host", 2)  # the loss seen, the new join not yet
    roster.apply("join", MemberRecord("host", 2, "host_1", 0, process_identity()))
    assert roster.may_run("host", 2) and not roster.may_run("host", 1)
    roster.apply("leave", MemberRecord("host", 2, "host_1", 0, process_identity()))
    assert not roster.may_run("host", 2) and roster.may_run("host", 3)
    assert roster.may_run("joiner", 1)  # a first join this view has not seen yet
