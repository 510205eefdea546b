"""CUDA IPC between processes of one host, end to end (marked ``gpu``; skip without CUDA).

Real processes over real torch RPC, all on cuda:0: every kind of tensor through a call and
back, the sender reusing its tensor after the call, a received tensor sent on, 8
processes in a ring, the servers (model push and pull, inference; pulls reading a
model server's versions in place), and pullers (of a service and of a model server) SIGKILLed
mid-transfer while the sender's GPU memory stays flat and nobody waits out a timeout, and
a slab lent at a World's stop that outlives it under its late reader.
Each test also asserts that nothing was staged through the CPU (``_cuda_ipc.stats``).
"""

from __future__ import annotations

import gc
import os
import signal
import threading
import time
import warnings

import pytest
import torch
from torch import nn

from machinlike import launch
from machinlike._shm import _segments, _terms
from machinlike.distributed._calls import cuda_ipc as _cuda_ipc
from machinlike.distributed._calls import cuda_ipc_open as _cuda_ipc_open
from machinlike.distributed._calls import cuda_ipc_slab as _cuda_ipc_slab
from machinlike.distributed._calls import samehost as _samehost
from machinlike.distributed._calls.strides import kept_strides
from machinlike.testing import world_test

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

_KEPT: dict = {}


def _cuda_here() -> None:
    torch.cuda.set_device(0)
    torch.cuda.init()


def _echo(x):
    return x


def _keep(x):
    _KEPT["x"] = x
    return float(x.sum())


def _kept_sum():
    return float(_KEPT["x"].sum())


def _staged(stats):
    return {k: v for k, v in stats.items() if k.startswith("staged")}


def _check_same(back, sent):
    assert type(back) is type(sent) and back.device == torch.device("cuda", 0)
    assert back.dtype == sent.dtype and back.shape == sent.shape and torch.equal(back, sent)
    assert back.requires_grad == sent.requires_grad
    # A dense one keeps its strides (as a CPU tensor does); any other arrives contiguous.
    assert back.stride() == (sent.stride() if kept_strides(sent) else sent.contiguous().stride())


# ------------------------------------------------------------------ kinds, reuse, send on
@world_test(3, timeout=180)
def test_tensors_cross_by_ipc_are_owned_and_can_be_sent_on(world):
    _cuda_here()
    me = world.name
    group = world.create_rpc_group("ipc", ["0", "1", "2"])
    group.register(f"echo/{me}", _echo)
    group.register(f"keep/{me}", _keep)
    group.register(f"forward/{me}", lambda x: group.registered_sync("echo/2", (x,)))
    group.register(f"stats/{me}", _settled_stats)
    group.barrier()
    if me == "0":
        x = torch.arange(1 << 20, dtype=torch.float32, device="cuda").reshape(1024, 1024)
        payload: dict = {"a": x, "t": x.t(), "h": x.half()[:3], "b": x > 5, "i": torch.tensor(7, device="cuda"),
                   "e": torch.zeros(0, 4, device="cuda"), "p": nn.Parameter(torch.ones(3, device="cuda")),
                   "g": torch.ones(2, device="cuda", requires_grad=True), "same": [x, x], "cpu": torch.ones(3),
                   "cl": torch.randn(8, 3, 32, 32, device="cuda").to(memory_format=torch.channels_last),
                   "x": x[:1].expand(4, 1024)}
        back = group.registered_sync("echo/1", (payload,))
        for key in ("a", "t", "h", "b", "i", "e", "p", "g", "cl", "x"):
            _check_same(back[key], payload[key])
        assert back["same"][0] is back["same"][1] and torch.equal(back["same"][0], x)
        assert back["cpu"].device.type == "cpu" and torch.equal(back["cpu"], payload["cpu"])
        # The sender may reuse its tensor once the call returned: the receiver owns a copy.
        y = torch.full((1 << 18,), 3.0, device="cuda")
        assert group.registered_sync("keep/1", (y,)) == 3.0 * (1 << 18)
        y.fill_(-1)
        torch.cuda.synchronize()
        assert group.rpc_sync("1", _kept_sum) == 3.0 * (1 << 18)
        # A tensor received through IPC is sent on (torch's "received from another process" never shows).
        assert torch.equal(group.registered_sync("forward/1", (x,)), x)
        # 64 MB there and back, ten times
        big = torch.randn(16 << 20, device="cuda")
        for _ in range(10):
            assert torch.equal(group.registered_sync("echo/1", (big,)), big)
        # Under a stream of the caller's own, what arrives is ready on that stream (the
        # copies out ran on the reader thread's default stream): read at once, no sync.
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            for _ in range(5):
                assert torch.equal(group.registered_sync("echo/1", (big,)) * 1, big)
        # Each side's leases are ended by the other's releaser: this one's first (the
        # callee's slabs come FREE), then the callee's (inside "stats/1": this one's do).
        assert _cuda_ipc.released(10)
        theirs = group.registered_sync("stats/1")
        mine = _settled_stats()
        assert not _staged(mine) and not _staged(theirs), (mine, theirs)
        # Received here: 10 of the echoed dict, 1 forwarded, 15 big ones (and the probe's).
        assert mine["sent_tensors"] >= 27 and mine["received_tensors"] >= 26 and theirs["sent_tensors"] >= 26
        assert mine["area_lent"] == 0 and theirs["area_lent"] == 0  # every lease was freed by its receiver
    group.barrier()
    group.destroy()


