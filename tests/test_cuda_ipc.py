"""CUDA tensors through CUDA IPC between processes of one host (``distributed._calls.cuda_ipc``).

On the CPU: the reply terms, the bounds and validation of ``cuda_ipc_cache_bytes``, the
export area's leases, reclaim and eviction (with stand-in slabs), the receiver's cache of
openings (bounded, dropping dead and retired owners), the fallbacks to staging, and a
receiver without CUDA refusing to initialise it. The end-to-end runs are marked ``gpu``
(``tests/test_cuda_ipc_gpu.py``).
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import subprocess
import sys
import threading
import time
import traceback
import warnings
import weakref
from types import SimpleNamespace

import pytest
import torch

from machinlike import _pids
from machinlike.distributed._calls import cuda_ipc as _cuda_ipc, cuda_ipc_area as _cuda_ipc_area
from machinlike.distributed._calls import cuda_ipc_open as _cuda_ipc_open, cuda_ipc_peers as _cuda_ipc_peers
from machinlike.distributed._calls import cuda_ipc_slab as _cuda_ipc_slab
from machinlike.distributed._calls import cuda_stage as _cuda_stage, samehost as _samehost
from machinlike.distributed._calls.strides import kept_strides
from machinlike.distributed._world.settings import settings as resolve_settings


@pytest.fixture(autouse=True)
def _no_settling_after(monkeypatch):
    """The receives faked over CPU memory note a GPU; a later call in this process must
    not ask a CPU build of torch for its streams (cuda_settle)."""
    from machinlike.distributed._calls import cuda_settle

    monkeypatch.setattr(cuda_settle, "_devices", set())


@pytest.fixture
def ipc_on(monkeypatch):
    # This process's counts and openings as at its start: a test reads them whole, and what
    # an earlier test (in any order) counted or opened is not its own.
    monkeypatch.setattr(_cuda_ipc, "_counts", type(_cuda_ipc._counts)())
    monkeypatch.setattr(_cuda_ipc, "_opened", None)
    _cuda_ipc.configure(64 << 20)
    yield
    _cuda_ipc.close()
    _cuda_ipc._outliving.sweep(force=True)  # (leases a test left lent to this live process)
    _cuda_ipc.configure(0)


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=30)
    return child.pid


# --------------------------------------------------------------------- reply terms
def test_terms_pack_threshold_pid_and_key_and_split_back(monkeypatch):
    monkeypatch.setattr(_cuda_ipc, "_key", 0xABCDE12345)
    packed = _cuda_ipc.terms(1 << 20, (0xABCDE12345, 999))
    assert _cuda_ipc.split_terms(packed) == (1 << 20, os.getpid(), 0xABCDE12345)
    assert packed & _cuda_ipc.TERMS_MASK == 1 << 20
    assert _cuda_ipc.split_terms(_cuda_ipc.terms(1 << 20, None)) == (1 << 20, os.getpid(), 0)  # no target: no key
    assert _cuda_ipc.terms(0, None) == 0  # a caller on another host: no terms at all
    assert _cuda_ipc.split_terms(4096) == (4096, 0, 0)


def _packed(threshold, who, key):
    """Reply terms as ``_shm._terms`` lays them out: threshold, the caller's identity word, key."""
    return threshold | (who << 48) | (key << 112)


def test_reply_target_needs_the_path_on_and_the_same_key(monkeypatch, ipc_on):
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    theirs = _packed(1 << 10, 12345, 77)
    assert _cuda_ipc.reply_target(theirs) == (77, 12345)
    assert _cuda_ipc.reply_target(_packed(1 << 10, 12345, 78)) is None  # other GPUs
    assert _cuda_ipc.reply_target(1 << 10) is None  # a caller that asked for no IPC
    assert _cuda_ipc.reply_target(_packed(1 << 10, os.getpid(), 77)) is None  # itself
    assert _cuda_ipc.reply_target(_packed(1 << 10, _pids.identity(12345), 77)) == (77, 12345)  # a whole word
    _cuda_ipc.configure(0)
    assert _cuda_ipc.reply_target(theirs) is None


def test_a_cpu_callee_masks_packed_terms_for_the_shm_threshold(monkeypatch):
    class Local:
        enabled, threshold = True, 1 << 10

    monkeypatch.setattr(_samehost, "_current", Local())
    assert _samehost._reply_threshold(_packed(1 << 12, 5, 9)) == 1 << 12


def test_a_process_without_cuda_has_key_zero_and_no_targets(ipc_on):
    assert not torch.cuda.is_initialized()
    assert _cuda_ipc.local_key() == 0
    assert _cuda_ipc_peers.peer_target("anyone", os.getpid() + 1) is None  # asks nobody: no CUDA here
    assert _cuda_ipc_peers._describe() == (0, 0)
    assert not torch.cuda.is_initialized()
    _cuda_ipc.configure(0)
    assert _cuda_ipc_peers._describe() == (-1, 0)  # the path is off here: never ask again


@pytest.mark.parametrize("answer, counted, asks_again", [
    ((-1, 0), "staged_peer_ipc_off", False),
    ((0, 0), "staged_peer_without_cuda", True),    # no CUDA there yet: asked again after _RETRY_S
    ((99, 1), "staged_peer_other_gpus", False),
    ((77, 2), "staged_peer_on_other_devices", True),  # no context on cuda:0 there: asked again
    (RuntimeError("gone"), "staged_probe_unanswered", True),  # asked again after _UNANSWERED_RETRY_S
])
def test_peer_verdicts_are_kept_counted_and_retried_only_for_a_peer_without_cuda(monkeypatch, ipc_on, answer,
                                                                                    counted, asks_again):
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    monkeypatch.setattr(_cuda_ipc.ops, "context_mask", lambda: 1)  # (a context on cuda:0 alone)
    asked = []

    def rpc_sync(member, fn, args=(), timeout=None):
        asked.append((member, fn.__name__, timeout))
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(_cuda_ipc_peers.rpc, "rpc_sync", rpc_sync)
    before = _cuda_ipc.stats().get(counted, 0)
    assert _cuda_ipc_peers.peer_target("peer", os.getpid() + 1) is None
    assert asked == [("peer", "_describe", _cuda_ipc_peers._PROBE_TIMEOUT_S)]
    assert _cuda_ipc.stats()[counted] == before + 1
    assert _cuda_ipc_peers.peer_target("peer", os.getpid() + 1) is None and len(asked) == 1  # kept
    monkeypatch.setattr(_cuda_ipc_peers.time, "monotonic", lambda: 1e12)
    _cuda_ipc_peers.peer_target("peer", os.getpid() + 1)
    assert len(asked) == (2 if asks_again else 1)
    assert _cuda_ipc_peers.peer_target("me", os.getpid()) is None and len(asked) == (2 if asks_again else 1)  # never itself


# ----------------------------------------------------------------------- settings
def _resolve(**over):
    base = dict(init_method=None, backend="gloo", rpc_timeout=5.0, rpc_threads=4, collective=False,
                init_rpc=True, dist_timeout=5.0, store=None, interface=None, elastic=False, liveness=None,
                init_dist=None, dist_backend=None, dist_init_method=None, rpc_init_method=None,
                same_host_shm=True, shm_threshold=1 << 20, shm_cache_bytes=1 << 30)
    base.update(over)
    return resolve_settings("0", 0, 1, **base)


@pytest.mark.parametrize("bad", [-1, 1.5, "1G", True, None])
def test_bad_cuda_ipc_cache_bytes_is_named(bad):
    with pytest.raises(ValueError, match=r"cuda_ipc_cache_bytes=.*int >= 0"):
        _resolve(cuda_ipc_cache_bytes=bad)


def test_world_names_a_bad_cuda_ipc_cache_bytes_before_connecting():
    from machinlike.distributed import World

    with pytest.raises(ValueError, match=r"cuda_ipc_cache_bytes=-1 must be an int >= 0 \(bytes; 0 stages"):
        World("x", 0, 1, cuda_ipc_cache_bytes=-1)


def test_cuda_ipc_cache_bytes_defaults_and_zero():
    assert _resolve().cuda_ipc_cache_bytes == 4 << 30
    assert _resolve(cuda_ipc_cache_bytes=0).cuda_ipc_cache_bytes == 0


def test_samehost_configures_and_stops_the_path():
    # (1 GiB: the World's default bound of the shm caches, which SameHost sets process-wide)
    host = _samehost.SameHost(True, 1 << 20, 1 << 30, lambda member: None, 1 << 20)
    assert _cuda_ipc.enabled()
    host.close()
    assert not _cuda_ipc.enabled()
    host = _samehost.SameHost(False, 1 << 20, 1 << 30, lambda member: None, 1 << 20)
    assert not _cuda_ipc.enabled()  # same_host_shm=False: the same-host paths are off, CUDA's too
    host.close()


# --------------------------------------------------------------------- export area
class _FakeSlab:
    """A slab without CUDA: what the area's bookkeeping needs."""

    def __init__(self, slot, ident, index, capacity):
        self.slot, self.ident, self.index, self.capacity = slot, ident, index, capacity
        self.storage = object()
        self.handle, self.offset, self.counter = b"h%d" % ident, 0, (b"/none", 0)
        self.mapped = capacity
        self.views = {}
        self.ready, self.ready_handle = None, b""
        self.unsent = False
        self.writes_settled = 0
        self.stuck = False  # a test sets True: copies into it that never run (a stuck device)

    def settle_writes(self, timeout=None):
        self.writes_settled += 1
        return not self.stuck

    def settled(self):
        return not self.stuck


@pytest.fixture
def area(monkeypatch):
    monkeypatch.setattr(_cuda_ipc_area, "Slab", _FakeSlab)
    made = _cuda_ipc_area.ExportArea(16 << 20)
    yield made
    made.close()


def test_a_slabs_mapped_bytes_are_its_segments_as_the_allocators_snapshot_says(monkeypatch):
    asked = []
    segments = [{"device": 0, "address": 4096, "total_size": 20 << 20, "is_expandable": False},
                {"device": 1, "address": 8192, "total_size": 40 << 20, "is_expandable": False},
                {"device": 0, "address": 8192, "total_size": 1 << 30, "is_expandable": True}]

    def snapshot(**options):
        asked.append(options)
        return segments

    monkeypatch.setattr(torch.cuda, "memory_snapshot", snapshot)
    assert _cuda_ipc_slab.segment_bytes(4096, 0, 2 << 20) == 20 << 20  # the whole segment
    assert asked == [{"include_traces": False}]  # (a user's memory history is not converted)
    assert _cuda_ipc_slab.segment_bytes(8192, 1, 2 << 20) == 40 << 20  # by device and address
    assert _cuda_ipc_slab.segment_bytes(8192, 0, 2 << 20) == 2 << 20  # expandable: the slab's own
    assert _cuda_ipc_slab.segment_bytes(12288, 0, 2 << 20) == 2 << 20  # not found
    assert _cuda_ipc_slab.segment_bytes(4096, 0, 32 << 20) == 32 << 20  # never less than the slab
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda: segments)  # a torch without the keyword
    assert _cuda_ipc_slab.segment_bytes(4096, 0, 2 << 20) == 20 << 20

    def refusing(mempool_id=None, include_traces=True):  # pytorch#174044: a build that refused its own pool id
        if not include_traces:
            raise RuntimeError("mempool_id must be a tuple of 2 integers")
        return segments

    monkeypatch.setattr(torch.cuda, "memory_snapshot", refusing)
    assert _cuda_ipc_slab.segment_bytes(4096, 0, 2 << 20) == 20 << 20  # not the slab's 2 MiB

    def failing(**options):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch.cuda, "memory_snapshot", failing)
    assert _cuda_ipc_slab.segment_bytes(4096, 0, 2 << 20) == 2 << 20  # diagnostics never fail a send


def test_slab_capacity_is_a_power_of_two_from_2_mib():
    assert _cuda_ipc_slab.slab_capacity(1) == 2 << 20
    assert _cuda_ipc_slab.slab_capacity(2 << 20) == 2 << 20
    assert _cuda_ipc_slab.slab_capacity((2 << 20) + 1) == 4 << 20
    assert _cuda_ipc_slab.slab_capacity(64_000_000) == 64 << 20


def test_a_freed_lease_is_lent_again_and_a_busy_one_is_not(area):
    first = area.lease(0, 1000, os.getpid())
    assert first is not None and area.lent() == 1
    second = area.lease(0, 1000, os.getpid())
    assert second.slab is not first.slab  # the first is still lent
    area.words[first.slab.slot, 0] = _cuda_ipc_area.FREE  # what a receiver writes once copied out
    third = area.lease(0, 1000, os.getpid())
    assert third.slab is first.slab and third.ident != first.ident
    assert area.held_bytes() == 4 << 20


def test_a_taker_waits_briefly_for_its_own_last_slab_and_others_do_not(area):
    area.reuse_wait = 5.0  # (2 ms by default: long enough for a receiver's copies to end)
    first = area.lease(0, 1000, os.getpid())

    def receiver_frees_it_while_the_taker_waits():
        # (freed 0.05 s after the taker began to wait, not 0.05 s after this thread started:
        # a busy machine may start the taker later than that, and it never waits)
        deadline = time.monotonic() + 30
        while area.stats["reuse_waits"] == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)
        area.words[first.slab.slot, 0] = _cuda_ipc_area.FREE

    threading.Thread(target=receiver_frees_it_while_the_taker_waits, daemon=True).start()
    started = time.monotonic()
    again = area.lease(0, 1000, os.getpid())  # its receiver's copies out are ending: wait, reuse
    assert again.slab is first.slab and time.monotonic() - started >= 0.05
    assert area.stats["reuse_waits"] == 1 and area.stats["slabs_made"] == 1
    started = time.monotonic()
    other = area.lease(0, 1000, os.getppid())  # another taker: a new slab at once
    assert other.slab is not first.slab and time.monotonic() - started < 2.0
    assert area.stats["reuse_waits"] == 1 and area.stats["slabs_made"] == 2
    area.reuse_wait = 0.05
    started = time.monotonic()
    third = area.lease(0, 1000, os.getpid())  # its slab stays lent: a new one after the wait
    assert third.slab not in (first.slab, other.slab) and 0.05 <= time.monotonic() - started < 5.0


def test_devices_do_not_share_slabs(area):
    a = area.lease(0, 10, os.getpid())
    area.release(a)
    b = area.lease(1, 10, os.getpid())
    assert b.slab is not a.slab and b.slab.index == 1


def test_a_lease_of_a_dead_receiver_is_reclaimed(area):
    dead = _dead_pid()
    first = area.lease(0, 4 << 20, dead)
    area.filled(first)  # (its sender queued its copies: the message left)
    again = area.lease(0, 4 << 20, os.getpid())  # taken back before any new slab is made
    assert again.slab is first.slab and area.held_bytes() == 4 << 20
    assert area.stats["reclaimed"] == 1 and area.stats["slabs_made"] == 1
    # It may have died before this side's copies into the slab ran: its next writer waits for them.
    assert again.slab.unsent and area.unsettled(again.slab) and not area.unsettled(again.slab)


