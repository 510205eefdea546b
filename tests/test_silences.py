"""Silences: a watcher goes on from the silence an earlier watcher noted in the store
(``_membership/silences.py``), and nothing but a note of the same silence moves a timer.

The timers take the caller's clock, so these tests hand them times; the store is a real
TCPStore. The end-to-end case (every watcher of a death dies after it) is in
``test_liveness_scale.py``.
"""

from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from machinlike.distributed._membership.silences import Silences
from machinlike.distributed._store.keys import Keys, MemberRecord
from machinlike.distributed._store.registry import Registry

QUIET = 2.0
DEAD = MemberRecord("d", 3, "d_7", 5, "elsewhere/1:1/5")


@pytest.fixture
def world():
    store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=30), wait_for_workers=False)
    registry = Registry(store, "the test's store")
    yield registry, Keys.elastic_world("0")
    registry.close()


def test_the_next_watcher_goes_on_from_the_noted_silence(world):
    registry, keys = world
    first = Silences(registry, keys)
    assert first.look(DEAD, "41", 100.0, QUIET) == 0.0
    assert first.look(DEAD, "41", 101.0, QUIET) == 1.0 and first.written == 0  # less than a quiet step
    assert first.look(DEAD, "41", 102.5, QUIET) == 2.5 and first.written == 1
    assert first.look(DEAD, "41", 103.0, QUIET) == 3.0 and first.written == 1  # (the same step)
    assert first.look(DEAD, "41", 104.2, QUIET) == pytest.approx(4.2) and first.written == 2
    assert registry.get_or_empty(keys.silence("d")) == "3 41 4.200"
    # The first watcher dies; the next one's clock is its own.
    second = Silences(registry, keys)
    assert second.look(DEAD, "41", 7.0, QUIET) == pytest.approx(4.2) and second.resumed == 1
    assert second.look(DEAD, "41", 8.0, QUIET) == pytest.approx(5.2) and second.written == 0  # step 2 was noted
    assert second.look(DEAD, "41", 9.0, QUIET) == pytest.approx(6.2) and second.written == 1
    assert registry.get_or_empty(keys.silence("d")) == "3 41 6.200"


@pytest.mark.parametrize("note", [
    "3 40 9.000",  # its heartbeat moved since
    "2 41 9.000",  # an earlier incarnation's
    "3 41",
    "3 41 soon",
    "3 41 nan",
    "3 41 inf",
    "3 41 -9.0",
    "",
])
def test_only_a_note_of_the_same_silence_moves_a_timer(world, note):
    registry, keys = world
    if note:
        registry.set(keys.silence("d"), note)
    watcher = Silences(registry, keys)
    assert watcher.look(DEAD, "41", 50.0, QUIET) == 0.0 and watcher.resumed == 0
    assert watcher.look(DEAD, "41", 51.0, QUIET) == 1.0


def test_a_beat_or_a_restart_starts_the_timer_again_and_keep_forgets(world):
    registry, keys = world
    registry.set(keys.silence("d"), "3 41 5.000")
    watcher = Silences(registry, keys)
    assert watcher.look(DEAD, "41", 10.0, QUIET) == 5.0
    assert watcher.look(DEAD, "42", 11.0, QUIET) == 0.0  # it beat
    assert watcher.look(DEAD, "42", 12.0, QUIET) == 1.0
    watcher.restart(DEAD, "42", 20.0)  # (this thread was starved): no note read again
    assert watcher.look(DEAD, "42", 21.0, QUIET) == 1.0
    watcher.keep(set())
    registry.set(keys.silence("d"), "3 42 7.000")
    assert watcher.look(DEAD, "42", 30.0, QUIET) == 7.0  # watched anew: the note is read again
    assert watcher.resumed == 2


def test_without_notes_nothing_is_read_or_written(world):
    registry, keys = world
    registry.set(keys.silence("d"), "3 41 5.000")
    watcher = Silences(registry, keys, notes=False)
    assert watcher.look(DEAD, "41", 0.0, QUIET) == 0.0
    assert watcher.look(DEAD, "41", 9.0, QUIET) == 9.0
    assert watcher.written == watcher.resumed == 0
    assert registry.get_or_empty(keys.silence("d")) == "3 41 5.000"


def test_a_watcher_told_not_to_write_still_times_and_reads(world):
    # (the monitor lets only the nearest watcher that is not silent itself write)
    registry, keys = world
    registry.set(keys.silence("d"), "3 41 1.000")
    farther = Silences(registry, keys)
    assert farther.look(DEAD, "41", 0.0, QUIET, write=False) == 1.0 and farther.resumed == 1
    assert farther.look(DEAD, "41", 5.0, QUIET, write=False) == 6.0 and farther.written == 0
    assert registry.get_or_empty(keys.silence("d")) == "3 41 1.000"
    assert farther.look(DEAD, "41", 5.5, QUIET) == 6.5 and farther.written == 1  # its turn: step 3