def _mapped_of_my_slabs():
    area = _cuda_ipc._area
    return {slab.handle: slab.mapped for slab in area._slabs} if area is not None else {}


@pytest.mark.skipif("expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                    reason="an expandable segment counts the slab's own bytes")
@world_test(2, timeout=120)
def test_a_receiver_counts_the_senders_whole_segments_it_keeps_open(world):
    # A 1 MiB tensor goes in a 2 MiB slab, which the allocator puts in a 20 MiB segment (or
    # a larger one): that is what the receiver maps, and what its cache bound counts.
    _cuda_here()
    group = world.create_rpc_group("segments", ["0", "1"])
    group.register(f"stats/{world.name}", _settled_stats)
    group.register(f"mapped/{world.name}", _mapped_of_my_slabs)
    group.register(f"keep/{world.name}", _keep)
    group.barrier()
    if world.name == "0":
        assert group.registered_sync("keep/1", (torch.ones(1 << 18, device="cuda"),)) == float(1 << 18)
        assert _cuda_ipc.released(10)
        theirs, mapped = group.registered_sync("stats/1"), _mapped_of_my_slabs()
        assert not _staged(theirs) and mapped and min(mapped.values()) >= 20 << 20, (theirs, mapped)
        # (the probe's slabs too, all of this process's: each segment once)
        assert theirs["opened_held_bytes"] <= sum(mapped.values()) and theirs["opened_held_bytes"] >= 20 << 20
    group.barrier()
    group.destroy()


# ------------------------------------------------------------------ 8 processes on one GPU
def _fork_status() -> int:
    """Fork as a DataLoader's workers do, the child collecting garbage and leaving; its status."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # (fork beside threads: the child only exits)
        pid = os.fork()
    if pid == 0:
        gc.collect()
        os._exit(0)
    return os.waitpid(pid, 0)[1]


@world_test(2, timeout=180)
def test_a_side_stream_result_is_kept_until_read_and_a_receiver_forks_cleanly(world):
    _cuda_here()
    me = world.name
    group = world.create_rpc_group("ipc", ["0", "1"])
    group.register(f"echo/{me}", _echo)
    group.barrier()
    if me == "1":
        x = torch.ones(1 << 20, device="cuda")
        side = torch.cuda.Stream()
        # No cached block but the result's own could serve the default stream's next
        # allocation: without the result's record_stream, ``fresh`` below would take it
        # (before, a cached block could serve it, and the test pass without the mark).
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        with torch.cuda.stream(side):
            back = group.registered_sync("echo/0", (x,))
            ptr = back.data_ptr()
            torch.cuda._sleep(200_000_000)  # the side stream is busy for a while, then reads it
            total = back.sum()
            del back  # freed while the read is still queued on the side stream
        # On the default stream, written at once: given the freed memory, these zeros
        # would land under the side stream's queued read.
        fresh = [torch.zeros_like(x) for _ in range(4)]
        assert all(f.data_ptr() != ptr for f in fresh)
        side.synchronize()
        assert float(total) == float(1 << 20)
        # A fork after receiving through IPC (before: the child's fork handler dropped the
        # parent's openings, and torch's deleter aborted it).
        assert _fork_status() == 0
        assert _cuda_ipc.stats().get("opened_opened", 0) >= 1 and not _staged(_cuda_ipc.stats())
    group.barrier()


@world_test(8, timeout=300)
def test_eight_processes_on_one_gpu_in_a_ring(world):
    _cuda_here()
    me = int(world.name)
    group = world.create_rpc_group("ring", [str(r) for r in range(8)])
    group.register(f"double/{me}", lambda x: x * 2)
    group.barrier()
    to = f"double/{(me + 1) % 8}"
    for i in range(10):
        x = torch.full((1 << 20,), float(me * 100 + i), device="cuda")
        back = group.registered_async(to, (x,)).wait()
        assert back.device.type == "cuda" and torch.equal(back, x * 2)
    group.barrier()
    stats = _cuda_ipc.stats()
    assert not _staged(stats) and stats["sent_tensors"] >= 10 and stats["received_tensors"] >= 10, stats
    group.barrier()
    group.destroy()


# ------------------------------------------------------------------ servers
class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1 << 20, device="cuda"))


def _double_rows(x):
    return x * 2


@world_test(3, timeout=180)
def test_model_and_inference_servers_stay_on_the_gpu(world):
    from machinlike.server import InferenceServerImpl, PushPullModelServerImpl

    _cuda_here()
    me = world.name
    group = world.create_rpc_group("servers", ["0", "1", "2"])
    impls: list = []
    if me == "0":
        impls = [PushPullModelServerImpl("model", group), InferenceServerImpl("infer", group, _double_rows)]
        group.register("stats", _cuda_ipc.stats)
    group.barrier()
    if me == "1":
        learner = _Net()
        learner.weight.data.fill_(1.0)
        assert group.get_paired("model").to_here().push(learner)
        learner.weight.data.fill_(5.0)  # the learner trains on: the pushed version must not change
    group.barrier()
    if me == "2":
        reader = _Net()
        assert group.get_paired("model").to_here().pull(reader)
        assert reader.weight.device.type == "cuda" and float(reader.weight.min()) == float(reader.weight.max()) == 1.0
        x = torch.arange(12.0, device="cuda").reshape(4, 3)
        out = group.get_paired("infer").to_here().infer(x)
        assert out.device.type == "cuda" and torch.equal(out, x * 2)
        cpu_out = group.get_paired("infer").to_here().infer(x.cpu())
        assert cpu_out.device.type == "cpu" and torch.equal(cpu_out, x.cpu() * 2)  # CPU in, CPU out
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):  # then()'s future settles in the reading thread: ordered on side
            late = group.get_paired("infer").to_here().infer_async(x).wait()
            assert late.device == x.device and torch.equal(late, x * 2)
        assert not _staged(_cuda_ipc.stats()) and not _staged(group.registered_sync("stats"))
    group.barrier()
    for impl in impls:
        impl.close()
    group.barrier()
    group.destroy()


# ------------------------------------------------------------------ pulls read in place
_VERSIONS = 30


def _server_area():
    torch.cuda.synchronize()
    stats = _cuda_ipc.stats()
    return {k: stats.get(k, 0) for k in ("area_pinned", "area_shared", "area_slabs_made", "area_lent",
                                          "area_held_bytes")}


@world_test(6, timeout=300)
def test_pulls_of_a_cuda_model_read_the_servers_versions_in_place(world):
    from machinlike.server import PushPullModelServerImpl

    _cuda_here()
    me = world.name
    group = world.create_rpc_group("pinned", [str(i) for i in range(6)])
    impl = None
    if me == "0":
        impl = PushPullModelServerImpl("model", group)
        group.register("area", lambda: {**_server_area(), "held": impl._pool.pinned()})
    group.barrier()
    server = group.get_paired("model").to_here()
    if me == "1":
        learner = _Net()
        for version in range(1, _VERSIONS + 1):
            learner.weight.data.fill_(float(version))
            assert server.push(learner)
    elif me != "0":  # four pullers, while the versions come
        reader = _Net()
        deadline = time.monotonic() + 120
        while getattr(reader, "pp_version", None) != _VERSIONS and time.monotonic() < deadline:
            if server.pull(reader):  # each version whole: never a mix of two
                low, high = float(reader.weight.min()), float(reader.weight.max())
                assert low == high == float(reader.pp_version), (low, high, reader.pp_version)
        assert reader.pp_version == _VERSIONS
        assert _cuda_ipc.released(10) and not _staged(_cuda_ipc.stats())
    group.barrier()
    if me == "2":
        area = group.registered_sync("area")
        # The server's versions live in a few pinned slabs, rewritten in turn (as many as
        # versions are held at once: not one a version, nor one a pull), read in place by
        # the pulls (the newest by each puller at least); no reader row outlives its copies.
        # (Pins counted over the run include a slab given back and pinned again later.)
        assert 1 <= area["held"] <= 16 and area["area_pinned"] < _VERSIONS and area["area_shared"] >= 4, area
        assert area["area_lent"] == 0, area
    group.barrier()
    if impl is not None:
        impl.close()
    group.barrier()
    group.destroy()


# ------------------------------------------------------------------ SIGKILL mid-transfer
_VICTIMS = 4
def _slow_cuda(pause):
    time.sleep(pause)  # (the service's own slowness: its caller gives up first)
    return torch.full((4 << 20,), 5.0, device="cuda")  # 16 MB, in a slab lent to the caller


def _my_lent():
    return _cuda_ipc.stats()["area_lent"]


def _overdue():
    return _samehost.stats()["shm"]["overdue"]


def _margin_off():
    _terms.OVERDUE_MARGIN_S = -3600.0  # (this callee lends past its callers' deadlines)


@world_test(2, timeout=120, same_host_lane=True)
def test_a_cuda_reply_after_its_call_timed_out_comes_back_to_its_sender(world):
    """A result made after its caller's deadline lends nothing: it is staged (``overdue``).
    One made just before it may still arrive late (here: the callee's margin turned off):
    the caller's lane loads the late reply and drops it, so the service's slab comes FREE
    again (through torch RPC, with the lane off, it is abandoned a while after the
    deadline: the next test)."""
    _cuda_here()
    group = world.create_rpc_group("late", ["0", "1"])
    if world.name == "1":
        group.register("slow", _slow_cuda)
    group.barrier()
    if world.name == "0":
        assert torch.equal(group.registered_sync("slow", (0.0,)), torch.full((4 << 20,), 5.0, device="cuda"))
        sent = group.rpc_sync("1", _cuda_ipc.stats)["sent_tensors"]
        with pytest.raises(TimeoutError):
            group.registered_sync("slow", (1.0,), timeout=0.2)
        deadline = time.monotonic() + 20
        while group.rpc_sync("1", _overdue) == 0:  # the reply is made late: staged
            assert time.monotonic() < deadline, "the slow service never replied"
            time.sleep(0.05)
        assert group.rpc_sync("1", _cuda_ipc.stats)["sent_tensors"] == sent and group.rpc_sync("1", _my_lent) == 0
        group.rpc_sync("1", _margin_off)
        for call in (lambda: group.registered_sync("slow", (1.0,), timeout=0.2),
                     lambda: group.registered_async("slow", (1.0,), timeout=0.2).wait()):
            with pytest.raises(TimeoutError):
                call()
            deadline = time.monotonic() + 20
            while (now := group.rpc_sync("1", _cuda_ipc.stats)["sent_tensors"]) == sent:  # the reply is made late
                assert time.monotonic() < deadline, "the slow service never replied"
                time.sleep(0.05)
            sent = now
            assert _cuda_ipc.released(10)
            while group.rpc_sync("1", _my_lent) != 0:  # the late reply crossed, was loaded and dropped
                assert time.monotonic() < deadline, "the late reply's slab stayed lent"
                time.sleep(0.05)
    group.barrier()
    group.destroy()


def _abandon_soon():
    _terms.OVERDUE_MARGIN_S = -3600.0  # (this callee lends past its callers' deadlines)
    _segments.ABANDON_AFTER_S = 0.5


def _area_figures():
    stats = _cuda_ipc.stats()
    return stats["area_lent"], stats["area_abandoned"]


@world_test(2, timeout=120, same_host_lane=False)
def test_a_cuda_reply_dropped_unread_by_torch_rpc_is_abandoned_after_the_deadline(world):
    """Through torch RPC (the lane off) a reply that arrives after its caller's deadline is
    dropped unread; the slab it was lent comes back ``ABANDON_AFTER_S`` after that deadline
    (``cuda_ipc_claim``), and a reply loaded in time is never abandoned."""
    _cuda_here()
    group = world.create_rpc_group("lost", ["0", "1"])
    if world.name == "1":
        group.register("slow", _slow_cuda)
        _abandon_soon()
    group.barrier()
    if world.name == "0":
        for _ in range(3):  # in time, through IPC: taken, and ended by this side's releaser
            assert torch.equal(group.registered_sync("slow", (0.0,), timeout=30),
                               torch.full((4 << 20,), 5.0, device="cuda"))
        assert _cuda_ipc.released(10) and _staged(_cuda_ipc.stats()) == {}
        sent = group.rpc_sync("1", _cuda_ipc.stats)["sent_tensors"]
        with pytest.raises(TimeoutError):
            group.registered_sync("slow", (1.0,), timeout=0.2)
        deadline = time.monotonic() + 20
        while group.rpc_sync("1", _cuda_ipc.stats)["sent_tensors"] == sent:  # the reply is made late, and lent
            assert time.monotonic() < deadline, "the slow service never replied"
            time.sleep(0.05)
        seen = [group.rpc_sync("1", _area_figures)]
        while seen[-1] != (0, 1):
            assert time.monotonic() < deadline, seen
            time.sleep(0.1)
            seen.append(group.rpc_sync("1", _area_figures))
        assert torch.equal(group.registered_sync("slow", (0.0,), timeout=30),  # the slab is lent again
                           torch.full((4 << 20,), 5.0, device="cuda"))
        assert _cuda_ipc.stats()["received_tensors"] >= 4 and _staged(_cuda_ipc.stats()) == {}
    group.barrier()
    group.destroy()


_SLAB_MB = 32


def _give(n):
    return torch.full((_SLAB_MB << 18,), float(n), device="cuda")  # 32 MB, made fresh each call


def _settled_stats():
    # Each lease ends once its receiver's copies completed, in the receiver's releaser
    # thread: wait for this process's own, then read.
    assert _cuda_ipc.released(10)
    return _cuda_ipc.stats()


def _reserved_and_lent():
    torch.cuda.synchronize()
    return torch.cuda.memory_reserved(), _cuda_ipc.stats()["area_lent"], _cuda_ipc.stats()["area_held_bytes"]


def _killed_body(world):
    _cuda_here()
    name = world.name
    if name.startswith("victim") and world.incarnation > 1:
        return None
    group = world.create_rpc_group("churn", ["server", "survivor"] + [f"victim{i}" for i in range(_VICTIMS)])
    finished, armed = threading.Event(), threading.Event()
    if name == "server":
        served: dict = {}

        def give(n, who):
            served[who] = served.get(who, 0) + 1
            return _give(n)

        group.register("give", give)
        group.register("served", lambda: dict(served))
        group.register("memory", _reserved_and_lent)
        group.register("arm", armed.set)
        group.register("armed", armed.is_set)
        group.register("finished", finished.set)
    group.barrier(timeout=120)
    if name == "server":
        assert finished.wait(240)
        return None
    if name.startswith("victim"):
        # The deaths begin only once the survivor took its mark (every puller busy, none
        # dead): timed from each process's own start, a slow start could put the first
        # death before the mark, or the mark before a puller's first slab.
        timer = None
        while True:
            group.registered_sync("give", (1, name), timeout=30)
            if timer is None and group.registered_sync("armed", timeout=30):
                delay = 0.2 + int(name[len("victim"):]) * 0.3
                timer = threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL))  # mid-transfer, one by one
                timer.start()
    # the survivor
    slowest, mark, armed_at = 0.0, None, None
    limit = time.monotonic() + 120
    i = 0
    while armed_at is None or time.monotonic() < armed_at + 0.2 + _VICTIMS * 0.3 + 2.0:  # past the last death
        assert time.monotonic() < limit, f"no mark within 120 s: {group.registered_sync('served')}"
        start = time.perf_counter()
        got = group.registered_sync("give", (i, name), timeout=30)
        slowest = max(slowest, time.perf_counter() - start)
        assert got.device.type == "cuda" and float(got[0]) == float(got[-1]) == i
        if mark is None and i % 8 == 7:
            served = group.registered_sync("served")
            if len(served) == _VICTIMS + 1 and min(served.values()) >= 3:  # every puller busy, none dead yet
                mark = group.registered_sync("memory")
                group.registered_sync("arm")
                armed_at = time.monotonic()
        i += 1
    world.membership.wait_until(lambda live: all((world.get_incarnation(f"victim{v}") or 0) >= 2 or
                                                 world.membership.gone(f"victim{v}")
                                                 for v in range(_VICTIMS)), 60)
    group.registered_sync("give", (0, name), timeout=30)  # one more lease: the dead victims' are taken back
    assert _cuda_ipc.released(10)  # (the survivor's copies out of that one are done: its lease is FREE)
    end = group.registered_sync("memory")
    group.registered_sync("finished")
    return {"slowest": slowest, "mark": mark, "end": end, "stats": _cuda_ipc.stats()}


def test_pullers_sigkilled_mid_transfer_hang_nobody_and_leak_no_gpu_memory():
    names = ["server", "survivor"] + [f"victim{i}" for i in range(_VICTIMS)]
    result = launch(_killed_body, len(names), names=names, max_restarts=_VICTIMS, essential=["server", "survivor"],
                    timeout=300, rpc_timeout=30)
    assert len(result.restarts) == _VICTIMS and all("SIGKILL" in r.cause for r in result.restarts), result.restarts
    out = result[1]
    assert out["slowest"] < 5.0, out  # nothing waited out a timeout
    (reserved_mark, _, held_mark), (reserved_end, lent_end, held_end) = out["mark"], out["end"]
    assert lent_end == 0, out  # no lease is held for a dead process
    # The area did not grow per death: a slab at most was made after the mark (before the
    # first death), and it holds two slabs a puller at most (one a puller copies out of
    # while the next is filled: a lease ends once its receiver's copies ran).
    assert held_end <= held_mark + (_SLAB_MB << 20), out
    assert held_end <= (2 * (_VICTIMS + 1) + 1) * (_SLAB_MB << 20), out
    assert reserved_end <= reserved_mark * 1.1 + (_SLAB_MB << 20), out
    assert not _staged(out["stats"]), out


# ------------------------------------------------- pullers of a model server SIGKILLed
_PUSHES = 150


class _BigNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(_SLAB_MB << 18, device="cuda"))  # 32 MB


def _model_killed_body(world):
    from machinlike.server import PushPullModelServerImpl

    _cuda_here()
    name = world.name
    if name.startswith("victim") and world.incarnation > 1:
        return None
    group = world.create_rpc_group("pulls", ["server", "learner", "survivor"] + [f"victim{i}" for i in range(_VICTIMS)])
    finished = threading.Event()
    impl = None
    if name == "server":
        impl = PushPullModelServerImpl("model", group)
        group.register("area", lambda: {**_server_area(), "held": impl._pool.pinned()})
        group.register("finished", finished.set)
    group.barrier(timeout=120)
    if name == "server":
        assert finished.wait(240)
        impl.close()
        return None
    server = group.get_paired("model").to_here()
    model = _BigNet()
    if name == "learner":  # versions paced over the victims' whole kill window
        for version in range(1, _PUSHES + 1):
            model.weight.data.fill_(float(version))
            assert server.push(model)
            time.sleep(0.02)
        return None
    if name.startswith("victim"):
        delay = 1.0 + int(name[len("victim"):]) * 0.3
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()  # mid-pull, one by one
        while True:
            server.pull(model, timeout=30)
    # the survivor: every version it loads is whole, and no pull waits out a timeout
    slowest = 0.0
    deadline = time.monotonic() + 120
    while getattr(model, "pp_version", None) != _PUSHES and time.monotonic() < deadline:
        start = time.perf_counter()
        if server.pull(model, timeout=30):
            low, high = float(model.weight.min()), float(model.weight.max())
            assert low == high == float(model.pp_version), (low, high, model.pp_version)
        slowest = max(slowest, time.perf_counter() - start)
    world.membership.wait_until(lambda live: all((world.get_incarnation(f"victim{v}") or 0) >= 2 or
                                                 world.membership.gone(f"victim{v}")
                                                 for v in range(_VICTIMS)), 60)
    assert _cuda_ipc.released(10)
    area = group.registered_sync("area")
    group.registered_sync("finished")
    return {"version": model.pp_version, "slowest": slowest, "area": area, "stats": _cuda_ipc.stats()}


def test_model_server_pullers_sigkilled_mid_pull_leave_no_reader_row_behind():
    names = ["server", "learner", "survivor"] + [f"victim{i}" for i in range(_VICTIMS)]
    result = launch(_model_killed_body, len(names), names=names, max_restarts=_VICTIMS,
                    essential=["server", "learner", "survivor"], timeout=300, rpc_timeout=30)
    assert len(result.restarts) == _VICTIMS and all("SIGKILL" in r.cause for r in result.restarts), result.restarts
    out = result[2]
    assert out["version"] == _PUSHES and out["slowest"] < 5.0, out  # nothing waited out a timeout
    area = out["area"]
    # The dead pullers' reader rows were taken back by their pids; the versions stayed in a
    # few pinned slabs (the ring's bound; not one a version), read in place.
    assert area["area_lent"] == 0 and 1 <= area["held"] <= 16 and area["area_pinned"] < _PUSHES // 2, area
    assert area["area_shared"] > 0, area
    assert not _staged(out["stats"]), out


def test_each_message_read_from_one_opening_gets_an_event_of_its_own():
    # A pinned slab is read by several messages at once (threads, streams): each lease must
    # end after its own copies, not after whichever message recorded a shared event last.
    from machinlike.distributed._calls import cuda_ipc_ops as ops

    import types

    _cuda_here()
    opened = types.SimpleNamespace(done=None)  # (an opening: it kept one event for all, before)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    first = ops.copies_done(opened, 0)  # a message whose copies (none here) ran on the idle default stream
    with torch.cuda.stream(side):
        torch.cuda._sleep(1_000_000_000)  # another message's copies, still running on its stream
        second = ops.copies_done(opened, 0)
    assert first is not second
    started = time.monotonic()
    first.synchronize()
    assert time.monotonic() - started < 0.2  # its own event: not held up by the other's copies
    assert not second.done.query()  # and the other's lease does not end before its copies ran
    second.synchronize()
    assert second.done.query()


# ------------------------------------------------- a World's stop while a receiver reads
def _read_later(conn) -> None:
    """(Spawned child) a receiver that reads a message only after its sender's World stopped."""
    import pickle

    _cuda_here()
    _cuda_ipc.configure(64 << 20)
    conn.send((os.getpid(), _cuda_ipc.local_key()))
    data = conn.recv()
    (got,) = pickle.loads(data)
    total = float(got.sum())
    conn.send((total, _cuda_ipc.released(10)))


def test_a_slab_lent_at_the_worlds_stop_outlives_it_and_is_not_reused_under_its_reader():
    """The sender's World stops (``cuda_ipc.close``) before its receiver read the message:
    the slab must outlive the area (``outliving_bytes``), not go back to torch's allocator,
    where the next tensors made here (here full of 7s) would take its memory and the
    receiver copy those out; the next World's start sweeps it once it came back."""
    import multiprocessing
    import pickle

    _cuda_here()
    ctx = multiprocessing.get_context("spawn")
    here, there = ctx.Pipe()
    reader = ctx.Process(target=_read_later, args=(there,), daemon=True)
    reader.start()
    try:
        assert here.poll(120), "the reader did not start"
        pid, key = here.recv()
        _cuda_ipc.configure(64 << 20)
        x = torch.ones(4 << 20, device="cuda")  # 16 MB
        batch = _cuda_ipc.Batch((key, pid))
        refs = [batch.add(x)]
        assert batch.commit(refs, lambda t, p: pytest.fail("staged"), [])
        data = pickle.dumps(refs)
        torch.cuda.synchronize()
        _cuda_ipc.close()  # the World stops: its receiver (alive) has not read the message yet
        assert _cuda_ipc.stats()["outliving_bytes"] >= 16 << 20
        junk = [torch.full((4 << 20,), 7.0, device="cuda") for _ in range(8)]  # what a freed slab would serve
        torch.cuda.synchronize()
        here.send(data)
        assert here.poll(60), "the reader did not answer"
        total, released = here.recv()
        assert total == float(4 << 20) and released, (total, released)
        del junk
        _cuda_ipc.configure(64 << 20)  # the next World starts: what came back is retired
        assert _cuda_ipc.stats()["outliving_bytes"] == 0
    finally:
        _cuda_ipc.close()
        _cuda_ipc._outliving.sweep(force=True)
        _cuda_ipc.configure(0)
        reader.join(30)
        if reader.is_alive():
            reader.kill()


def test_chores_run_on_streams_of_their_own_not_ones_of_torchs_pool():
    # An opening's deleter, and the pool's copy out of a result, wait for the current
    # stream: on a pooled one, a user's side stream could be the same, and its queued
    # work be waited out (under the cache's lock, for the deleter).
    from machinlike.pool import _cuda_shares

    idle = _cuda_ipc_open._idle_stream(0)
    with _cuda_shares._copy_context(0):
        copying = torch.cuda.current_stream(0)
    pooled = {torch.cuda.Stream(device=0).cuda_stream for _ in range(96)}  # (the pool: 32 a priority)
    for stream in (idle, copying):
        assert stream.cuda_stream not in pooled and stream.device == torch.device("cuda", 0)
    assert idle.cuda_stream != copying.cuda_stream
    # Non-blocking, as torch's are: work on the default stream is not waited for.
    torch.cuda._sleep(1 << 31)  # (about a second of one GPU thread, on the default stream)
    began = time.monotonic()
    assert idle.query() and copying.query()
    idle.synchronize()
    assert time.monotonic() - began < 0.25
    torch.cuda.synchronize()


@pytest.mark.skipif("expandable_segments:True" in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
                    reason="an expandable segment counts the slab's own bytes")
def test_a_slab_tells_receivers_the_whole_segment_its_handle_maps():
    slab = _cuda_ipc_slab.Slab(0, 1, 0, 2 << 20)
    base = slab.storage.data_ptr() - slab.offset
    segment = [s for s in torch.cuda.memory_snapshot() if s["device"] == 0 and s["address"] == base]
    assert len(segment) == 1 and slab.mapped == segment[0]["total_size"]
    assert slab.mapped >= 20 << 20  # (the allocator gives a 1-10 MiB block a 20 MiB segment, or a larger one)


def test_a_slab_still_written_behind_a_busy_stream_is_retired_at_once_and_its_memory_kept_until_written():
    # Retiring a slab whose copies in are still queued (a message that ended early) waits
    # for them under the area's lock: a bounded wait now, the slab kept past it, not freed
    # under those copies and not waited for by every sender of the process meanwhile.
    from machinlike.distributed._calls import cuda_ipc_area as _cuda_ipc_area
    from machinlike.distributed._calls import cuda_ipc_ops as ops

    _cuda_here()
    area = _cuda_ipc_area.ExportArea(64 << 20)
    area.retire_wait = 0.05
    try:
        lease = area.lease(0, 1 << 20, os.getpid())
        slab = lease.slab
        source = torch.ones(1 << 18, device="cuda")  # 1 MiB
        side = torch.cuda.Stream()
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(1 << 31)  # (about a second of one GPU thread): the copy queues behind it
            ops.view(slab.views, slab.storage, 0, 0, torch.float32, (1 << 18,)).copy_(source)
            ops.mark_ready(slab)
        area.filled(lease)
        area.release(lease)  # ended before its copy ran
        began = time.monotonic()
        assert area.close() is True  # kept: its memory still written
        assert time.monotonic() - began < 0.5
        assert area.stats["settle_timed_out"] == 1 and slab.storage is None and area.held_bytes() == 2 << 20
        assert not slab.settled()
        side.synchronize()
        assert slab.settled() and area.sweep() is False and area.held_bytes() == 0
        assert area.stats["counter_release_failed"] == 0
    finally:
        area.sweep(force=True)