def test_a_slab_retired_while_an_early_ended_message_may_write_it_waits_for_those_copies(area):
    """A message that ended on this side (refused, never sent, its receiver dead) may still
    have copies queued into its slab; retiring that slab (evicted for room, or at close)
    gave its memory back to the allocator under them. A settled slab retires at once."""
    live = os.getpid()
    ended, quiet = area.lease(0, 8 << 20, live), area.lease(0, 8 << 20, live)
    area.release(ended)  # its copies may be queued
    area.words[quiet.slab.slot, 0] = _cuda_ipc_area.FREE  # read and freed by its receiver
    assert area.lease(0, 16 << 20, live) is not None  # room for it: both are evicted
    assert (ended.slab.writes_settled, quiet.slab.writes_settled) == (1, 0) and area.stats["retire_waits"] == 1


def test_settling_a_slab_waits_for_its_own_event_not_the_whole_device(monkeypatch):
    """The slab's ``ready`` follows its last message's copies (the next writer waits on it
    too): settling it under the area's lock waits for those alone, not for whatever else
    the device has queued (a learner's step). Without IPC events: the device."""
    synced, current = [], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: synced.append(device))

    class _Device:  # (its device current while it waits: no stray context on cuda:0)
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            current.append(self.index)

        def __exit__(self, *exc):
            current.pop()

    monkeypatch.setattr(torch.cuda, "device", _Device)

    class _Event:
        def __init__(self, runs_after):
            self.asked, self.runs_after = 0, runs_after

        def query(self):
            assert current == [1]
            self.asked += 1
            return self.asked > self.runs_after

    slab = _cuda_ipc_slab.Slab.__new__(_cuda_ipc_slab.Slab)  # (no CUDA here: the fields it reads)
    slab.index, slab.ready = 1, _Event(runs_after=3)
    assert slab.settle_writes() and slab.ready.asked == 4 and synced == []
    assert slab.settled()
    # Copies that never run (a device stuck behind a collective): the wait ends at its
    # bound, under the area's lock, and says so; the caller keeps the memory.
    slab.ready = _Event(runs_after=10 ** 9)
    started = time.monotonic()
    assert not slab.settle_writes(0.05) and 0.05 <= time.monotonic() - started < 2.0
    assert not slab.settled() and synced == []
    slab.ready = None
    assert slab.settle_writes() and slab.settled()
    assert synced == [torch.device("cuda", 1)]


def test_no_room_is_none_and_counted_and_free_slabs_are_evicted(area):
    live = os.getpid()
    small = [area.lease(0, 2 << 20, live) for _ in range(4)]  # 8 MiB lent
    big = area.lease(0, 8 << 20, live)  # 8 more: exactly the bound
    assert big is not None and area.held_bytes() == 16 << 20
    assert area.lease(0, 2 << 20, live) is None and area.stats["no_room"] == 1
    assert area.lease(0, 32 << 20, live) is None  # larger than the whole bound
    for lease in small:
        area.release(lease)
    bigger = area.lease(0, 6 << 20, live)  # 8 MiB: two... four free 2 MiB slabs are retired for it
    assert bigger is not None and area.held_bytes() <= 16 << 20
    assert area.stats["slabs_retired"] == 4
    retired = [lease.slab for lease in small]
    assert all(area.words[slab.slot, 2] != slab.ident for slab in retired if slab is not bigger.slab)


def test_closing_waits_briefly_for_live_receivers_to_end_their_leases(area):
    # A receiver may still be copying out of a slab when its sender's World stops: the
    # slab's memory must not go back to the allocator (nor its event die) under the copies.
    lent = area.lease(0, 10, os.getpid())  # (a live receiver: this process)
    dead = area.lease(0, 10, _dead_pid())  # a dead one's is not waited for
    area.filled(lent)
    area.filled(dead)  # (their sender's copies are queued: the messages left)
    retired_at = []
    real_retire = area._retire
    area._retire = lambda slab: (retired_at.append(time.monotonic()), real_retire(slab))
    freed_at = []

    def free():
        freed_at.append(time.monotonic())
        area.words[lent.slab.slot, 0] = _cuda_ipc_area.FREE

    threading.Timer(0.1, free).start()
    started = time.monotonic()
    area.close(5.0)
    assert freed_at and len(retired_at) == 2 and min(retired_at) >= freed_at[0]
    assert time.monotonic() - started < 2.0
    assert dead.slab.storage is None


def test_closing_does_not_wait_past_its_bound_for_a_lease_never_taken(monkeypatch):
    monkeypatch.setattr(_cuda_ipc_area, "Slab", _FakeSlab)
    made = _cuda_ipc_area.ExportArea(16 << 20)
    made.filled(made.lease(0, 10, os.getpid()))  # its message was lost: nobody will end it
    started = time.monotonic()
    assert made.close(0.2) is True  # (its slab outlives the area: see the next test)
    assert 0.2 <= time.monotonic() - started < 2.0
    assert made.fd >= 0  # (a receiver that had not mapped the page yet still may)
    assert made.sweep(force=True) is False and made.fd == -1


def test_a_slab_lent_to_a_live_receiver_outlives_the_closed_area_until_it_is_freed(area, monkeypatch):
    """Closing retired every slab after its bounded wait, also one still lent to a live
    receiver (copying out of it slowly, or its message lost) and released torch's counter
    on it: the memory went back to the allocator, and the receiver's copies could read the
    next tensor made there. It is kept now (memory, event, counter) until its row comes
    FREE or its receiver dies; the rest retires at once."""
    released = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        lambda *counter: released.append(counter), raising=False)
    live, dead, idle = area.lease(0, 10, os.getpid()), area.lease(0, 10, _dead_pid()), area.lease(0, 10, 1)
    for lease in (live, dead, idle):
        area.filled(lease)
    area.words[idle.slab.slot, 0] = _cuda_ipc_area.FREE  # read and freed by its receiver
    kept_event = live.slab.ready = object()
    assert area.close(0.05) is True
    assert area._slabs == [live.slab] and live.slab.storage is not None and live.slab.ready is kept_event
    assert dead.slab.storage is None and idle.slab.storage is None and len(released) == 2
    assert area.stats["outlived"] == 1
    assert area.sweep() is True and len(released) == 2  # still lent: still kept
    area.words[live.slab.slot, 0] = _cuda_ipc_area.FREE  # the receiver's copies out ended
    assert area.fd >= 0  # (open while a slab outlives: its receiver may map the page yet)
    assert area.sweep() is False and live.slab.storage is None and len(released) == 3
    assert area.words[live.slab.slot, 2] == _cuda_ipc_area.RETIRED and area.fd == -1


def test_a_closed_area_lends_makes_and_shares_nothing(over_cpu):
    area = _cuda_ipc.export_area()
    pinned = area.pin(0, 10)
    assert area.share(pinned, os.getpid()) is not None  # a live reader: the slab outlives the close
    assert area.close() is True and pinned.storage is not None
    with pytest.raises(RuntimeError, match="export area is closed"):
        area.lease(0, 10, os.getpid())
    with pytest.raises(RuntimeError, match="export area is closed"):
        area.pin(0, 10)
    assert area.share(pinned, os.getpid()) is None and area._slabs == [pinned]
    area.sweep(force=True)


def test_a_slab_written_while_its_area_closes_is_waited_for_then_ended(area):
    """Closing retired a slab its sender was still writing (its copies queued into memory
    given back); the message then went out naming a closed control page, its lease lent
    to a live receiver that could never end it."""
    lease = area.lease(0, 10, os.getpid())
    retired = []
    real_retire = area._retire
    area._retire = lambda slab: (retired.append(area._filling.copy()), real_retire(slab))
    started = time.monotonic()  # (before the timer starts: a busy machine may run it at once)
    threading.Timer(0.1, lambda: area.filled(lease)).start()  # the writer ends within the wait
    assert area.close(5.0) is False and 0.05 <= time.monotonic() - started < 2.0
    assert retired == [{}] and area._slabs == []  # retired once written, not under its writer
    # Written in a closing area, its message names a page about to close: ended here, and
    # its copies settled before the slab went.
    assert area.stats["ended_at_close"] == 1 and lease.slab.writes_settled == 1


def test_a_slab_still_written_after_the_wait_is_ended_by_its_writer_and_swept(area):
    lease = area.lease(0, 10, os.getpid())
    assert area.close(0.05) is True and area._slabs == [lease.slab] and lease.slab.storage is not None
    area.filled(lease)  # the writer is done: its message names a closed page, nobody could end it
    assert area.words[lease.slab.slot, 0] == _cuda_ipc_area.FREE and area.stats["ended_at_close"] == 1
    assert area.sweep() is False and lease.slab.writes_settled == 1  # its copies ran before it went


def test_a_late_filled_of_an_ended_lease_keeps_its_successors_mark(area):
    """The writer's error path ended its lease before marking it filled: a lease of the
    same slab taken by another thread in between lost its mark, and could be reclaimed
    under its writer when its taker died."""
    first = area.lease(0, 10, os.getpid())
    area.release(first)
    second = area.lease(0, 10, os.getpid())
    assert second.slab is first.slab
    area.filled(first)
    assert area._filling == {second.slab.slot: second.ident}
    area.filled(second)
    assert area._filling == {}


def test_a_slab_whose_copies_in_never_run_is_retired_but_its_memory_kept_until_they_do(area, monkeypatch):
    """Retiring a slab still written waits under the area's lock: a bounded wait (a device
    stuck behind a collective once hung every sender of the process here). Past it the
    slab is retired (never lent again, receivers drop it) but its memory stays held and
    counted, and goes back to the allocator once those copies ran."""
    let_go = []
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda",
                        lambda *counter: let_go.append(counter), raising=False)
    live = os.getpid()
    ended, other = area.lease(0, 8 << 20, live), area.lease(0, 8 << 20, live)
    area.release(ended)  # its copies may be queued
    area.words[other.slab.slot, 0] = _cuda_ipc_area.FREE
    ended.slab.stuck = True
    storage = ended.slab.storage
    assert area.lease(0, 16 << 20, live) is None  # room needs both: the stuck one's memory stays
    assert area.stats["settle_timed_out"] == 1 and area.stats["slabs_retired"] == 2
    assert ended.slab not in area._slabs and ended.slab.storage is None  # retired: never lent again
    assert area.words[ended.slab.slot, 2] == _cuda_ipc_area.RETIRED  # receivers drop their opening
    assert area._parked._kept[0][1][0] is storage and area.held_bytes() == 8 << 20  # kept, and counted
    assert let_go == [other.slab.counter]
    assert area.lease(0, 8 << 20, live) is not None and area.held_bytes() == 16 << 20  # still counted
    ended.slab.stuck = False  # the device got there
    assert area.lent() == 1 and len(area._parked) == 0 and area.held_bytes() == 8 << 20
    assert let_go == [other.slab.counter, ended.slab.counter]


def test_a_closed_area_outlives_while_a_retired_slab_is_still_written(area, monkeypatch):
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda", lambda *counter: None, raising=False)
    ended = area.lease(0, 10, os.getpid())
    area.filled(ended)
    area.release(ended)
    ended.slab.stuck = True
    assert area.close() is True and area._slabs == [] and area.fd >= 0  # kept by ``Outliving``
    assert area.sweep() is True and area.held_bytes() == 2 << 20
    ended.slab.stuck = False
    assert area.sweep() is False and area.held_bytes() == 0 and area.fd == -1
    stuck = _cuda_ipc_area.ExportArea(16 << 20)
    lease = stuck.lease(0, 10, os.getpid())
    stuck.release(lease)
    lease.slab.stuck = True
    assert stuck.close() is True and stuck.sweep(force=True) is False  # the interpreter's exit
    assert stuck.held_bytes() == 0


def test_closing_counts_a_settle_that_fails_and_goes_on(area):
    ended = area.lease(0, 10, os.getpid())
    area.filled(ended)
    area.release(ended)  # its copies may be queued: retiring it settles them

    def failing(timeout=None):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    ended.slab.settle_writes = failing
    assert area.close() is False and area.stats["settle_failed"] == 1 and area._slabs == []


def test_release_only_ends_its_own_lease(area):
    first = area.lease(0, 10, os.getpid())
    area.words[first.slab.slot, 0] = _cuda_ipc_area.FREE
    second = area.lease(0, 10, os.getpid())
    area.release(first)  # late: the slab is lent to the second lease now
    assert area.words[second.slab.slot, 0] == second.ident


def _retired(area):
    """The owner's World stopped and then its process exited: every slab retires."""
    area.close()
    area.sweep(force=True)


def test_close_retires_every_slab_nobody_holds(area):
    lease = area.lease(0, 10, os.getpid())
    area.filled(lease)
    area.release(lease)
    area.close()
    assert area.words[lease.slab.slot, 2] == _cuda_ipc_area.RETIRED and area.held_bytes() == 0


# ---------------------------------------------------------------- receiver's cache
def test_openings_are_cached_bounded_and_dropped_when_retired_or_dead(area):
    cache = _cuda_ipc_open.OpenCache(4 << 20)
    words = cache.control(os.getpid(), area.fd, area.inode)  # the control page, mapped through /proc
    lease = area.lease(0, 10, os.getpid())
    slab = lease.slab
    assert words[slab.slot, 0] == lease.ident and words[slab.slot, 2] == slab.ident
    opened = []

    def opener():
        opened.append(1)
        return object()

    me = os.getpid()
    one = cache.open((me, b"a", 0), 2 << 20, words, slab.slot, slab.ident, opener)
    assert cache.open((me, b"a", 0), 2 << 20, words, slab.slot, slab.ident, opener) is one and len(opened) == 1
    cache.open((me, b"b", 0), 2 << 20, words, slab.slot, slab.ident, opener)
    cache.open((me, b"c", 0), 2 << 20, words, slab.slot, slab.ident, opener)  # over 4 MiB: "a" goes
    assert len(cache) == 2 and cache.held_bytes() == 4 << 20 and cache.stats["evicted"] == 1
    _retired(area)  # the owner retires the slab: the receiver drops it at its next trim
    assert cache.forget_dead() == 2 and len(cache) == 0 and cache.held_bytes() == 0
    dead = _dead_pid()
    cache.open((dead, b"d", 0), 2 << 20, words, 0, int(words[0, 2]), opener)
    assert cache.forget_dead() == 1 and len(cache) == 0  # a dead owner's slab goes (departure, next opening)


