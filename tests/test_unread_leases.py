"""Shared-memory segments lent for a message whose receiver died before taking it come back.

A caller SIGKILLed while the service it called ran never takes the reply's segments; before,
they stayed lent until the callee's World stopped (a learner whose actors die now and then
slowly filled ``shm_cache_bytes``, then sent every large tensor through TensorPipe). Here:
the mechanism in one process (``SegmentCache.address`` through ``_shm.guard``), then the
crash itself across real processes, through the lane and through torch RPC.

A live caller whose call timed out never takes the reply either when torch RPC carries
it (torch drops a late reply unread): a call's terms carry its deadline, and a result
made after it lends nothing (``_shm.overdue``).
"""

from __future__ import annotations

import gc
import os
import pickle
import signal
import subprocess
import threading
import time

import pytest
import torch

from machinlike import _pids, _shm
from machinlike._pids import own_identity
from machinlike._shm._terms import OVERDUE_MARGIN_S
from machinlike.distributed import get_world
from machinlike.distributed._calls import samehost as _samehost
from machinlike.testing import run_world
from proc_util import wait_for_exit

MB = 1 << 20


def _sleeper():
    return subprocess.Popen(["sleep", "120"])


def _killed(proc):
    proc.kill()
    proc.wait(timeout=30)


def _sent(message):
    """``message`` pickled whole by a carrier, then dropped: the lease goes to its receiver."""
    data = pickle.dumps(message)
    del message
    gc.collect()
    return data


def test_a_lease_sent_to_a_process_that_died_untaken_comes_back():
    cache = _shm.cache()
    receiver = _sleeper()
    try:
        word = _pids.identity(receiver.pid)
        lent, unread = cache.lent(), cache.stats["unread"]
        data = _sent(_shm.encode(torch.ones(MB), 4096, word))
        assert cache.lent() == lent + 1  # the receiver lives: it may still take it
        held = _shm.encode(torch.ones(MB), 4096, word)
        pickle.dumps(held)  # pickled, but still held here (a retry could send it again)
        _killed(receiver)
        assert cache.lent() == lent + 1 and cache.stats["unread"] == unread + 1  # the sent one only
        del held
        gc.collect()
        assert cache.lent() == lent and cache.stats["unread"] == unread + 2
        assert cache.wait_taken(0.0)
        del data
    finally:
        if receiver.poll() is None:
            _killed(receiver)


def test_a_lease_without_a_receiver_or_for_this_process_stays_lent():
    cache = _shm.cache()
    lent = cache.lent()
    unknown = _sent(_shm.encode(torch.ones(MB), 4096))  # (a receiver not known: as before)
    own = _sent(_shm.encode(torch.ones(MB), 4096, _pids.own_identity()))
    assert cache.lent() == lent + 2
    assert pickle.loads(own).sum() == MB and pickle.loads(unknown).sum() == MB  # loading frees them
    gc.collect()
    assert cache.lent() == lent


def test_a_late_note_never_names_the_receiver_of_the_next_lease():
    cache = _shm.cache()
    dead = _sleeper()
    word = _pids.identity(dead.pid)
    _killed(dead)
    seg = cache.lease(7 * MB)  # (a size no other test here leases: this segment is the only fit)
    old = seg.lease
    cache.release(seg)
    again = cache.lease(7 * MB)
    assert again is seg and seg.lease != old
    cache.address(seg, old, word)  # a note of the first lease, come after the second began
    assert cache.lent() >= 1 and seg.state() == seg.lease  # the second lease stands
    cache.address(seg, seg.lease, word)
    cache.lent()
    assert seg.state() == 0  # (FREE) its own note gives it back


def test_a_message_that_failed_to_pickle_is_released_not_addressed():
    cache = _shm.cache()
    alive = _sleeper()
    try:
        lent, unread = cache.lent(), cache.stats["unread"]
        message = _shm.encode([torch.ones(MB), _Unpicklable()], 4096, _pids.identity(alive.pid))
        with pytest.raises(TypeError):
            pickle.dumps(message)
        del message
        gc.collect()
        assert cache.lent() == lent and cache.stats["unread"] == unread
    finally:
        _killed(alive)


class _Unpicklable:
    def __reduce__(self):
        raise TypeError("not picklable")


def test_terms_carry_the_callers_deadline_beside_its_identity_and_key():
    now = time.monotonic()
    key = (1 << 40) - 1  # (the widest device key: a 5-byte digest)
    terms = _shm.terms(4096, key, now + 60)
    assert _shm.split_terms(terms) == (4096, own_identity(), key) and not _shm.overdue(terms)
    assert _shm.overdue(_shm.terms(4096, due=now - 1))
    assert _shm.overdue(_shm.terms(4096, due=now + OVERDUE_MARGIN_S / 2))  # (it could not arrive in time)
    assert not _shm.overdue(_shm.terms(4096, due=now + 10 * OVERDUE_MARGIN_S))
    plain = _shm.terms(4096)
    for unknown in (None, float("inf"), float("nan"), 0.0, -5.0):  # no deadline sent: never overdue
        assert _shm.terms(4096, due=unknown) == plain and not _shm.overdue(plain)
    assert _shm.terms(0, due=now) == 0  # (nothing asked: no terms at all)


class _Local:
    """What ``samehost.reply`` reads of a World's settings: the path on, its threshold."""
    enabled, threshold = True, 4096


