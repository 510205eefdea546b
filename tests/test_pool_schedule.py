"""The process pool's policy and small parts, tested without starting a process:
the scheduler's pure functions, the claim/take-back ledger, and the wake-up handshake."""

from __future__ import annotations

import multiprocessing
import select

import pytest

from machinlike.pool._ledger import IDLE, RING, RUNNING, Ledger
from machinlike.pool._schedule import capacity, pick, pick_victim, steal_count
from machinlike.pool._state import PoolFlags, PoolState
from machinlike.pool._wakeup import Wakeup

# ----------------------------------------------------------------------- capacity


def test_capacity_is_bounded_by_the_window():
    assert capacity(load=0, window=2, unread=0, ring=RING, assigned=0, maxtasks=None) == 2
    assert capacity(load=1, window=2, unread=1, ring=RING, assigned=5, maxtasks=None) == 1
    assert capacity(load=2, window=2, unread=2, ring=RING, assigned=5, maxtasks=None) == 0


def test_capacity_keeps_the_take_back_ring_ahead_of_unread_frames():
    # taken-back frames stay unread in the pipe: the ring must still cover them
    assert capacity(load=0, window=32, unread=RING - 3, ring=RING, assigned=0, maxtasks=None) == 2
    assert capacity(load=0, window=32, unread=RING - 1, ring=RING, assigned=0, maxtasks=None) == 0


def test_capacity_stops_at_maxtasks_and_is_never_negative():
    assert capacity(load=0, window=32, unread=0, ring=RING, assigned=3, maxtasks=4) == 1
    assert capacity(load=0, window=32, unread=0, ring=RING, assigned=4, maxtasks=4) == 0
    assert capacity(load=5, window=2, unread=0, ring=RING, assigned=9, maxtasks=4) == 0


# ----------------------------------------------------------------------- pick


def test_pick_takes_the_least_loaded_worker_with_room():
    assert pick([2, 1, 3], [5, 5, 5], rotation=0) == 1
    assert pick([2, 1, 3], [5, 0, 5], rotation=0) == 0  # the least loaded has no room
    assert pick([1, 1], [0, 0], rotation=0) is None
    assert pick([], [], rotation=0) is None


def test_pick_breaks_ties_from_the_rotation_and_wraps():
    assert pick([1, 1, 1], [1, 1, 1], rotation=0) == 0
    assert pick([1, 1, 1], [1, 1, 1], rotation=2) == 2
    assert pick([0, 1, 1], [1, 1, 1], rotation=1) == 0  # wraps round to the idle one


def test_pick_takes_an_idle_worker_at_once():
    assert pick([3, 0, 0], [9, 9, 9], rotation=0) == 1
    assert pick([3, 0, 0], [9, 9, 9], rotation=2) == 2


def test_picking_in_turn_spreads_tasks_evenly_and_respects_the_window():
    """What the dispatcher does with a backlog: pick, count the task, rotate."""
    window, workers = 2, 3
    loads, caps = [0] * workers, [window] * workers
    rotation, order = 0, []
    while True:
        i = pick(loads, caps, rotation)
        if i is None:
            break
        loads[i] += 1
        caps[i] -= 1
        rotation = (i + 1) % workers
        order.append(i)
    assert order == [0, 1, 2, 0, 1, 2] and loads == [window] * workers


# ----------------------------------------------------------------------- stealing


def test_pick_victim_is_the_worker_with_most_unstarted_tasks_never_the_thief():
    assert pick_victim([0, 4, 7, 7], thief=0) == 2  # the first of equals
    assert pick_victim([9, 4], thief=0) == 1
    assert pick_victim([9, 0], thief=1) == 0
    assert pick_victim([0, 0, 0], thief=1) is None
    assert pick_victim([5], thief=0) is None


@pytest.mark.parametrize("unstarted, taken", [(0, 0), (1, 1), (2, 1), (3, 2), (4, 2), (31, 16)])
def test_a_thief_takes_the_newest_half_rounded_up(unstarted, taken):
    assert steal_count(unstarted) == taken


# ----------------------------------------------------------------------- the ledger


@pytest.fixture
def ledger():
    return Ledger.create(multiprocessing.get_context("spawn"))  # a lock and an array: no process


def test_a_task_taken_back_is_skipped_and_one_claimed_cannot_be_taken_back(ledger):
    assert ledger.started() == -1 and ledger.phase() == IDLE
    assert ledger.claim(0)
    # the pool may only take back what is numbered above the last started frame
    taken = ledger.take_back(lambda started: [s for s in (0, 1, 2) if s > started], wait=1.0)
    assert list(taken) == [1, 2]
    assert not ledger.claim(1) and not ledger.claim(2)  # skipped: they run elsewhere
    assert ledger.started() == 2  # skipped frames count as taken
    assert ledger.claim(3)


def test_the_take_back_ring_reuses_slots_by_sequence_number(ledger):
    ledger.take_back(lambda started: [5], wait=1.0)
    assert ledger.claim(5 + RING)  # same slot, another task: not taken back
    ledger.set_phase(RUNNING)
    assert ledger.phase() == RUNNING


def test_take_back_gives_up_when_the_worker_holds_the_lock(ledger):
    lock = ledger.__reduce__()[1][0]
    with lock:  # as a worker that died while claiming
        assert ledger.take_back(lambda started: [1], wait=0.05) is None


# ----------------------------------------------------------------------- the wake-up


def test_a_sleeping_manager_is_woken_once_per_sleep():
    wakeup = Wakeup()
    try:
        assert not wakeup.claim()  # awake: nobody needs to write
        wakeup.arm()
        assert wakeup.sleeping()
        assert wakeup.claim() and not wakeup.claim() and not wakeup.sleeping()
        wakeup.wake()
        assert select.select([wakeup.fd], [], [], 5.0)[0] == [wakeup.fd]
        wakeup.drain()
        assert select.select([wakeup.fd], [], [], 0)[0] == []
        wakeup.disarm()
        wakeup.arm()
        assert wakeup.claim()  # a new sleep, a new wake-up
    finally:
        wakeup.close()
    wakeup.wake()  # after close: nothing to write to, no error
    wakeup.close()


# ----------------------------------------------------------------------- the flags


def test_pool_flags_move_one_way_and_the_state_reads_as_its_string():
    flags = PoolFlags()
    assert flags.state == "running" and f"{flags.state}" == "running"
    flags.check_running()
    flags.close()
    assert flags.state is PoolState.CLOSE and not flags.ended()
    with pytest.raises(ValueError, match="it was closed"):
        flags.check_running()
    assert flags.terminate() and not flags.terminate()
    assert flags.state is PoolState.TERMINATE and flags.ended()
    from machinlike.pool import BrokenPoolError

    assert not flags.break_(BrokenPoolError("late"))  # terminated stays terminated