def test_an_opening_counts_its_owners_segment_once_however_many_of_its_slabs_are_open(area):
    # The driver maps a handle's whole allocation (a 2 MiB slab can sit in a 20 MiB
    # segment), and torch opens equal handle bytes once: the cache counts what is mapped.
    cache = _cuda_ipc_open.OpenCache(48 << 20)
    words = cache.control(os.getpid(), area.fd, area.inode)
    slab = area.lease(0, 10, os.getpid()).slab
    me, other = os.getpid(), os.getppid()
    opened = []

    def opener():
        opened.append(1)
        return object()

    def open_(owner, handle, offset, mapped=20 << 20):
        return cache.open((owner, handle, offset), 2 << 20, words, slab.slot, slab.ident, opener, 0, mapped)

    open_(me, b"s", 0)
    open_(me, b"s", 2 << 20)  # a second slab of the same segment: nothing more mapped
    assert len(cache) == 2 and cache.held_bytes() == 20 << 20
    open_(other, b"s", 0)  # equal bytes from another process: its own segment
    assert cache.held_bytes() == 40 << 20 and cache.stats["evicted"] == 0
    open_(me, b"t", 0)  # a third segment: over 48 MiB, least recently used openings go
    # (me, s, 0) goes first and frees nothing (its segment is still open); then (me, s, 2 MiB)
    assert cache.stats["evicted"] == 2 and cache.held_bytes() == 40 << 20 and len(cache) == 2
    open_(me, b"u", 0, mapped=None)  # an owner that could not tell: its slab's capacity
    assert cache.held_bytes() == 42 << 20
    cache.forget_all()
    assert cache.held_bytes() == 0 and cache._maps == {}


def test_openings_are_let_go_out_of_the_caches_lock(area):
    # Closing a handle waits for its device (milliseconds), and every receiving thread takes
    # the cache's lock: an eviction, a dead owner's trim or a World stop must not hold it.
    cache = _cuda_ipc_open.OpenCache(2 << 20)
    words = cache.control(os.getpid(), area.fd, area.inode)
    slab = area.lease(0, 10, os.getpid()).slab
    locked = []

    class Storage:
        def __del__(self):
            locked.append(cache._lock.locked())

    me = os.getpid()
    cache.open((me, b"a", 0), 2 << 20, words, slab.slot, slab.ident, Storage)
    cache.open((me, b"b", 0), 2 << 20, words, slab.slot, slab.ident, Storage)  # over 2 MiB: "a" evicted
    assert locked == [False] and cache.stats["evicted"] == 1
    cache.limit = 1 << 30  # (no more evictions)
    cache.open((_dead_pid(), b"c", 0), 1, words, slab.slot, slab.ident, Storage)
    assert cache.forget_dead() == 1 and locked == [False] * 2  # a dead owner's
    _retired(area)
    cache.open((me, b"d", 0), 1, words, slab.slot, -7, Storage)  # "b" retired: dropped first
    assert locked == [False] * 3
    cache.forget_all()
    assert locked == [False] * 4 and len(cache) == 0


def test_gone_openings_are_dropped_before_a_new_one_opens(area):
    # A retired slab's handle is closed first: new memory may come behind the same bytes.
    cache = _cuda_ipc_open.OpenCache(1 << 30)
    words = cache.control(os.getpid(), area.fd, area.inode)
    slab = area.lease(0, 10, os.getpid()).slab
    order = []
    cache.open((os.getpid(), b"a", 0), 2 << 20, words, slab.slot, slab.ident, lambda: order.append("open a"))
    _retired(area)
    cache.open((os.getpid(), b"b", 0), 2 << 20, words, slab.slot, -7,
                  lambda: order.append(f"open b with {len(cache)} opened"))
    assert order == ["open a", "open b with 0 opened"]


def test_a_control_page_of_a_gone_sender_is_named():
    cache = _cuda_ipc_open.OpenCache(1 << 20)
    with pytest.raises(RuntimeError, match="cannot reach the CUDA export area of process"):
        cache.control(_dead_pid(), 3, 1)
    with pytest.raises(RuntimeError, match="was closed"):
        cache.control(os.getpid(), 0, -5)  # descriptor 0 names other memory


def test_a_senders_life_is_read_from_a_pidfd_closed_with_its_control_page(area):
    cache = _cuda_ipc_open.OpenCache(1 << 20)
    fds_before = len(os.listdir("/proc/self/fd"))
    sender = subprocess.Popen(["sleep", "60"], pass_fds=[area.fd])  # holds the page at the same number
    try:
        cache.control(sender.pid, area.fd, area.inode)
        assert cache.alive(sender.pid, area.inode) and (sender.pid, area.inode) in cache._pidfds
        sender.kill()
        deadline = time.monotonic() + 10
        while cache.alive(sender.pid, area.inode):  # (a zombie still: its parent has not reaped it yet)
            assert time.monotonic() < deadline, "the pidfd never told of the SIGKILL"
            time.sleep(0.01)
    finally:
        sender.kill()
        sender.wait(10)
    assert cache.forget_dead() == 0 and cache._pidfds == {}  # closed with the page
    assert len(os.listdir("/proc/self/fd")) == fds_before
    me = os.getpid()
    cache.control(me, area.fd, area.inode)
    assert cache.alive(me, area.inode) and (me, area.inode) in cache._pidfds
    cache.forget_all()
    assert cache._pidfds == {} and len(os.listdir("/proc/self/fd")) == fds_before
    assert cache.alive(me, area.inode) and not cache.alive(_dead_pid(), 1)  # (no pidfd: asked of /proc)


def test_a_pid_reused_by_a_new_sender_is_not_read_as_the_dead_ones(area):
    # Pidfds are kept by (pid, area inode): a dead sender's pidfd under a pid that now runs
    # another process says "dead" for that area only, and its page and pidfd go at the trim.
    cache = _cuda_ipc_open.OpenCache(1 << 20)
    me = os.getpid()
    cache.control(me, area.fd, area.inode)
    dead = subprocess.Popen(["sleep", "60"])
    dead.kill()
    time.sleep(0.2)
    os.close(cache._pidfds[(me, area.inode)])
    cache._pidfds[(me, area.inode)] = os.pidfd_open(dead.pid)  # (a zombie: the pidfd is readable)
    try:
        assert not cache.alive(me, area.inode)  # the old sender of that area: gone
        assert cache.alive(me, area.inode + 1)  # another area of the same pid: asked afresh
        cache.forget_dead()
        assert cache._controls == {} and cache._pidfds == {}  # dropped though the pid runs
    finally:
        dead.wait(10)


def _pidfds_open() -> int:
    count = 0
    for name in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[pidfd]"
    return count


def test_a_live_senders_earlier_area_goes_with_its_page_and_pidfd_once_nothing_reads_it(area):
    # A sender whose World stopped and started again has a new area: kept, its old page and
    # pidfd would pile up at every restart (the sender runs on, so it never "died").
    cache = _cuda_ipc_open.OpenCache(1 << 30)
    me = os.getpid()
    before = _pidfds_open()
    old = cache.control(me, area.fd, area.inode)
    slab = area.lease(0, 10, me).slab
    cache.open((me, b"a", 0), 2 << 20, old, slab.slot, slab.ident, object)  # an opening reads the old page
    restarts = []
    try:
        for _ in range(3):  # the sender's World starts again, three times
            restarts.append(_cuda_ipc_area.ExportArea(16 << 20))
            cache.control(me, restarts[-1].fd, restarts[-1].inode)
            assert cache.forget_dead() == 0
        # The old page stays while its opening reads it; the areas in between go.
        assert list(cache._controls) == [(me, area.inode), (me, restarts[-1].inode)]
        assert list(cache._pidfds) == list(cache._controls)
        _retired(area)  # the opening's slab retires: it goes, and so does its page
        assert cache.forget_dead() == 1
        assert list(cache._controls) == list(cache._pidfds) == [(me, restarts[-1].inode)]
        assert _pidfds_open() == before + 1  # (4 opened, 3 closed)
        assert cache.alive(me, restarts[-1].inode)
    finally:
        cache.forget_all()
        for made in restarts:
            made.close()


def test_a_senders_pidfd_numbered_past_1023_is_still_read(area):
    # select() refuses descriptors from 1024 up; a large process (TensorPipe, many peers) has them.
    cache = _cuda_ipc_open.OpenCache(1 << 20)
    me = os.getpid()
    cache.control(me, area.fd, area.inode)
    high = 1500
    try:
        os.dup2(cache._pidfds[(me, area.inode)], high)
    except OSError:
        pytest.skip("this process may not hold descriptor 1500 (ulimit -n)")
    os.close(cache._pidfds[(me, area.inode)])
    cache._pidfds[(me, area.inode)] = high
    assert cache.alive(me, area.inode)
    cache.forget_all()
    assert cache._pidfds == {}


def test_a_retired_opening_is_closed_before_its_successor_opens_even_when_it_was_found(area):
    cache = _cuda_ipc_open.OpenCache(1 << 30)
    words = cache.control(os.getpid(), area.fd, area.inode)
    slab = area.lease(0, 10, os.getpid()).slab

    class Storage:
        pass

    first = [Storage()]
    old = weakref.ref(first[0])
    key = (os.getpid(), b"a", 0)
    cache.open(key, 2 << 20, words, slab.slot, slab.ident, first.pop)  # (the cache holds it alone)
    _retired(area)  # retired: new memory may come behind the same handle bytes
    seen = []
    cache.open(key, 2 << 20, words, slab.slot, -7, lambda: seen.append(old()) or Storage())
    assert seen == [None]  # the old storage was gone when the new one opened


def test_a_thread_opens_only_after_the_closes_other_threads_began(area):
    # Closes run out of the cache's lock: a slab retired and dropped by thread B must be
    # closed before thread A opens the slab that may have taken its place.
    cache = _cuda_ipc_open.OpenCache(1 << 30)
    words = cache.control(os.getpid(), area.fd, area.inode)
    slab = area.lease(0, 10, os.getpid()).slab
    order = []
    release = threading.Event()

    class Slow:
        def __del__(self):
            release.wait(10)  # (a handle's close waiting for its device)
            order.append("closed a")

    me = os.getpid()
    cache.open((me, b"a", 0), 2 << 20, words, slab.slot, slab.ident, Slow)
    _retired(area)
    trimmer = threading.Thread(target=cache.forget_dead)
    trimmer.start()
    deadline = time.monotonic() + 10
    while cache._closing == 0:
        assert time.monotonic() < deadline
        time.sleep(0.005)
    threading.Timer(0.3, release.set).start()
    cache.open((me, b"b", 0), 2 << 20, words, slab.slot, -7, lambda: order.append("open b"))
    trimmer.join(10)
    assert order == ["closed a", "open b"]


def test_an_opening_waits_for_other_threads_closes_a_bounded_time(area, monkeypatch):
    monkeypatch.setattr(_cuda_ipc_open, "CLOSE_WAIT_S", 0.3)
    cache = _cuda_ipc_open.OpenCache(1 << 30)
    words = cache.control(os.getpid(), area.fd, area.inode)
    slab = area.lease(0, 10, os.getpid()).slab
    release = threading.Event()

    class Stuck:
        def __del__(self):
            release.wait(10)  # (a close whose device never gets there)

    me = os.getpid()
    cache.open((me, b"a", 0), 2 << 20, words, slab.slot, slab.ident, Stuck)
    _retired(area)
    trimmer = threading.Thread(target=cache.forget_dead)
    trimmer.start()
    try:
        deadline = time.monotonic() + 10
        while cache._closing == 0:
            assert time.monotonic() < deadline
            time.sleep(0.005)
        started = time.monotonic()
        with pytest.raises(RuntimeError, match=f"was not closed within .* process {me}'s slab was not opened"):
            cache.open((me, b"b", 0), 2 << 20, words, slab.slot, -7, lambda: pytest.fail("opened"))
        assert time.monotonic() - started < 5
    finally:
        release.set()
        trimmer.join(10)
    assert cache._closing == 0
    assert cache.open((me, b"b", 0), 2 << 20, words, slab.slot, -7, object) is not None


def test_an_opening_let_go_in_a_forked_child_is_never_freed(monkeypatch):
    # torch's deleter of an opened CUDA storage makes CUDA calls, which fail in a forked
    # child, inside a destructor that may not throw: the child would abort at its exit.
    class Storage:
        is_cuda = True

    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    storage = Storage()
    gone = weakref.ref(storage)
    opened = _cuda_ipc_open.Opened(storage, torch.zeros(1, 4, dtype=torch.int64).numpy(), 0, 1)
    del storage, opened
    gc.collect()
    assert gone() is not None  # kept for good: no deleter ran
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    storage = Storage()
    gone = weakref.ref(storage)
    del storage
    _cuda_ipc_open.Opened(gone(), torch.zeros(1, 4, dtype=torch.int64).numpy(), 0, 1)
    gc.collect()
    assert gone() is None  # in a process of its own, freed as usual


def test_a_receiver_without_cuda_refuses_and_does_not_initialise_it():
    reduced = (os.getpid(), 3, 1, 0, 1, 1, 0, b"x" * 64, b"e" * 64, 0, 2 << 20, 20 << 20,
               ((0, (2,), torch.float32, False, False),))
    with pytest.raises(RuntimeError, match="has not initialised CUDA"):
        _cuda_ipc._receive_group(*reduced)
    assert not torch.cuda.is_initialized()


# ------------------------------------------------------------------------ fallbacks
def _fake_cuda(nbytes: int, index: int = 0):
    return SimpleNamespace(device=torch.device("cuda", index), nbytes=nbytes)


def test_a_group_without_room_is_staged_and_counted(monkeypatch, ipc_on):
    class Full:
        fd, inode = 0, 0

        def in_place(self, *a):
            return None

        def lease(self, *a):
            return None

    monkeypatch.setattr(_cuda_ipc, "export_area", lambda: Full())
    before = _cuda_ipc.stats().get("staged_no_room", 0)
    batch = _cuda_ipc.Batch((5, 123))
    refs = [batch.add(_fake_cuda(10)), batch.add(_fake_cuda(20)), batch.add(_fake_cuda(5, index=1))]
    staged = []

    def stage(tensor, pending):
        staged.append(tensor)
        return _cuda_stage.stage_tensor(torch.ones(2), pending)

    assert batch.commit(refs, stage, []) == []
    assert len(staged) == 3 and all(ref.staged is not None for ref in refs)
    assert _cuda_ipc.stats()["staged_no_room"] - before == 3
    back = pickle.loads(pickle.dumps(refs))  # staged refs pickle as staged tensors
    assert all(torch.equal(t, torch.ones(2)) for t in back)


def test_an_export_that_raises_is_staged_and_counted_by_type(monkeypatch, ipc_on):
    class Broken:
        def in_place(self, *a):
            return None

        def lease(self, *a):
            raise RuntimeError("cudaIpcGetMemHandle failed")

    monkeypatch.setattr(_cuda_ipc, "export_area", lambda: Broken())
    batch = _cuda_ipc.Batch((5, 123))
    refs = [batch.add(_fake_cuda(10))]
    batch.commit(refs, lambda tensor, pending: "staged", [])
    assert refs[0].staged == "staged"
    counts = _cuda_ipc.stats()
    assert counts["staged_export_failed"] >= 1 and counts["staged_export_failed:RuntimeError"] >= 1


def test_an_uncommitted_group_refuses_to_pickle():
    batch = _cuda_ipc.Batch((5, 123))
    ref = batch.add(_fake_cuda(10))
    with pytest.raises(RuntimeError, match="before it was committed"):
        pickle.dumps(ref)