def test_a_result_made_after_its_callers_deadline_lends_nothing(monkeypatch):
    monkeypatch.setattr(_samehost, "_current", _Local())
    cache = _shm.cache()
    lent, overdue = cache.lent(), _samehost.stats()["shm"]["overdue"]
    value = [torch.ones(MB)]
    on_time = _samehost.reply(value, _shm.terms(4096, due=time.monotonic() + 60))
    assert on_time is not value and cache.lent() == lent + 1  # (wrapped, its tensor a placeholder, lent)
    del on_time
    gc.collect()  # never pickled: its lease ends with it (``_shm.guard``)
    assert cache.lent() == lent
    late = _samehost.reply(value, _shm.terms(4096, due=time.monotonic() - 0.5))
    assert late is value and cache.lent() == lent  # as it is: nothing lent for a caller that stopped waiting
    assert _samehost.stats()["shm"]["overdue"] == overdue + 1
    # A process that uses CUDA takes the stage's walk: staged CUDA tensors, no segment either.
    monkeypatch.setattr(_samehost._cuda_stage, "active", lambda: True)
    late = _samehost.reply(value, _shm.terms(4096, due=time.monotonic() - 0.5))
    assert late is value and cache.lent() == lent and _samehost.stats()["shm"]["overdue"] == overdue + 2


# ------------------------------------------------------------------- across processes
def _kill_caller_then_answer(caller):
    # The caller dies while its call runs here (SIGKILL), then the reply is made: 4 MB,
    # through shared memory, for a process that will never take it.
    os.kill(caller, signal.SIGKILL)
    assert wait_for_exit(caller, 30)
    return torch.ones(MB)


_finished = threading.Event()


def _lent_and_unread():
    shm = get_world().transport_stats()["shm"]  # (the public face of the same counters)
    return shm["lent"], shm["unread"]


def _words(world):
    """What this process names as the process of each member (``SameHost.word_of``)."""
    settings, roster = _samehost._current, world.membership.roster
    return {m: settings.word_of(roster.worker_of(m)) for m in world.get_members() if m != world.name}


def _body(world):
    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 1:
        g.register("answer", _kill_caller_then_answer)
        g.register("finished", _finished.set)
    g.barrier()
    if world.rank == 2:
        g.registered_sync("answer", (os.getpid(),), timeout=60)
        return "not reached"
    if world.rank == 1:
        return _finished.wait(60)  # (rank 0 asks its figures until then)
    # The identity words this process sends segments with are those of its peers' processes.
    words = _words(world)
    assert words["1"] == g.rpc_sync("1", _pids.own_identity)
    lent, unread = g.rpc_sync("1", _lent_and_unread)
    deadline = time.monotonic() + 30
    while (lent, unread) != (0, 1) and time.monotonic() < deadline:
        # (the reply leaves rank 1 when its carrier gives up on the dead caller, which
        # nothing here can wait on: a poll, within one deadline)
        time.sleep(0.05)
        lent, unread = g.rpc_sync("1", _lent_and_unread)
    g.registered_sync("finished")
    return lent, unread, sorted(world.transport_stats())


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "torch-rpc"])
def test_a_caller_killed_while_its_service_ran_leaves_no_segment_lent(lane):
    results = run_world(_body, 3, timeout=90, return_exceptions=True, rpc_timeout=30, same_host_lane=lane)
    if isinstance(results[0], BaseException):
        raise results[0]
    assert results[0][:2] == (0, 1), results  # the 4 MB reply's segment came back, counted as unread
    assert results[0][2] == (["cuda_ipc", "lane", "shm"] if lane else ["cuda_ipc", "shm"]), results
    assert results[1] is True


# ------------------------------------------------- a live caller whose call timed out
_go = threading.Event()


def _answer_when_told():
    # The reply is made only once the caller said its call timed out: 4 MB, for a caller
    # that lives on and will never read it.
    assert _go.wait(60)
    return torch.ones(MB)


def _lent_and_overdue():
    shm = get_world().transport_stats()["shm"]
    return shm["lent"], shm["overdue"]


def _late_body(world):
    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 1:
        g.register("answer", _answer_when_told)
        g.register("go", _go.set)
        g.register("figures", _lent_and_overdue)
        g.register("finished", _finished.set)
    g.barrier()
    if world.rank == 1:
        return _finished.wait(60)
    with pytest.raises(TimeoutError):
        g.registered_sync("answer", timeout=1)
    g.registered_sync("go")
    deadline = time.monotonic() + 20
    lent, overdue = g.registered_sync("figures")
    while overdue == 0 and time.monotonic() < deadline:  # (the reply is made on rank 1's own time)
        time.sleep(0.02)
        lent, overdue = g.registered_sync("figures")
    later = []
    for _ in range(10):  # and it stays so: nothing comes back later because nothing was lent
        time.sleep(0.02)
        later.append(g.registered_sync("figures"))
    g.registered_sync("finished")
    return (lent, overdue), later


@pytest.mark.parametrize("lane", [True, False], ids=["lane", "torch-rpc"])
def test_a_result_made_after_its_live_caller_timed_out_leaves_no_segment_lent(lane):
    results = run_world(_late_body, 2, timeout=90, return_exceptions=True, rpc_timeout=30, same_host_lane=lane)
    if isinstance(results[0], BaseException):
        raise results[0]
    now, later = results[0]
    assert now == (0, 1) and set(later) == {(0, 1)}, results  # sent plainly, counted as overdue
    assert results[1] is True