def test_a_ref_pickles_its_group_once():
    batch = _cuda_ipc.Batch((5, 123))
    refs = [batch.add(_fake_cuda(10)), batch.add(_fake_cuda(10))]
    batch.groups[0].reduced = (list, ((1, 2),))  # stands in for the copy-out call
    assert pickle.loads(pickle.dumps(refs)) == [1, 2]
    calls = pickle.dumps(refs).count(b"builtins")
    assert calls == 1  # the group's call is written once, then taken from the memo


@pytest.mark.parametrize("kind", ["sparse", "nested", "plain"])
def test_only_strided_unquantized_tensors_are_eligible(kind):
    tensor = {"sparse": lambda: torch.ones(2, 2).to_sparse(), "plain": lambda: torch.ones(2),
              "nested": lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)])}[kind]()
    assert _cuda_ipc.eligible(tensor) is (kind == "plain")


# ------------------------------------------------- the whole path over CPU memory
# The CUDA operations of _cuda_ipc are a handful of named functions; over CPU memory (one
# process, the slab found by its "handle") the rest runs for real: offsets and views,
# the control page through /proc, leases ended by the receiver, pickling.
_HANDLES = {}


class _Event:
    """A stand-in for a CUDA event: complete unless a test holds it (``hold``/``let_go``)."""

    def __init__(self):
        self.recorded = 0
        self._complete = threading.Event()
        self._complete.set()

    def record(self, stream=None):
        self.recorded += 1

    def query(self):
        return self._complete.is_set()

    def synchronize(self):
        assert self._complete.wait(30)

    def hold(self):
        self._complete.clear()

    def let_go(self):
        self._complete.set()


_AFTER_WRITES: list = []  # slabs whose next writer waited for the copies of an unsent message


class _CpuSlab(_FakeSlab):
    events = True  # a test sets False: a slab without an IPC event (the sender synchronises)

    def __init__(self, slot, ident, index, capacity):
        super().__init__(slot, ident, index, capacity)
        self.storage = torch.empty(capacity, dtype=torch.uint8).untyped_storage()
        _HANDLES[self.handle] = self.storage
        if self.events:
            self.ready, self.ready_handle = _Event(), b"e%d" % ident
            _HANDLES[self.ready_handle] = self.ready


@pytest.fixture
def over_cpu(monkeypatch, ipc_on):
    monkeypatch.setattr(_cuda_ipc_area, "Slab", _CpuSlab)
    monkeypatch.setattr(_cuda_ipc.ops, "context_mask", lambda: 1)  # (the probe's device: cuda:0)
    monkeypatch.setattr(_cuda_ipc.ops, "device", lambda index: torch.device("cpu"))
    monkeypatch.setattr(_cuda_ipc.ops, "synchronize", lambda device: None)
    monkeypatch.setattr(_cuda_ipc.ops, "cuda_ready", lambda: True)
    monkeypatch.setattr(_cuda_ipc.ops, "mark_ready", lambda slab: slab.ready.record())
    monkeypatch.setattr(_cuda_ipc.ops, "after_writes", _AFTER_WRITES.append)
    monkeypatch.setattr(_cuda_ipc.ops, "open_event", lambda index, handle: _HANDLES[handle])
    done = _Event()  # every receiver's copies out: complete unless a test holds it
    monkeypatch.setattr(_cuda_ipc.ops, "copies_done", lambda opened, index: done)
    monkeypatch.setattr(_CpuSlab, "done", done, raising=False)
    opened = []

    def open_shared(index, handle, capacity, offset):
        opened.append(handle)
        return _HANDLES[handle]

    monkeypatch.setattr(_cuda_ipc.ops, "open_shared", open_shared)
    yield opened
    _HANDLES.clear()


def test_a_message_crosses_through_one_slab_and_ends_its_lease(over_cpu, monkeypatch):
    copied = []  # (the allocator is told the copies' stream reads them: record_stream)
    monkeypatch.setattr(_cuda_ipc.ops, "copied_here", lambda tensors, index: copied.append(list(tensors)))
    x = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sent = {"a": x, "t": x.t(), "h": x.half()[1:3], "b": x > 5, "i": torch.tensor(7), "e": torch.zeros(0, 4),
            "p": torch.nn.Parameter(torch.ones(3)), "g": torch.ones(2, requires_grad=True),
            "c": torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64), "d": torch.arange(5, dtype=torch.float64),
            "cl": torch.arange(96.0).reshape(2, 3, 4, 4).to(memory_format=torch.channels_last),
            "x": torch.arange(3.0).reshape(3, 1).expand(3, 5), "s": torch.arange(24.0).reshape(4, 6)[:, ::2]}
    opened_before = _cuda_ipc.stats().get("opened_opened", 0)  # (the cache's counts outlive a World's stop)
    batch = _cuda_ipc.Batch((5, os.getpid()))
    memo = {}
    refs = {key: memo.setdefault(id(t), batch.add(t)) for key, t in sent.items()}
    refs["again"] = refs["a"]  # the same tensor twice: one copy, arriving twice
    pending = []
    leases = batch.commit(list(memo.values()), lambda t, p: pytest.fail("staged"), pending)
    assert len(leases) == 1 and pending == []  # one slab for the message; its event, no wait
    area = _cuda_ipc._area
    assert area.lent() == 1 and area._slabs[0].ready.recorded == 1
    data = pickle.dumps(refs)
    assert data.count(b"_receive_group") == 1
    assert len(copied) == 1 and {id(t) for t in copied[0]} == {id(t) for t in sent.values()}
    x.fill_(-1)  # the sender reuses its tensor once the call returned (the copy is in the slab)
    back = pickle.loads(data)
    assert _cuda_ipc.released(10)
    assert area.lent() == 0  # the receiver ended the lease once it had copied out
    for key, tensor in sent.items():
        got = back[key]
        expected = torch.arange(24, dtype=torch.float32).reshape(4, 6) if key == "a" else tensor
        if key == "t":
            expected = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
        if key == "h":
            expected = torch.arange(24, dtype=torch.float32).reshape(4, 6).half()[1:3]
        if key == "b":
            expected = torch.arange(24, dtype=torch.float32).reshape(4, 6) > 5
        assert type(got) is type(tensor) and got.dtype == tensor.dtype and got.shape == tensor.shape, key
        assert torch.equal(got.detach(), expected.detach()), key
        assert got.requires_grad == tensor.requires_grad and got.grad_fn is None, key
        assert got.untyped_storage().data_ptr() != area._slabs[0].storage.data_ptr()  # its own memory
        # A dense one keeps its strides (as a CPU tensor does); any other arrives contiguous.
        assert got.stride() == (tensor.stride() if kept_strides(tensor) else tensor.contiguous().stride()), key
    assert back["t"].stride() == (1, 6) and back["cl"].is_contiguous(memory_format=torch.channels_last)
    assert back["x"].is_contiguous() and back["s"].is_contiguous()  # not dense: contiguous
    assert back["again"] is back["a"]
    assert len(over_cpu) == 1
    assert _cuda_ipc.released(10)
    pickle.loads(pickle.dumps(_cuda_ipc_peers.export([torch.ones(3)], (5, os.getpid()))[0]))
    assert len(over_cpu) == 1  # the opening was cached: the same slab, lent again, is not reopened
    counts = _cuda_ipc.stats()
    assert counts["sent_tensors"] >= 10 and counts["received_tensors"] >= 10 and counts["opened_opened"] == opened_before + 1


def test_kept_strides_are_a_dense_tensors_own_and_none_otherwise():
    x = torch.zeros(4, 6)
    assert kept_strides(x) is None and kept_strides(torch.zeros(0, 3).t()) is None
    assert kept_strides(x.t()) == (1, 6)
    assert kept_strides(torch.zeros(2, 3, 5, 5).to(memory_format=torch.channels_last)) == (75, 1, 15, 3)
    assert kept_strides(torch.zeros(2, 3, 4, 5, 5).to(memory_format=torch.channels_last_3d)) == (300, 1, 75, 15, 3)
    assert kept_strides(torch.zeros(3, 1).expand(3, 4)) is None  # overlapping
    assert kept_strides(x[:, ::2]) is None and kept_strides(x[:, 1:5].t()) is None  # gaps
    assert kept_strides(torch.zeros(4, 1, 6).permute(2, 1, 0)) == (1, 6, 6)  # a size-1 dimension: any stride


def test_a_known_layout_reuses_its_views_on_both_sides_across_inference_mode(over_cpu):
    def send(tensors):
        got = pickle.loads(pickle.dumps(_cuda_ipc_peers.export(tensors, (5, os.getpid()))[0]))
        assert _cuda_ipc.released(10)  # (the slab is FREE again: the next message takes it)
        return got

    failed = _cuda_ipc.stats().get("staged_export_failed", 0)
    with torch.inference_mode():  # the views are made here, and must stay writable outside
        first = send([torch.ones(4, 3), torch.arange(5)])
    assert torch.equal(first[0], torch.ones(4, 3))
    slab = _cuda_ipc._area._slabs[0]
    opened = next(iter(_cuda_ipc._opened._opened.values()))
    made = (dict(slab.views), dict(opened.views))
    assert len(made[0]) == 2 and len(made[1]) == 2
    x = torch.full((4, 3), 2.0)
    got = send([x, torch.arange(5) * 2])
    assert torch.equal(got[0], x) and torch.equal(got[1], torch.arange(5) * 2) and not got[0].is_inference()
    assert all(slab.views[k] is v for k, v in made[0].items())  # the same layout: no new view on either side
    assert all(opened.views[k] is v for k, v in made[1].items())
    for n in range(1, _cuda_ipc.ops.VIEWS_KEPT + 5):  # layouts without end: the set is bounded
        assert torch.equal(send([torch.full((n,), float(n))])[0], torch.full((n,), float(n)))
    assert len(slab.views) <= _cuda_ipc.ops.VIEWS_KEPT and len(opened.views) <= _cuda_ipc.ops.VIEWS_KEPT
    assert _cuda_ipc.stats().get("staged_export_failed", 0) == failed  # every message went through the slab


def test_a_message_never_pickled_whole_hands_its_slab_back(over_cpu):
    # A CUDA tensor beside something no carrier can pickle (a lock): its slab was lent to
    # a receiver that will never take it, and used to stay lent until that receiver died.
    from machinlike._shm import guard

    def committed():
        batch = _cuda_ipc.Batch((5, os.getpid()))
        refs = [batch.add(torch.ones(3))]
        leases = batch.commit(refs, lambda t, p: pytest.fail("staged"), [])
        return refs, [_cuda_ipc.unsent_release(lease) for lease in leases]

    refs, ends = committed()
    parts = guard(((refs, threading.Lock()),), [], ends)
    with pytest.raises(TypeError):
        pickle.dumps(parts)
    area = _cuda_ipc._area
    assert area.lent() == 1
    del parts, refs
    gc.collect()
    assert area.lent() == 0 and area.stats["unsent_released"] == 1
    _AFTER_WRITES.clear()
    refs, ends = committed()  # pickled whole: the receiver ends the lease, not the guard
    slab = area._slabs[0]
    # The unsent message's copies may still be queued (on another thread's stream): the
    # next writer of its slab ordered its own after them, once.
    assert _AFTER_WRITES == [slab] and not slab.unsent
    data = pickle.dumps(guard(((refs, 1),), [], ends))
    gc.collect()
    assert area.lent() == 1 and area.stats["unsent_released"] == 1
    assert torch.equal(pickle.loads(data)[0][0][0], torch.ones(3)) and _cuda_ipc.released(10)
    assert area.lent() == 0 and area._slabs == [slab]


def _held_by_frames(error, opening):
    """What of ``opening`` the frames in ``error``'s traceback and its causes still hold, as
    (function, local) pairs (the test's frame, which caught it, is not asked)."""
    held = []
    while error is not None:
        tb = error.__traceback__
        while tb is not None:
            if not tb.tb_frame.f_code.co_name.startswith("test_"):
                held += [(tb.tb_frame.f_code.co_name, k) for k, v in tb.tb_frame.f_locals.items()
                         if v is opening or v is opening.storage or v is opening.views]
            tb = tb.tb_next
        error = error.__cause__
    return held


@pytest.mark.parametrize("failing", ["view", "event"])
def test_a_failed_receive_leaves_no_reference_to_the_opening_in_its_traceback(monkeypatch, over_cpu, failing):
    # The raised error outlives the receive (a caller keeps it, a remote error carries it):
    # a frame of it holding the peer's slab would keep the handle open past the lease, and
    # free it later from whatever thread drops the error, on that thread's default stream.
    pickle.loads(pickle.dumps(_cuda_ipc_peers.export([torch.ones(3)], (5, os.getpid()))[0]))
    assert _cuda_ipc.released(10)
    opening = next(iter(_cuda_ipc._opened._opened.values()))
    data = pickle.dumps(_cuda_ipc_peers.export([torch.ones(3)], (5, os.getpid()))[0])
    if failing == "view":  # (copying out fails: the frame that raised holds the storage)
        def view(views, storage, *layout):
            raise RuntimeError("CUDA error: out of memory")

        monkeypatch.setattr(_cuda_ipc.ops, "view", view)
    else:  # (opening the slab's event fails: _opening's frame holds the opening)
        opening.ready = None

        def open_event(index, handle):
            raise RuntimeError("CUDA error: invalid resource handle")

        monkeypatch.setattr(_cuda_ipc.ops, "open_event", open_event)
    with pytest.raises(RuntimeError) as raised:
        pickle.loads(data)
    assert _held_by_frames(raised.value, opening) == []
    text = "".join(traceback.format_exception(raised.value))
    assert "CUDA error" in text and "_receive_group" in text  # (the traceback still says where)
    assert _cuda_ipc._area.lent() == 0  # the lease ended


def test_a_slab_being_written_is_not_reclaimed_when_its_taker_dies(monkeypatch, over_cpu):
    """A taker that died while its sender was still writing the slab: another thread's
    lease reclaimed it, a third message was written into it while the first one's copies
    were still being queued, and that message's live receiver read them."""
    dead = _dead_pid()
    area = _cuda_ipc.export_area()
    view = _cuda_ipc.ops.view
    during = []

    def copying(*args):  # the first message is being written: other threads lease meanwhile
        if not during:
            lent = area.lent()  # (reclaims what dead takers held)
            other = area.lease(None, 16, os.getpid())
            during.append((lent, other))
        return view(*args)

    monkeypatch.setattr(_cuda_ipc.ops, "view", copying)
    batch = _cuda_ipc.Batch((5, dead))
    refs = [batch.add(torch.ones(3))]
    (lease,) = batch.commit(refs, lambda t, p: pytest.fail("staged"), [])
    (lent, other), = during
    assert lent == 1 and other.slab is not lease.slab and area.stats["reclaimed"] == 0
    other.area.release(other)
    assert area.lent() == 0 and area.stats["reclaimed"] == 1  # written: its dead taker's lease comes back
    assert area.lease(None, 16, os.getpid()).slab in (lease.slab, other.slab)


def test_ctrl_c_while_a_slab_is_written_ends_its_lease_and_is_raised(monkeypatch, over_cpu):
    """A KeyboardInterrupt during the copies into a slab (not an Exception: the failure
    path missed it) left the lease lent to a live receiver until the World stopped, with
    copies queued after the slab's last ``ready``."""
    batch = _cuda_ipc.Batch((5, os.getpid()))
    refs = [batch.add(torch.ones(3))]

    def interrupted(views, storage, index, start, dtype, shape, strides):
        raise KeyboardInterrupt

    monkeypatch.setattr(_cuda_ipc.ops, "view", interrupted)
    with pytest.raises(KeyboardInterrupt):
        batch.commit(refs, lambda t, p: pytest.fail("staged"), [])
    area = _cuda_ipc._area
    assert area.lent() == 0 and area._slabs[0].unsent  # its next writer waits for what was queued
    assert area._filling == {}


def test_a_send_after_the_worlds_stop_stages_and_makes_no_new_area(over_cpu):
    """A send still in flight when the World stopped made a new export area, whose slabs
    nothing retired until the process exited."""
    _cuda_ipc.export_area()
    _cuda_ipc.close()
    staged = []
    batch = _cuda_ipc.Batch((5, os.getpid()))
    refs = [batch.add(torch.ones(3))]
    assert batch.commit(refs, lambda t, p: staged.append(t) or "staged", []) == []
    assert len(staged) == 1 and _cuda_ipc._area is None
    assert _cuda_ipc.stats()["staged_export_failed:RuntimeError"] >= 1
    _cuda_ipc.configure(64 << 20)  # the next World's
    assert _cuda_ipc.export_area() is _cuda_ipc._area is not None


@pytest.fixture
def live_peer():
    """A live process's pid (a peer whose leases are not taken back as a dead one's)."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield child.pid
    child.kill()
    child.wait(timeout=30)


def test_a_probe_out_of_time_is_asked_again_later_not_staged_for_good(monkeypatch, over_cpu, live_peer):
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    monkeypatch.setattr(_cuda_ipc.ops, "current_index", lambda: None)
    monkeypatch.setattr(_cuda_ipc_peers, "_PROBE_TIMEOUT_S", 0.05)
    outcome = {"probe": "late"}
    asked = []

    def rpc_sync(member, fn, args=(), timeout=None):
        asked.append(fn.__name__)
        if fn.__name__ == "_describe":
            return 77, 1
        if outcome["probe"] == "late":
            time.sleep(timeout)
            raise RuntimeError("RPC ran for more than set timeout (50 ms) and will now be marked with an error")
        raise RuntimeError("the CUDA IPC probe arrived as tensor([0, 0])")  # (the peer's own check)

    monkeypatch.setattr(_cuda_ipc_peers.rpc, "rpc_sync", rpc_sync)
    before = _cuda_ipc.stats()
    peer = live_peer
    assert _cuda_ipc_peers.peer_target("peer", peer) is None
    assert asked == ["_describe", "_probe"]
    assert _cuda_ipc.stats()["staged_probe_unanswered"] == before.get("staged_probe_unanswered", 0) + 1
    # Out of time, the peer may be copying out of it now: it stays lent (the peer ends it).
    area = _cuda_ipc._area
    assert area.lent() == 1
    assert _cuda_ipc._peers["peer"][1] is not None  # asked again later
    outcome["probe"] = "wrong"
    area.reuse_wait = 0  # (the clock stops below: no wait for the lent slab to come back)
    clock = [1e12]
    with monkeypatch.context() as frozen:  # (the clock runs again for the World's stop below)
        frozen.setattr(_cuda_ipc_peers.time, "monotonic", lambda: clock[0])
        # Its last probe is still unread: no new one (each would leave a slab lent).
        assert _cuda_ipc_peers.peer_target("peer", peer) is None
        assert asked[2:] == ["_describe"] and area.stats["slabs_made"] == 1
        assert _cuda_ipc.stats()["staged_probe_unread"] == before.get("staged_probe_unread", 0) + 1
        area.words[area._slabs[0].slot, 0] = _cuda_ipc_area.FREE  # the peer read it at last
        clock[0] += 2 * _cuda_ipc_peers._UNANSWERED_RETRY_S
        assert _cuda_ipc_peers.peer_target("peer", peer) is None
    assert asked[3:] == ["_describe", "_probe"]
    assert _cuda_ipc.stats()["staged_probe_failed"] == before.get("staged_probe_failed", 0) + 1
    assert _cuda_ipc._peers["peer"] == (0, None)  # a probe that arrived wrong: staged for good
    assert area.lent() == 0  # (and its lease ended: the peer is done with it)


def test_a_message_read_after_its_lease_ended_is_refused_by_name(over_cpu):
    batch = _cuda_ipc.Batch((5, os.getpid()))
    refs = [batch.add(torch.ones(3))]
    batch.commit(refs, lambda t, p: pytest.fail("staged"), [])
    data = pickle.dumps(refs)
    assert torch.equal(pickle.loads(data)[0], torch.ones(3))
    assert _cuda_ipc.released(10)
    with pytest.raises(RuntimeError, match="were released before this receiver loaded them"):
        pickle.loads(data)  # a second read of the same lease


def test_a_sender_that_closed_its_area_is_named(over_cpu):
    batch = _cuda_ipc.Batch((5, os.getpid()))
    refs = [batch.add(torch.ones(3))]
    batch.commit(refs, lambda t, p: pytest.fail("staged"), [])
    data = pickle.dumps(refs)
    _cuda_ipc.close()  # the World stopped (its slab, lent to a live receiver, outlives it)
    _cuda_ipc._outliving.sweep(force=True)  # then its process exited: the control page closed
    with pytest.raises(RuntimeError, match="closed it before this receiver loaded its tensors"):
        pickle.loads(data)  # a receiver that never mapped the control page


def test_a_retired_slab_is_named_to_a_receiver_that_mapped_the_page(over_cpu):
    batch = _cuda_ipc.Batch((5, os.getpid()))
    refs = [batch.add(torch.ones(3))]
    batch.commit(refs, lambda t, p: pytest.fail("staged"), [])
    pickle.loads(pickle.dumps(refs))  # maps the control page
    assert _cuda_ipc.released(10)
    batch = _cuda_ipc.Batch((5, os.getpid()))
    refs = [batch.add(torch.ones(3))]
    batch.commit(refs, lambda t, p: pytest.fail("staged"), [])
    data = pickle.dumps(refs)
    later = _one_message(torch.full((3,), 2.0))
    area = _cuda_ipc._area
    area.close()  # the sender's World stopped: what a live receiver was lent outlives it
    assert torch.equal(pickle.loads(data)[0], torch.ones(3)) and _cuda_ipc.released(10)
    area.sweep(force=True)  # then its process exited (the receiver, here the same process, keeps its page)
    with pytest.raises(RuntimeError, match="released before this receiver loaded them"):
        pickle.loads(later)


def _one_message(tensor):
    batch = _cuda_ipc.Batch((5, os.getpid()))
    refs = [batch.add(tensor)]
    assert batch.commit(refs, lambda t, p: pytest.fail("staged"), [])
    return pickle.dumps(refs)


def test_the_lease_ends_only_once_the_receivers_copies_completed(over_cpu):
    data = _one_message(torch.ones(3))
    done = _CpuSlab.done
    done.hold()  # the receiver's copies out are still running on its GPU
    try:
        assert torch.equal(pickle.loads(data)[0], torch.ones(3))
        time.sleep(0.1)
        assert _cuda_ipc._area.lent() == 1 and not _cuda_ipc.released(0.05)
        assert _cuda_ipc.stats()["release_pending"] == 1
    finally:
        done.let_go()
    assert _cuda_ipc.released(10) and _cuda_ipc._area.lent() == 0
    counts = _cuda_ipc.stats()
    assert counts["release_pending"] == 0 and counts["released"] >= 1


def test_a_receiver_waits_for_the_senders_copies_without_a_device_wait(over_cpu):
    data = _one_message(torch.arange(6.0))
    ready = _cuda_ipc._area._slabs[0].ready
    ready.hold()  # the sender's copies into the slab have not run yet
    started = time.monotonic()  # (before the timer starts: a busy machine may run it at once)
    threading.Timer(0.2, ready.let_go).start()
    assert torch.equal(pickle.loads(data)[0], torch.arange(6.0))
    assert time.monotonic() - started >= 0.15  # it waited for them
    assert _cuda_ipc.stats()["ready_waits"] == 1


def test_a_receiver_waiting_for_a_retired_slab_is_told_by_name(over_cpu):
    data = _one_message(torch.ones(3))
    area = _cuda_ipc._area
    slab = area._slabs[0]
    slab.ready.hold()  # copies that never run: the sender stops its World meanwhile

    def stop():
        area.words[slab.slot, 2] = _cuda_ipc_area.RETIRED

    threading.Timer(0.1, stop).start()
    try:
        with pytest.raises(RuntimeError, match="died or stopped its World before its copies were done"):
            pickle.loads(data)
    finally:
        slab.ready.let_go()


def test_a_lease_a_receiver_ended_before_the_copies_in_ran_makes_the_next_writer_wait(monkeypatch, over_cpu):
    # A receiver that gave up waiting for the sender's copies frees the lease: those copies
    # may still be queued (on another thread's stream), so the slab's next writer orders
    # its own after them, once.
    monkeypatch.setattr(_cuda_ipc, "_READY_WAIT_S", 0.05)
    data = _one_message(torch.ones(3))
    area = _cuda_ipc._area
    slab = area._slabs[0]
    slab.ready.hold()
    try:
        with pytest.raises(TimeoutError, match="did not complete within"):
            pickle.loads(data)
    finally:
        slab.ready.let_go()
    assert area.lent() == 0 and area.words[slab.slot, 3] == _cuda_ipc_area.UNSETTLED
    _AFTER_WRITES.clear()
    data = _one_message(torch.full((3,), 2.0))
    assert _AFTER_WRITES == [slab] and area.words[slab.slot, 3] == 0
    assert torch.equal(pickle.loads(data)[0], torch.full((3,), 2.0)) and _cuda_ipc.released(10)
    pickle.loads(_one_message(torch.ones(3)))
    assert _AFTER_WRITES == [slab]  # (a lease its receiver ended after the copies: no wait)
    _cuda_ipc.released(10)


def test_a_slab_without_an_ipc_event_synchronises_the_sender(monkeypatch, over_cpu):
    monkeypatch.setattr(_CpuSlab, "events", False)
    batch = _cuda_ipc.Batch((5, os.getpid()))
    refs = [batch.add(torch.full((4,), 3.0))]
    pending = []
    batch.commit(refs, lambda t, p: pytest.fail("staged"), pending)
    assert pending == [torch.device("cpu")]  # the caller synchronises before sending
    assert torch.equal(pickle.loads(pickle.dumps(refs))[0], torch.full((4,), 3.0))
    assert _cuda_ipc.released(10) and _cuda_ipc._area.lent() == 0


def test_the_releaser_frees_after_a_failed_wait_and_restarts_after_close():
    from machinlike.distributed._calls.cuda_ipc_release import Releaser

    class Broken:
        def synchronize(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

    releaser = Releaser()
    rows = torch.zeros(2, 4, dtype=torch.int64).numpy()
    rows[0, 0], rows[1, 0] = 7, 9
    releaser.put(Broken(), rows[0], 7, 1234)
    assert releaser.drain(10) and rows[0, 0] == 0 and releaser.stats["release_wait_failed"] == 1
    thread = releaser._thread
    assert thread is not None and thread.is_alive()
    assert releaser.close(10) and not thread.is_alive()  # World stop ends the thread
    releaser.put(_Event(), rows[1], 8, 1234)  # a lease that ended otherwise is left alone
    assert releaser.drain(10) and rows[1, 0] == 9 and releaser.stats["released"] == 1
    assert releaser.close(10) and releaser.pending() == 0


def test_the_releaser_holds_nothing_it_waited_on_while_it_waits_for_the_next_lease():
    """What it waited on holds the opening the copies read from: kept until the next lease
    came, a slab evicted or retired meanwhile stayed mapped here (and its handle open)."""
    from machinlike.distributed._calls.cuda_ipc_release import Releaser

    releaser = Releaser()
    rows = torch.zeros(1, 4, dtype=torch.int64).numpy()
    rows[0, 0] = 7
    done = _Event()
    held = weakref.ref(done)
    releaser.put(done, rows[0], 7, 1234)
    del done
    assert releaser.drain(10) and rows[0, 0] == 0
    assert held() is None  # (the thread now waits for the next lease, holding nothing)
    assert releaser.close(10)


def test_a_commit_whose_later_device_fails_to_stage_ends_the_leases_it_took(monkeypatch, over_cpu):
    batch = _cuda_ipc.Batch((5, os.getpid()))
    refs = [batch.add(torch.full((4,), 3.0))]  # (a CPU tensor: "device" None, over_cpu's slabs)
    other = batch.groups[1] = _cuda_ipc._Group(1)  # a second device, with no room
    other.tensors.append(torch.ones(2))
    refs.append(_cuda_ipc._Ref(other, 0))
    fill = _cuda_ipc.Batch._fill
    monkeypatch.setattr(_cuda_ipc.Batch, "_fill", lambda self, group: None if group.index == 1 else fill(self, group))

    def stage(tensor, pending):
        raise RuntimeError("CUDA error: out of memory (pinned staging buffer)")

    with pytest.raises(RuntimeError, match="out of memory"):
        batch.commit(refs, stage, [])
    assert _cuda_ipc._area.lent() == 0  # before: the first device's slab stayed lent until World stop


def test_a_forked_child_keeps_its_parents_openings_alive_and_starts_afresh(over_cpu, monkeypatch):
    """Dropped in the child, the parent's opened slabs would run torch's deleter, whose CUDA
    calls fail in a forked child inside a destructor that may not throw: the child aborted."""
    from machinlike.distributed._calls import cuda_settle

    late = object()  # a probe's lease still lent: the peers module keeps its own inherited record
    monkeypatch.setitem(_cuda_ipc_peers._late, ("peer", 1), late)

    data = _one_message(torch.ones(3))
    assert torch.equal(pickle.loads(data)[0], torch.ones(3)) and _cuda_ipc.released(10)
    cache, area = _cuda_ipc._opened, _cuda_ipc._area
    assert cache is not None and len(cache) == 1
    cuda_settle.noted(0)
    outliving = _cuda_ipc._outliving  # (the child's own: its sweeps would retire rows of the parent's page)
    read, write = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (fork with threads: the child only reports)
        pid = os.fork()
    if pid == 0:  # the child: report, then leave without running anything of the test's
        try:
            kept = _cuda_ipc._inherited[-1]
            probes = _cuda_ipc_peers._inherited[-1]
            ok = (kept[0] is area and kept[1] is cache and len(cache) == 1 and _cuda_ipc._opened is None
                  and _cuda_ipc._area is None and not cuda_settle.devices()
                  and kept[3] is outliving and _cuda_ipc._outliving is not outliving
                  and probes[0][("peer", 1)] is late and not _cuda_ipc_peers._late)
            os.write(write, b"ok" if ok else repr((kept, probes, _cuda_ipc._opened, cuda_settle.devices())).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        said = pipe.read()
    assert os.waitpid(pid, 0)[1] == 0 and said == b"ok", said
    assert _cuda_ipc._opened is cache and len(cache) == 1 and 0 in cuda_settle.devices()  # the parent's, as they were


def test_a_flush_waits_for_one_owners_leases_only_and_for_no_longer_than_its_bound():
    from machinlike.distributed._calls.cuda_ipc_release import Releaser

    releaser = Releaser()
    rows = torch.zeros(2, 4, dtype=torch.int64).numpy()
    rows[0, 0], rows[1, 0] = 7, 8
    copies = _Event()
    copies.hold()  # the copies out of owner 100's slab are still running
    releaser.put(copies, rows[0], 7, 100)
    assert releaser.flush(200, 10) and releaser.stats["flush_waits"] == 0  # nothing of 200's: at once
    started = time.monotonic()
    assert not releaser.flush(100, 0.05)  # bounded: the call goes on, the sender may make a slab
    assert time.monotonic() - started < 5 and releaser.stats["flush_late"] == 1 and rows[0, 0] == 7
    threading.Timer(0.05, copies.let_go).start()
    assert releaser.flush(100, 10) and rows[0, 0] == 0  # FREE before the caller goes on
    assert releaser.stats["flush_waits"] == 2 and releaser._by_owner == {}  # (nothing kept per owner)
    releaser.put(_Event(), rows[1], 8, 100)
    assert releaser.drain(10) and releaser._by_owner == {}
    assert releaser.close(10)


def test_a_call_ends_the_leases_of_the_callees_slabs_before_it_is_sent(monkeypatch, over_cpu):
    """A puller that calls its server again at once: the server finds its last slab FREE
    (before, it was often still lent, and the server made a second one after 10 ms)."""
    from machinlike.distributed._calls import cuda_ipc_release

    monkeypatch.setattr(cuda_ipc_release, "FLUSH_S", 10.0)  # (the copies below end after 50 ms)
    data = _one_message(torch.ones(3))  # a reply from the "server" (this process's pid)
    done = _CpuSlab.done
    done.hold()  # the puller's copies out of it are still running
    try:
        assert torch.equal(pickle.loads(data)[0], torch.ones(3))
        assert _cuda_ipc._area.lent() == 1
        threading.Timer(0.05, done.let_go).start()
        out = _cuda_stage.outgoing(("pull", (), {}), 1 << 20, (5, os.getpid()))  # the next call
        assert _cuda_ipc._area.lent() == 0  # ended before the call left
        assert _cuda_ipc.stats()["flush_waits"] == 1 and out[0] == "pull"
        done.hold()
        pickle.loads(_one_message(torch.ones(2)))
        _cuda_stage.outgoing(("pull", (), {}), 1 << 20, (5, os.getpid() + 1))  # another callee: no wait
        assert _cuda_ipc._area.lent() == 1 and _cuda_ipc.stats()["flush_waits"] == 1
        # A call that sends CUDA tensors through IPC (here: the walk says it lent a slab)
        # does not wait: the callee reads them after this process's copies out ran.
        monkeypatch.setattr(_cuda_stage, "_encode", lambda obj, threshold, ipc: (obj, [], [lambda: None]))
        _cuda_stage.outgoing(("push", (1,), {}), 1 << 20, (5, os.getpid()))
        assert _cuda_ipc._area.lent() == 1 and _cuda_ipc.stats()["flush_waits"] == 1
    finally:
        done.let_go()
    assert _cuda_ipc.released(10)


def _loopback(monkeypatch, mangle=None):
    """rpc_sync to a peer that is this very process: arguments and result pickled both ways."""
    calls = []

    def rpc_sync(member, fn, args=(), timeout=None):
        calls.append(fn.__name__)
        args = pickle.loads(pickle.dumps(args))
        out = fn(*args)
        data = pickle.dumps(out)
        return pickle.loads(mangle(data) if mangle else data)

    monkeypatch.setattr(_cuda_ipc_peers.rpc, "rpc_sync", rpc_sync)
    return calls


def test_the_probe_crosses_both_ways_and_the_verdict_is_kept(monkeypatch, over_cpu):
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    monkeypatch.setattr(_cuda_ipc.ops, "current_index", lambda: 0)
    calls = _loopback(monkeypatch)
    peer = os.getpid() + 1  # (a pid that is not ours: the verdict is about the member name)
    assert _cuda_ipc_peers.peer_target("peer", peer) == (77, peer)
    assert calls == ["_describe", "_probe"]
    assert _cuda_ipc_peers.peer_target("peer", peer) == (77, peer) and len(calls) == 2  # kept
    assert _cuda_ipc.released(10)
    assert _cuda_ipc._area.lent() == 0  # both probe leases ended by their receivers
    packed = _cuda_ipc.terms(1 << 20, (77, peer))
    assert _cuda_ipc.reply_target(packed) is None  # (the caller is this process: never to itself)


def test_the_probe_runs_where_both_sides_have_a_context_within_one_bound(monkeypatch, over_cpu):
    # A tensor-free call from a process on cuda:0 to one on cuda:1 must not give the callee
    # a context on cuda:0 (hundreds of MiB), and the two round trips share one bound.
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    monkeypatch.setattr(_cuda_ipc.ops, "current_index", lambda: 0)
    monkeypatch.setattr(_cuda_ipc.ops, "context_mask", lambda: 0b011)  # here: cuda:0 and cuda:1
    monkeypatch.setattr(_cuda_ipc_peers, "_PROBE_TIMEOUT_S", 5.0)
    devices, timeouts = [], []
    monkeypatch.setattr(_cuda_ipc.ops, "device", lambda index: devices.append(index) or torch.device("cpu"))
    calls = _loopback(monkeypatch)
    real = _cuda_ipc_peers.rpc.rpc_sync

    def rpc_sync(member, fn, args=(), timeout=None):
        timeouts.append(timeout)
        if fn.__name__ == "_describe":
            time.sleep(0.3)  # (a slow first answer: the probe gets what is left)
            return 77, 0b110  # there: cuda:1 and cuda:2
        return real(member, fn, args, timeout)

    monkeypatch.setattr(_cuda_ipc_peers.rpc, "rpc_sync", rpc_sync)
    peer = os.getpid() + 1
    assert _cuda_ipc_peers.peer_target("peer", peer) == (77, peer)
    assert calls == ["_probe"] and devices[0] == 1  # the probe's tensor: on cuda:1, not this thread's cuda:0
    assert timeouts[0] == 5.0 and 0 < timeouts[1] <= 4.75  # one bound for both round trips
    assert _cuda_ipc.released(10) and _cuda_ipc._area.lent() == 0


def test_a_first_calls_probe_ends_by_the_calls_own_deadline(monkeypatch, ipc_on):
    # A call with timeout=0.3 must not wait 5 s (or, before, 10) for its peer's first answers.
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    asked = []
    monkeypatch.setattr(_cuda_ipc_peers.rpc, "rpc_sync", lambda member, fn, args=(), timeout=None:
                        asked.append(timeout) or (0, 0))
    assert _cuda_ipc_peers.peer_target("peer", os.getpid() + 1, time.monotonic() + 0.3) is None
    assert len(asked) == 1 and 0 < asked[0] <= 0.3
    assert _cuda_ipc_peers.peer_target("late", os.getpid() + 1, time.monotonic() - 1) is None
    assert len(asked) == 1 and "late" not in _cuda_ipc._peers  # no time: not asked, no verdict


def test_a_peer_sharing_no_context_is_asked_again_less_and_less_often(monkeypatch, ipc_on):
    # A CPU-only actor called by a learner on a GPU: asked again after 2, 4, 8 ... 60 s,
    # not every 2 s for ever (each question a round trip in a user's call).
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    clock = [1000.0]
    monkeypatch.setattr(_cuda_ipc_peers.time, "monotonic", lambda: clock[0])
    asked = []
    monkeypatch.setattr(_cuda_ipc_peers.rpc, "rpc_sync", lambda member, fn, args=(), timeout=None:
                        asked.append(fn.__name__) or (0, 0))
    waits = []
    for _ in range(8):
        assert _cuda_ipc_peers.peer_target("actor", os.getpid() + 1) is None
        waits.append(_cuda_ipc._peers["actor"][1] - clock[0])
        clock[0] += waits[-1]
    assert waits == [2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0, 60.0] and len(asked) == 8
    _cuda_ipc_peers._note_peer("actor", 0, None)  # a final verdict forgets the wait
    assert "actor" not in _cuda_ipc_peers._waits


def test_a_probe_that_cannot_be_made_here_fails_no_call(monkeypatch, over_cpu):
    # A full device (out of memory making the probe's tensor) must not fail a call that
    # carries no tensor at all: it stages, and the peer is asked again later.
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    monkeypatch.setattr(_cuda_ipc.ops, "current_index", lambda: 0)
    calls = _loopback(monkeypatch)

    def full(index):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 MiB")

    monkeypatch.setattr(_cuda_ipc.ops, "device", full)
    assert _cuda_ipc_peers.peer_target("peer", os.getpid() + 1) is None
    assert calls == ["_describe"] and _cuda_ipc._peers["peer"][1] is not None


def test_a_verdict_another_thread_reached_meanwhile_is_not_probed_again(monkeypatch, over_cpu):
    # Thread A proves the peer while thread B waits for its own answer to _describe; B must
    # take A's verdict, not probe again (a late or failed second probe would undo it).
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    monkeypatch.setattr(_cuda_ipc.ops, "current_index", lambda: 0)
    calls = []

    def rpc_sync(member, fn, args=(), timeout=None):
        calls.append(fn.__name__)
        _cuda_ipc_peers._note_peer(member, 77, None)  # (A's probe ended meanwhile)
        return 77, 1

    monkeypatch.setattr(_cuda_ipc_peers.rpc, "rpc_sync", rpc_sync)
    peer = os.getpid() + 1
    assert _cuda_ipc_peers.peer_target("peer", peer) == (77, peer) and calls == ["_describe"]


def test_a_probe_that_fails_stages_for_good_and_ends_its_lease(monkeypatch, over_cpu, caplog):
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    monkeypatch.setattr(_cuda_ipc.ops, "current_index", lambda: 0)

    def broken(member, fn, args=(), timeout=None):
        if fn.__name__ == "_describe":
            return 77, 1
        raise RuntimeError("cudaIpcOpenMemHandle failed: invalid device context")

    monkeypatch.setattr(_cuda_ipc_peers.rpc, "rpc_sync", broken)
    before = _cuda_ipc.stats()
    with caplog.at_level("WARNING", logger=_cuda_ipc_peers.log.name):
        assert _cuda_ipc_peers.peer_target("peer", os.getpid() + 1) is None
    records = [r.getMessage() for r in caplog.records if r.name == _cuda_ipc_peers.log.name]
    counts = _cuda_ipc.stats()
    assert counts["staged_probe_failed"] == before.get("staged_probe_failed", 0) + 1
    assert counts["staged_probe_failed:RuntimeError"] == before.get("staged_probe_failed:RuntimeError", 0) + 1
    # Said once, with the cause: the first run on a new machine must not stage in silence.
    assert len(records) == 1 and "peer" in records[0] and "cudaIpcOpenMemHandle failed" in records[0]
    assert "cuda_ipc_cache_bytes=0" in records[0]
    assert _cuda_ipc._area.lent() == 0  # the call is over: the caller took its lease back
    assert _cuda_ipc._area._slabs[0].unsent  # (the probe's copies may be queued: its next writer waits)


@pytest.mark.parametrize("side", ["caller", "callee"])
def test_a_probe_that_travelled_staged_proves_nothing(monkeypatch, over_cpu, side):
    # An export that fails stages its tensor; the probe still arrives equal, but no handle
    # was opened: the peer must not be taken for one that receives through IPC.
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    monkeypatch.setattr(_cuda_ipc.ops, "current_index", lambda: 0)
    calls = _loopback(monkeypatch)
    exports = []
    real_fill = _cuda_ipc.Batch._fill

    def fill(self, group):  # the caller's export is the first, the callee's the second
        exports.append(side)
        if (side == "caller") == (len(exports) == 1):
            raise_in = _cuda_ipc_area.ExportArea.lease
            monkeypatch.setattr(_cuda_ipc_area.ExportArea, "lease", lambda *a: (_ for _ in ()).throw(
                RuntimeError("CUDA error: invalid argument")))
            try:
                return real_fill(self, group)
            finally:
                monkeypatch.setattr(_cuda_ipc_area.ExportArea, "lease", raise_in)
        return real_fill(self, group)

    monkeypatch.setattr(_cuda_ipc.Batch, "_fill", fill)
    peer = os.getpid() + 1
    before = _cuda_ipc.stats()
    assert _cuda_ipc_peers.peer_target("peer", peer) is None
    counts = {k: v - before.get(k, 0) for k, v in _cuda_ipc.stats().items()}
    # Either side: asked again later, not staged for good (no room in an area at that
    # moment, or a full device, is not a peer that cannot receive through IPC).
    assert calls == (["_describe"] if side == "caller" else ["_describe", "_probe"])
    assert counts["staged_probe_not_exported"] == 1 and counts.get("staged_probe_failed", 0) == 0
    assert _cuda_ipc._peers["peer"][0] == 0 and _cuda_ipc._peers["peer"][1] is not None
    assert _cuda_ipc.released(10) and _cuda_ipc._area.lent() == 0


def test_waiting_for_a_senders_copies_is_bounded_and_names_the_sender():
    from machinlike.distributed._calls.cuda_ipc_release import await_ready

    class Broken:
        def query(self):
            raise RuntimeError("CUDA error: invalid resource handle")

    row = torch.zeros(4, dtype=torch.int64).numpy()
    row[2] = 5
    with pytest.raises(RuntimeError, match=r"process 123's CUDA copies are done \(has it died\?\)"):
        await_ready(Broken(), 123, row, 5, 1.0)
    never = _Event()
    never.hold()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match=f"process {os.getpid()} \\(alive\\) did not complete within"):
        await_ready(never, os.getpid(), row, 5, 0.1)  # a live sender whose GPU never gets there
    assert time.monotonic() - started < 5
    with pytest.raises(RuntimeError, match="died or stopped its World"):
        await_ready(never, _dead_pid(), row, 5, 30.0)
    sender = subprocess.Popen(["sleep", "60"])  # a live sender SIGKILLed while the receiver waits
    try:
        started = time.monotonic()  # (before the timer starts: a busy machine may run it at once)
        threading.Timer(0.3, sender.kill).start()
        with pytest.raises(RuntimeError, match=f"process {sender.pid}, which sent CUDA tensors .* died"):
            await_ready(never, sender.pid, row, 5, 30.0)
        assert 0.25 <= time.monotonic() - started < 5  # told at once, not at the bound
    finally:
        sender.kill()
        sender.wait(10)
    assert await_ready(_Event(), os.getpid(), row, 5, 1.0) is False  # done at once: no wait
    # "Done" from a sender that is gone is not believed: CUDA leaves the event of a process
    # SIGKILLed with its copies queued undefined, and the slab may never have been written.
    with pytest.raises(RuntimeError, match=f"process {sender.pid}, which sent CUDA tensors .* died"):
        await_ready(_Event(), sender.pid, row, 5, 30.0)
    asked = []
    with pytest.raises(RuntimeError, match="died or stopped its World"):
        await_ready(_Event(), os.getpid(), row, 5, 30.0, lambda pid: asked.append(pid) or False)
    assert asked == [os.getpid()]  # the receiver's own answer (its cache's pidfd), not /proc's
    row[2] = 6  # the sender retired the slab
    with pytest.raises(RuntimeError, match="died or stopped its World"):
        await_ready(_Event(), os.getpid(), row, 5, 30.0)


# ------------------------------------------------------------------ the caller's stream
class _Stream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.waited_for: list = []

    def wait_stream(self, other: "_Stream") -> None:
        self.waited_for.append(other.name)


def test_a_result_is_ordered_on_the_callers_own_stream_and_costs_nothing_elsewhere(monkeypatch):
    """What arrives on a GPU was copied on the reader thread's default stream: the caller's
    current stream must wait for it when it is another one (cuda_settle). Over fake streams:
    which stream waits for which, and that nothing is asked of CUDA before a receive."""
    from machinlike.distributed._calls import cuda_settle, staging

    asked: list = []
    current = {0: _Stream("side0"), 1: _Stream("default1")}
    default = {0: _Stream("default0"), 1: current[1]}
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: asked.append(device.index) or current[device.index])
    monkeypatch.setattr(torch.cuda, "default_stream", lambda device: default[device.index])
    cuda_settle.settle()
    assert asked == []  # a process that received no CUDA tensor asks nothing of CUDA
    cuda_settle.noted(0)
    cuda_settle.noted(1)
    cuda_settle.noted(0)
    assert cuda_settle.settled("result") == "result"
    assert current[0].waited_for == ["default0"]  # a stream of the caller's own waits
    assert current[1].waited_for == []  # the default stream is already in order
    assert sorted(asked) == [0, 1]
    # A staged tensor that lands on a GPU is noted too (its copy runs on the same stream).
    monkeypatch.setattr(cuda_settle, "_devices", set())
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.Tensor, "to", lambda self, device: self)
    staging._land(torch.ones(2), 1, False, False)
    assert cuda_settle.devices() == {1}


# ------------------------------------------------------------------ pinned states
@pytest.fixture
def pinned(over_cpu, monkeypatch):
    """``over_cpu`` with each opening its own storage over the slab's memory, as another
    process's would be (the sender's use count of a slab's storage is its own)."""
    import ctypes

    def open_shared(index, handle, capacity, offset):
        memory = (ctypes.c_uint8 * capacity).from_address(_HANDLES[handle].data_ptr())
        return torch.frombuffer(memory, dtype=torch.uint8).untyped_storage()

    monkeypatch.setattr(_cuda_ipc.ops, "open_shared", open_shared)
    from machinlike.distributed._calls.cuda_ipc_pin import PinnedStates

    return PinnedStates


def _pull(tensors):
    """One message of ``tensors`` (a pull's reply), pickled."""
    batch = _cuda_ipc.Batch((5, os.getpid()))
    refs = [batch.add(t) for t in tensors]
    assert batch.commit(refs, lambda t, p: pytest.fail("staged"), [])
    return pickle.dumps(refs)


def test_a_pinned_state_is_read_in_place_and_rewritten_only_once_nobody_holds_it(pinned, monkeypatch):
    copied = []
    monkeypatch.setattr(_cuda_ipc.ops, "copied_here", lambda tensors, index: copied.append(len(tensors)))
    pool = pinned(most=2)
    first = pool.adopt("m", [torch.arange(6.0), torch.ones(2, 3)])
    assert copied == [2]  # the allocator is told the copies' stream reads the pushed tensors
    area = _cuda_ipc._area
    slab = area._slabs[0]
    assert slab.ready.recorded == 1 and area.stats["pinned"] == 1 and area.lent() == 0
    assert all(v.untyped_storage().data_ptr() == slab.storage.data_ptr() for v in first)
    _CpuSlab.done.hold()  # the receivers' copies out are still running
    try:
        pulls = [_pull(first) for _ in range(3)]
        assert slab.ready.recorded == 1 and len(area._slabs) == 1  # no copy, no slab of their own
        assert area.lent() == 3 and area.stats["shared"] == 3 and area.readers(slab) == 3
        for got in map(pickle.loads, pulls):
            assert torch.equal(got[0], torch.arange(6.0)) and torch.equal(got[1], torch.ones(2, 3))
            assert got[0].untyped_storage().data_ptr() != slab.storage.data_ptr()  # the receiver's own
        del first, pulls, got  # the chain dropped the version; its readers still copy out
        second = pool.adopt("m", [torch.zeros(6), torch.zeros(2, 3)])
        assert second[0].untyped_storage().data_ptr() != slab.storage.data_ptr()  # not rewritten under them
        assert pool.adopt("m", [torch.zeros(6), torch.zeros(2, 3)]) is None  # both held, no third: left as it is
    finally:
        _CpuSlab.done.let_go()
    assert _cuda_ipc.released(10) and area.lent() == 0
    _AFTER_WRITES.clear()
    third = pool.adopt("m", [torch.full((6,), 3.0), torch.zeros(2, 3)])
    assert third[0].untyped_storage().data_ptr() == slab.storage.data_ptr()  # read by nobody: rewritten
    assert _AFTER_WRITES == [slab]  # after the first version's copies in (maybe on another stream)
    assert slab.ready.recorded == 2 and area.stats["slabs_made"] == 2 and pool.held() == 2
    assert torch.equal(pickle.loads(_pull(third))[0], torch.full((6,), 3.0))
    pool.close()


def test_a_pinned_slab_goes_back_only_after_its_last_copies_in(pinned):
    # Memory back with the allocator goes to the next tensor of the stream it was made on;
    # copies into it still queued on another thread's stream would overwrite that tensor.
    from machinlike.distributed._calls import cuda_ipc_pin

    pool = pinned(most=8)
    held = [pool.adopt("m", [torch.ones(4)]) for _ in range(2 + cuda_ipc_pin._SPARE)]
    slabs = list(_cuda_ipc._area._slabs)
    assert len(slabs) == 4 and all(slab.writes_settled == 0 for slab in slabs)
    del held  # all four free: the next push rewrites one, keeps _SPARE and gives the last back
    assert pool.adopt("m", [torch.zeros(4)]) is not None and pool.held() == 1 + cuda_ipc_pin._SPARE
    assert [slab.writes_settled for slab in slabs] == [0, 0, 0, 1]
    pool.close()
    assert [slab.writes_settled for slab in slabs] == [1, 1, 1, 1]


def test_a_pinned_slab_whose_copies_in_never_run_keeps_its_memory_when_unpinned(pinned, monkeypatch):
    monkeypatch.setattr(torch.UntypedStorage, "_release_ipc_counter_cuda", lambda *counter: None, raising=False)
    pool = pinned()
    state = pool.adopt("m", [torch.ones(4)])
    area = _cuda_ipc._area
    slab = area._slabs[0]
    slab.stuck = True  # its copies in sit behind a stuck collective
    del state
    pool.close()  # the unpin's wait ends at its bound; retiring it waits once more, then parks it
    assert slab.writes_settled == 2 and slab.storage is None and area.stats["settle_timed_out"] == 1
    assert area.held_bytes() == slab.capacity  # still counted: its memory is not the allocator's yet
    slab.stuck = False
    assert area.lent() == 0 and area.held_bytes() == 0


def test_only_a_whole_contiguous_state_of_one_pinned_slab_is_read_in_place(pinned, monkeypatch):
    pool = pinned()
    state = pool.adopt("m", [torch.arange(6.0).reshape(2, 3)])
    area = _cuda_ipc._area
    me = os.getpid()
    assert area.in_place([state[0].t()], me) is None  # a layout a reader would not rebuild
    assert area.in_place([state[0], torch.ones(3)], me) is None  # one tensor of the message elsewhere
    assert area.in_place([torch.ones(3)], me) is None
    taken = [area.in_place(state, me) for _ in range(_cuda_ipc_area.ROWS - _cuda_ipc_area.SLOTS)]
    assert all(taken) and area.in_place(state, me) is None and area.stats["no_reader_row"] == 1
    synced = []
    monkeypatch.setattr(_cuda_ipc.ops, "synchronize", synced.append)
    got = pickle.loads(_pull(state))  # (no reader row: copied into a slab of its own)
    assert torch.equal(got[0], torch.arange(6.0).reshape(2, 3)) and len(area._slabs) == 2
    # That copy read the pinned slab: done before the message let the state go, since a push
    # on another thread's stream may rewrite it then (record_stream skips exported memory).
    assert synced == [torch.device("cpu")]
    assert pickle.loads(_pull([torch.ones(3)])) and synced == [torch.device("cpu")]  # others: no wait
    pool.close()


def test_a_dead_readers_row_is_taken_back(pinned):
    pool = pinned(most=1)
    state = pool.adopt("m", [torch.ones(4)])
    area = _cuda_ipc._area
    lease = area.share(area._slabs[0], _dead_pid())  # a puller SIGKILLed before copying out
    assert area.words[lease.row, 0] == lease.ident and area.stats["reclaimed"] == 0
    del state
    assert pool.adopt("m", [torch.zeros(4)]) is not None  # its row taken back: the slab is rewritten
    assert area.lent() == 0 and area.stats["reclaimed"] == 1 and area.stats["slabs_made"] == 1
    pool.close()


def test_an_unpinned_slab_is_retired_once_read_and_never_lent(pinned):
    pool = pinned()
    state = pool.adopt("m", [torch.ones(4)])
    area = _cuda_ipc._area
    slab = area._slabs[0]
    lease = area.share(slab, os.getpid())  # a live reader
    pool.close()
    assert slab in area._slabs and area.share(slab, os.getpid()) is None  # read still; no new readers
    assert area.lease(None, 16, os.getpid()).slab is not slab  # never lent to a message
    area.words[lease.row, 0] = _cuda_ipc_area.FREE  # the reader copied out
    assert area.readers(slab) == 0 and slab not in area._slabs
    assert area.words[slab.slot, 2] == _cuda_ipc_area.RETIRED
    assert torch.equal(state[0], torch.ones(4))  # the state keeps its memory


def test_a_pool_closed_after_its_area_closes_quietly(pinned):
    pool = pinned()
    state = pool.adopt("m", [torch.ones(4)])
    area = _cuda_ipc._area
    slab = area._slabs[0]
    _cuda_ipc.close()  # the World stopped first: every slab retired, pinned ones included
    assert slab.storage is None and area.share(slab, os.getpid()) is None
    # Its last copies in may still be queued on the pushing thread's stream: retired, it
    # waited for them first (its memory goes back to the allocator once the state goes).
    assert slab.writes_settled == 1 and area.stats["retire_waits"] == 1
    pool.close()  # (raised AttributeError on the retired slab)
    assert pool.held() == 0 and torch.equal(state[0], torch.ones(4))  # the state keeps its memory


def test_a_model_servers_pool_pins_its_large_cuda_tensors(pinned, monkeypatch):
    from machinlike.server import _state_pool

    # (CPU tensors stand in for CUDA ones: float64 plays "on cuda:0")
    monkeypatch.setattr(_state_pool, "_gpu_index", lambda t: 0 if t.dtype == torch.float64 else None)
    pool = _state_pool.StatePool()
    big = torch.arange(float(_state_pool.SHARE_FROM // 8), dtype=torch.float64)
    state = pool("m", {"w": big, "b": torch.ones(3, dtype=torch.float64), "n": 7, "c": torch.ones(3)})
    slab = _cuda_ipc._area._slabs[0]
    assert pool.pinned() == 1 and state["n"] == 7 and torch.equal(state["w"], big)
    assert state["w"].untyped_storage().data_ptr() == state["b"].untyped_storage().data_ptr() == slab.storage.data_ptr()
    assert torch.equal(pickle.loads(_pull([state["w"], state["b"]]))[0], big)
    small = pool("s", {"w": torch.ones(3, dtype=torch.float64)})  # under SHARE_FROM: left as it is
    assert pool.pinned() == 1 and small["w"].untyped_storage().data_ptr() != slab.storage.data_ptr()
    pool.close()
    assert pool.pinned() == 0


def test_pinned_slabs_take_half_the_area_at_most_and_a_failed_pin_leaves_the_state_as_it_is(pinned, monkeypatch):
    pool = pinned()
    area = _cuda_ipc.export_area()  # (64 MiB: ipc_on)
    assert area.pin(None, 20 << 20) is not None
    assert area.pin(None, 14 << 20) is None and area.stats["no_room"] == 1  # 34 MiB > 32: messages keep room
    assert area.lease(None, 30 << 20, os.getpid()) is not None  # (32 MiB: a message's slab still fits)
    area.limit = 1 << 40  # and half the slab rows at most, whatever their size
    assert all(area.pin(None, 1) for _ in range(_cuda_ipc_area.SLOTS // 2 - 1))
    assert area.pin(None, 1) is None and area.lease(None, 1, os.getpid()) is not None

    def refused(*a):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(_cuda_ipc_area.ExportArea, "pin", refused)
    assert pool.adopt("m", [torch.ones(4)]) is None and pool.held() == 0


def test_a_ring_gives_back_what_a_burst_of_slow_readers_left(pinned):
    pool = pinned(most=8)
    _CpuSlab.done.hold()  # slow readers: each version is still read when the next comes
    try:
        for n in range(6):
            pickle.loads(_pull(pool.adopt("m", [torch.full((4,), float(n))])))
        area = _cuda_ipc._area
        assert pool.held() == 6 and area.stats["slabs_retired"] == 0
    finally:
        _CpuSlab.done.let_go()
    assert _cuda_ipc.released(10)
    state = pool.adopt("m", [torch.ones(4)])  # one rewritten, two kept free, three given back
    assert pool.held() == 3 and area.stats["slabs_retired"] == 3 and area.stats["slabs_made"] == 6
    assert torch.equal(pickle.loads(_pull(state))[0], torch.ones(4))
    pool.close()


def test_a_push_racing_the_worlds_stop_keeps_its_state_instead_of_raising(pinned, monkeypatch):
    """``adopt`` checked that the path was on, then the World stopped: the area it asked
    for raised out of a model server's push, and a ring's slab retired under the push was
    read as free (its storage gone)."""
    pool = pinned()
    assert pool.adopt("m", [torch.ones(4)]) is not None
    slab = _cuda_ipc._area._slabs[0]
    _cuda_ipc.close()
    _cuda_ipc.configure(64 << 20)  # (the path reads as on: the stop raced the check)
    assert slab.storage is None
    with monkeypatch.context() as off:
        off.setattr(_cuda_ipc, "export_area", lambda: (_ for _ in ()).throw(RuntimeError("the path is off")))
        assert pool.adopt("m", [torch.ones(4)]) is None
    from machinlike.distributed._calls.cuda_ipc_pin import _Pinned

    entry = _Pinned.__new__(_Pinned)
    entry.slab = slab
    assert entry.free() is False  # retired: never written again


def test_a_push_still_running_as_its_server_closes_pins_nothing(pinned):
    # The server's close does not wait for a push already in its service: a slab pinned
    # after the pool closed stayed pinned (its memory, a slot, its share of the area's
    # pinning budget) until the World stopped, nothing left to unpin it.
    pool = pinned()
    assert pool.adopt("m", [torch.ones(4)]) is not None
    area = _cuda_ipc._area
    pool.close()
    assert pool.adopt("m", [torch.ones(1 << 18)]) is None and pool.held() == 0  # kept as it is
    assert area._pinned == {} and area.held_bytes() == 0  # (the first slab retired: nobody reads it)


def test_a_worlds_stop_keeps_a_slab_its_live_receiver_holds_and_the_next_area_sweeps_it(over_cpu, monkeypatch):
    """A message sent just before the World's stop, read just after it by a receiver that
    had not mapped the control page yet: the slab and the page outlive the area, the
    receiver reads it and ends the lease, and the next World's start retires it."""
    monkeypatch.setattr(_cuda_ipc, "_CLOSE_LENT_S", 0.05)
    data = _one_message(torch.ones(3))
    area = _cuda_ipc._area
    (slab,) = area._slabs
    _cuda_ipc.close()  # its receiver (alive: this process; its openings dropped) has not read it yet
    assert _cuda_ipc._outliving.areas() == [area] and slab.storage is not None
    assert _cuda_ipc.stats()["outliving_bytes"] == slab.capacity
    assert _cuda_ipc.stats()["closed_area_outlived"] >= 1
    assert torch.equal(pickle.loads(data)[0], torch.ones(3)) and _cuda_ipc.released(10)
    assert slab.storage is not None  # (read and ended: retired at the next sweep)
    _cuda_ipc.configure(64 << 20)  # the next World starts
    assert _cuda_ipc._outliving.areas() == [] and slab.storage is None and area.fd == -1
    assert _cuda_ipc.stats()["outliving_bytes"] == 0


def test_what_a_closed_area_still_lends_counts_against_the_next_ones_bound(monkeypatch):
    monkeypatch.setattr(_cuda_ipc_area, "Slab", _FakeSlab)
    made = _cuda_ipc_area.ExportArea(16 << 20, lambda: 12 << 20)
    assert made.lease(0, 8 << 20, os.getpid()) is None and made.stats["no_room"] == 1
    assert made.lease(0, 4 << 20, os.getpid()) is not None
    made.close()
    made.sweep(force=True)


def test_a_pinned_slab_retired_under_a_push_leaves_the_state_as_it_is(pinned, monkeypatch):
    """The World stopped between a push's choice of a ring's slab and its copies in: the
    slab was retired (its storage gone) and the push raised out of the model server."""
    from machinlike.distributed._calls import cuda_ipc_pin

    pool = pinned()
    assert pool.adopt("m", [torch.ones(4)]) is not None
    take = cuda_ipc_pin.PinnedStates._take

    def stopped_meanwhile(self, *args):
        chosen = take(self, *args)
        _cuda_ipc.close()
        _cuda_ipc._outliving.sweep(force=True)
        return chosen

    monkeypatch.setattr(cuda_ipc_pin.PinnedStates, "_take", stopped_meanwhile)
    assert pool.adopt("m", [torch.zeros(4)]) is None  # not pinned: the state stays as it is


def test_a_late_probe_of_a_stopped_world_does_not_hold_the_next_ones_probe_back(monkeypatch, over_cpu, live_peer):
    """Its message went with the World that sent it: a peer that lives on was staged in
    every later World as long as it lived (the old lease stays lent to it)."""
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    monkeypatch.setattr(_cuda_ipc, "_CLOSE_LENT_S", 0.01)
    monkeypatch.setattr(_cuda_ipc.ops, "current_index", lambda: None)
    monkeypatch.setattr(_cuda_ipc_peers, "_PROBE_TIMEOUT_S", 0.05)
    asked = []

    def rpc_sync(member, fn, args=(), timeout=None):
        asked.append(fn.__name__)
        if fn.__name__ == "_describe":
            return 77, 1
        time.sleep(timeout)
        raise RuntimeError("RPC ran for more than set timeout")

    monkeypatch.setattr(_cuda_ipc_peers.rpc, "rpc_sync", rpc_sync)
    assert _cuda_ipc_peers.peer_target("peer", live_peer) is None and asked == ["_describe", "_probe"]
    _cuda_ipc.close()
    _cuda_ipc.configure(64 << 20)  # the next World
    assert _cuda_ipc_peers.peer_target("peer", live_peer) is None
    assert asked[2:] == ["_describe", "_probe"]  # probed again


def test_a_callee_ends_its_last_unread_answer_when_the_same_caller_probes_again(monkeypatch, over_cpu, live_peer):
    """A caller whose probes always ran out of time read none of the answers (torch drops
    a reply past its call's timeout): each stayed lent to it, one slab every retry, until
    every slot of the callee's area was taken."""
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    try:
        probe = [torch.arange(16)]
        _cuda_ipc_peers._probe(probe, live_peer)
        area = _cuda_ipc._area
        assert area.lent() == 1
        _cuda_ipc_peers._probe(probe, live_peer)  # its next probe: the last answer was given up
        assert area.lent() == 1 and area.stats["slabs_made"] == 1
        _cuda_ipc_peers._probe(probe, os.getpid())  # another caller's answer is its own
        assert area.lent() == 2
    finally:
        _cuda_ipc_peers._answers.clear()


def test_a_member_is_probed_by_one_thread_at_a_time(monkeypatch, over_cpu):
    monkeypatch.setattr(_cuda_ipc, "_key", 77)
    monkeypatch.setattr(_cuda_ipc.ops, "current_index", lambda: None)
    during = []

    def rpc_sync(member, fn, args=(), timeout=None):
        if fn.__name__ == "_describe":
            return 77, 1
        during.append(_cuda_ipc_peers.peer_target("peer", os.getppid() or 1))  # another thread's call meanwhile
        raise RuntimeError("the CUDA IPC probe arrived as tensor([0, 0])")

    monkeypatch.setattr(_cuda_ipc_peers.rpc, "rpc_sync", rpc_sync)
    before = _cuda_ipc.stats().get("staged_probe_in_flight", 0)
    assert _cuda_ipc_peers.peer_target("peer", os.getppid() or 1) is None
    assert during == [None] and _cuda_ipc.stats()["staged_probe_in_flight"] == before + 1
    assert _cuda_ipc_peers._probing == set()


def test_what_a_stopped_world_still_lends_leaves_room_once_it_comes_back(over_cpu, monkeypatch):
    """Bytes a closed area holds count against the next area's bound, until they come
    back: then at once, not at the next World's stop (the receiver may end its lease long
    after the sweeps of the stop and of the next start)."""
    monkeypatch.setattr(_cuda_ipc, "_CLOSE_LENT_S", 0.01)
    _one_message(torch.ones(10 << 20))  # a 64 MiB slab: the whole bound, lent to a live receiver
    old = _cuda_ipc._area
    (slab,) = old._slabs
    _cuda_ipc.close()
    _cuda_ipc.configure(64 << 20)  # the next World
    area = _cuda_ipc.export_area()
    assert area.lease(0, 1, os.getpid()) is None and area.stats["no_room"] == 1
    old.words[slab.slot, 0] = _cuda_ipc_area.FREE  # its receiver read it at last
    assert area.lease(0, 1, os.getpid()) is not None and slab.storage is None
    assert _cuda_ipc._outliving.areas() == []


# ------------------------------------------------ reply leases abandoned (cuda_ipc_claim)
# A reply carried by torch RPC that arrives after its caller's deadline is dropped unread:
# what it was lent comes back a while after that deadline when still untaken, under a
# claim (an OFD lock on the row's bytes) its receiver takes it by. The area's side with
# stand-in slabs, the receiver's over CPU memory; end to end: ``test_cuda_ipc_gpu.py``.
def _filled(area, give_up, taker=None):
    lease = area.lease(0, 1 << 20, os.getpid() if taker is None else taker, give_up)
    area.filled(lease)
    return lease


def test_an_untaken_reply_lease_is_abandoned_after_its_give_up_time_and_no_other(area):
    soon = time.monotonic() + 1.5  # (wide: the check before it must run before it on a busy machine)
    lost, taken, plain = _filled(area, soon), _filled(area, soon), _filled(area, 0.0)
    area.words[taken.row, 1] = _pids.own_identity()  # its receiver took it (the copies out end it)
    assert area.lent() == 3 and area.stats["abandoned"] == 0  # not before its give-up time
    time.sleep(max(0.0, soon - time.monotonic()) + 0.05)
    assert area.lent() == 2 and area.stats["abandoned"] == 1
    assert not area.holds(lost) and area.holds(taken) and area.holds(plain)
    assert lost.slab.unsent and not taken.slab.unsent  # (its next writer orders after the lost copies)
    assert len(area._claims) == 0  # (noted no longer: bounded by the page's rows)
    assert area.lease(0, 1 << 20, os.getpid()).slab is lost.slab  # lent again


def test_a_reply_lease_still_written_is_not_abandoned_until_filled(area):
    lease = area.lease(0, 1 << 20, os.getpid(), time.monotonic() - 1)  # past already: its copies are queued now
    assert area.lent() == 1 and area.stats["abandoned"] == 0
    area.filled(lease)
    assert area.lent() == 0 and area.stats["abandoned"] == 1


def test_a_taker_whose_start_time_cannot_be_read_is_never_abandoned(area, monkeypatch):
    from machinlike.distributed._calls import cuda_ipc_claim

    monkeypatch.setattr(cuda_ipc_claim, "identity", lambda pid: pid)  # taken or not, its word would be the same
    lease = _filled(area, time.monotonic() - 1)
    assert area.lent() == 1 and area.holds(lease) and area.stats["abandoned"] == 0


def test_a_lease_whose_receiver_holds_the_row_claim_is_left_until_it_lets_go(area):
    from machinlike.distributed._calls import cuda_ipc_claim

    soon = time.monotonic() + 0.2  # (past already, the second lease would take back the first's slab)
    lease, other = _filled(area, soon), _filled(area, soon)
    time.sleep(0.25)
    handle = os.open(f"/proc/self/fd/{area.fd}", os.O_RDWR)  # another open description: a receiver's
    try:
        assert cuda_ipc_claim._lock(handle, lease.row)
        assert not cuda_ipc_claim._lock(area.fd, lease.row)  # (the owner's description is refused)
        assert area.lent() == 1 and area.holds(lease) and not area.holds(other)  # the row's lock only
    finally:
        os.close(handle)  # (lets go)
    assert area.lent() == 0 and area.stats["abandoned"] == 2


def test_an_untaken_reader_row_is_abandoned_and_the_unpinned_slab_then_retires(over_cpu):
    area = _cuda_ipc.export_area()
    slab = area.pin(0, 1 << 20)
    lease = area.share(slab, os.getpid(), time.monotonic() + 0.2)
    area.unpin(slab)  # a new version: the old one is retired once nobody reads it
    assert area.readers(slab) == 1 and slab in area._slabs
    time.sleep(0.25)
    assert area.readers(slab) == 0 and slab not in area._slabs and area.stats["abandoned"] == 1
    assert area.words[lease.row, 0] == _cuda_ipc_area.FREE


def _reply_message(tensor, give_up):
    from machinlike import _shm

    before = _shm.lending_until(give_up)
    try:
        return _one_message(tensor)
    finally:
        _shm.lending_until(before)


def test_a_reply_taken_in_time_arrives_and_one_loaded_after_it_was_abandoned_is_told(over_cpu):
    area = _cuda_ipc.export_area()
    data = _reply_message(torch.arange(6.0), time.monotonic() + 0.3)
    assert torch.equal(pickle.loads(data)[0], torch.arange(6.0))  # in time: taken under the claim
    assert _cuda_ipc.released(10) and area.lent() == 0
    late = _reply_message(torch.ones(5), time.monotonic() + 0.3)
    time.sleep(0.35)
    assert area.lent() == 0 and area.stats["abandoned"] == 1  # nobody loaded it: abandoned
    again = _one_message(torch.full((5,), 7.0))  # the slab, lent again to another message
    with pytest.raises(TimeoutError, match="after its call's deadline"):
        pickle.loads(late)
    assert area.lent() == 1  # the late load took nothing: the next message's lease stands
    assert torch.equal(pickle.loads(again)[0], torch.full((5,), 7.0))
    assert _cuda_ipc.released(10) and area.lent() == 0
    assert _cuda_ipc.stats()["area_abandoned"] == 1


def test_a_message_made_outside_a_reply_carries_no_claim(over_cpu, monkeypatch):
    from machinlike.distributed._calls import cuda_ipc_claim

    opened = []
    monkeypatch.setattr(cuda_ipc_claim, "open_peer_fd", lambda *a: opened.append(a) or pytest.fail("claimed"))
    assert torch.equal(pickle.loads(_one_message(torch.ones(3)))[0], torch.ones(3))
    assert opened == [] and len(_cuda_ipc.export_area()._claims) == 0


_CLAIM_HOLDER = """
import os, sys, time
from machinlike.distributed._calls.cuda_ipc_claim import _lock
handle = os.open(f"/proc/{sys.argv[1]}/fd/{sys.argv[2]}", os.O_RDWR)
assert _lock(handle, int(sys.argv[3]))
print("held", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("killed", [True, False], ids=["holder-killed", "holder-held-on"])
def test_a_receiver_waits_for_a_row_claim_held_by_another_process_within_a_bound(over_cpu, monkeypatch, killed):
    from machinlike.distributed._calls import cuda_ipc_claim

    monkeypatch.setattr(cuda_ipc_claim, "CLAIM_WAIT_S", 0.5)
    area = _cuda_ipc.export_area()
    data = _reply_message(torch.ones(4), time.monotonic() + 60)
    (slab,) = area._slabs
    holder = subprocess.Popen([sys.executable, "-c", _CLAIM_HOLDER, str(os.getpid()), str(area.fd), str(slab.slot)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        started = time.monotonic()  # (before the timer starts: a busy machine may run it at once)
        if killed:
            threading.Timer(0.2, holder.kill).start()  # SIGKILL: its lock goes with its descriptors
        if killed:
            assert torch.equal(pickle.loads(data)[0], torch.ones(4))
            assert 0.15 < time.monotonic() - started < 0.5 + 0.3
        else:
            with pytest.raises(TimeoutError, match="held the claim on row"):
                pickle.loads(data)
            assert 0.5 <= time.monotonic() - started < 0.5 + 0.5
            assert int(area.words[slab.slot, 1]) == os.getpid()  # not taken
    finally:
        holder.kill()
        holder.wait(30)
        holder.stdout.close()
    assert _cuda_ipc.released(10) and (area.lent() == 0) == killed
