"""Same-host RPC tensors through shared memory, across real processes: every call path,
copy semantics, explicit sharing, the threshold, dtypes and views, reuse, concurrency,
the off switch, and nothing left behind after SIGKILL of either end."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import threading
import time

import pytest
import torch
from torch.distributed import rpc

from machinlike import _shm
from machinlike.distributed import World, share
from machinlike.exception import PeerLostError
from machinlike.testing import run_world

MB = 1 << 20
_kept = {}


def _echo(x):
    return x


def _add_one(x):
    x += 1
    return x


def _keep(x):
    _kept["x"] = x
    return x


def _kept_value():
    return _kept["x"]


def _kept_first():
    return float(_kept["x"].reshape(-1)[0])


def _pair(a, b):
    return [b, {"a": a}]


@rpc.functions.async_execution
def _echo_async(x):
    fut = torch.futures.Future()
    fut.set_result(x)
    return fut


def _leases():
    return _shm.cache().stats["leases"]


def _our_memory():
    """Mappings and descriptors of our segments in this process (memfds: never in /dev/shm)."""
    with open("/proc/self/maps") as maps:
        mapped = sum("machinlike-shm" in line for line in maps)
    fds = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            fds += "machinlike-shm" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return mapped, fds


def _dev_shm():
    return set(os.listdir("/dev/shm"))


def _new_in_dev_shm(before, pids):
    # torch names a segment torch_<pid>_..., machinlike a claim machinlike_claim_<pid>_...:
    # only those of the world's ranks count (other tests, run alongside under xdist or in
    # another pytest session, and this pytest process's pools make and drop theirs),
    # and multiprocessing's semaphores (sem.mp-...) are its resource tracker's to remove.
    def counts(name):
        for prefix in ("torch_", "machinlike_claim_"):
            if name.startswith(prefix):
                return int(name[len(prefix):].split("_")[0]) in pids
        return not name.startswith("sem.mp-")
    return sorted(n for n in _dev_shm() - before if counts(n))


def _paths_body(world):
    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 1:
        for name, fn in (("echo", _echo), ("add", _add_one), ("keep", _keep), ("value", _kept_value),
                         ("first", _kept_first), ("pair", _pair), ("echo_async", _echo_async)):
            g.register(name, fn)
    g.barrier()
    if world.rank == 0:
        _paths_checks(g)
    g.barrier()
    _kept.clear()
    g.destroy()
    world.stop()
    return _our_memory(), os.getpid()


def _paths_checks(g):
    # (its own frame, so that every tensor is gone before World.stop counts what is left)
    if True:
        def both():  # segments lent by us (arguments) and by the callee (results)
            return _leases() + g.rpc_sync("1", _leases)

        t = torch.arange(MB, dtype=torch.float32)  # 4 MB
        original = t.clone()
        before = both()
        calls = {
            "registered_sync": lambda x: g.registered_sync("echo", (x,)),
            "registered_async": lambda x: g.registered_async("echo", (x,)).wait(),
            "async service": lambda x: g.registered_sync("echo_async", (x,)),
            "rpc_sync": lambda x: g.rpc_sync("1", _echo, args=(x,)),
            "rpc_async": lambda x: g.rpc_async("1", _echo, args=(x,)).wait(),
            "rpc_sync lambda kwargs": lambda x: g.rpc_sync("1", lambda x=None: x, kwargs={"x": x}),
            "remote": lambda x: g.remote("1", _echo, args=(x,)).to_here(),
        }
        for what, call in calls.items():
            assert torch.equal(call(t), original), what
        # arguments there, results back (a remote handle's to_here() too): two leases per call
        assert both() - before == 2 * len(calls)
        # copies stay copies: the callee's in-place edit does not reach us ...
        assert torch.equal(g.registered_sync("add", (t,)), original + 1)
        assert torch.equal(t, original)
        # ... and our edit of a result does not reach the callee
        got = g.registered_sync("keep", (t,))
        got += 5
        assert g.registered_sync("first") == 0.0
        del got
        # several tensors, one of them twice: one copy each, aliasing kept
        a, b = torch.ones(2 * MB), torch.zeros(300 * 1024, dtype=torch.float64)
        before = both()
        out = g.registered_sync("pair", (a, [b, b]))
        assert both() - before == 4  # a, b there; a, b back
        assert out[0][0].data_ptr() == out[0][1].data_ptr()
        assert torch.equal(out[1]["a"], a) and torch.equal(out[0][1], b)
        # the threshold (the World's default): one byte below stays off the segments
        threshold = World.__init__.__kwdefaults__["shm_threshold"]
        before = both()
        small = torch.ones(threshold - 1, dtype=torch.uint8)
        assert torch.equal(g.registered_sync("echo", (small,)), small)
        assert both() == before
        exact = torch.ones(threshold, dtype=torch.uint8)
        assert torch.equal(g.registered_sync("echo", (exact,)), exact)
        assert both() == before + 2
        # dtypes and non-contiguous views
        base = torch.randn(1024, 1024, dtype=torch.float64)
        cases = [base.t(), base[::2, 1::3], base.to(torch.float16), base.to(torch.bfloat16),
                 base > 0, (base * 100).to(torch.int8), torch.complex(base, -base).to(torch.complex64),
                 torch.ones(1, 256).expand(4096, 256), base.unsqueeze(0)[:, :, 5]]
        for case in cases:
            got = g.registered_sync("echo", (case,))
            assert got.dtype == case.dtype and got.shape == case.shape and torch.equal(got, case), case.dtype
        # tensors that require grad stay with TensorPipe (distributed autograd tracks them)
        param = torch.nn.Parameter(torch.ones(MB))
        before = both()
        got = g.registered_sync("echo", (param,))
        assert type(got) is torch.nn.Parameter and got.requires_grad and both() == before
        # a state dict keeps its type and its module versions
        state = torch.nn.BatchNorm1d(MB // 4).state_dict()
        got = g.registered_sync("echo", (state,))
        assert type(got) is type(state) and got._metadata == state._metadata
        assert all(torch.equal(got[k], state[k]) for k in state)
        # one tensor sent many times: segments are recycled, not made anew. (A few, not
        # one: the callee frees our argument's segment when its RPC thread drops the
        # argument, which under load can come after its reply reached us and we sent the
        # next call; that call then needs a second segment, rarely a third.)
        created = _shm.cache().stats["created"]
        for i in range(100):
            t.fill_(i)
            assert float(g.registered_sync("echo", (t,))[-1]) == i
        assert _shm.cache().stats["created"] - created <= 3
        # explicit sharing: the same memory, edits seen by both sides, no copy
        shared = share(torch.zeros(4 * MB))
        before = both()
        back = g.registered_sync("add", (shared,))
        assert float(shared[0]) == 1.0 and back.data_ptr() == shared.data_ptr()
        view = shared[MB:2 * MB]
        g.registered_sync("add", (view,))
        assert float(shared[MB]) == 2.0 and float(shared[0]) == 1.0
        g.registered_sync("keep", (shared,))  # the callee holds it, then edits
        g.rpc_sync("1", _add_one_kept)
        assert float(shared[0]) == 2.0
        assert both() == before  # nothing was copied


def _add_one_kept():
    _kept["x"] += 1


def test_every_path_copy_semantics_sharing_and_cleanup():
    before = _dev_shm()
    results = run_world(_paths_body, 2, timeout=120)
    assert [memory for memory, _ in results] == [(0, 0), (0, 0)], results  # nothing mapped or open after World.stop
    assert _new_in_dev_shm(before, {pid for _, pid in results}) == []


def _small_shared_body(world):
    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 1:
        g.register("add", _add_one)
    g.barrier()
    out = None
    if world.rank == 0:
        small = share(torch.zeros(4))  # 16 bytes, far below shm_threshold
        back = g.registered_sync("add", (small,))
        out = (float(small[0]), back.data_ptr() == small.data_ptr())
    g.barrier()
    return out


def test_a_shared_tensor_travels_by_reference_whatever_its_size():
    # share() promises the same memory on both sides; below shm_threshold it was copied
    # (packed with the message's small items), so the callee's edit was lost.
    assert run_world(_small_shared_body, 2, timeout=60)[0] == (1.0, True)


def _concurrent_body(world):
    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 0:
        g.register("echo", _echo)
    g.barrier()
    errors = []
    if world.rank != 0:
        def sender(k):
            try:
                t = torch.empty(MB // 2 + 1000 * k)
                for i in range(15):
                    t.fill_(world.rank * 1000 + k * 100 + i)
                    got = g.registered_async("echo", (t,)).wait() if i % 2 else g.registered_sync("echo", (t,))
                    assert torch.equal(got, t), (k, i)
            except Exception as exc:  # reported below, with the thread's identity
                errors.append(repr(exc))

        threads = [threading.Thread(target=sender, args=(k,)) for k in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=60)
        assert not any(thread.is_alive() for thread in threads)
    g.barrier()
    return errors, _shm.cache().held_bytes()


def test_concurrent_senders_and_bounded_cache():
    results = run_world(_concurrent_body, 3, timeout=120, shm_cache_bytes=12 * MB)
    for errors, held in results:
        assert not errors and held <= 12 * MB, (errors, held)


def _both(*args, **kwargs):
    return args, kwargs


class _Box:
    def __init__(self, value):
        self.value = value


def _kinds_body(world):
    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 1:
        g.register("both", _both)
    g.barrier()
    got = []
    if world.rank == 0:
        big = torch.randn(MB)  # 4 MB: through shared memory
        cases = {
            "sparse": torch.eye(3).to_sparse(),
            "sparse_large": torch.sparse_coo_tensor(torch.arange(300_000).unsqueeze(0), torch.ones(300_000),
                                                    (400_000,)),
            "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
            "channels_last_large": torch.randn(8, 3, 84, 84 * 8).to(memory_format=torch.channels_last),
            # These three have no storage: TensorPipe's serializer aborted the process (SIGABRT).
            "csr": torch.eye(3).to_sparse_csr(),
            "bsc_large": torch.eye(1024).to_sparse_bsc((4, 4)),
            "nested_large": torch.nested.nested_tensor([torch.randn(300, 300), torch.randn(200, 300)]),
        }
        for name, value in cases.items():
            (back,), _ = g.registered_sync("both", args=(value,))
            if value.is_nested:
                same = back.is_nested and all(torch.equal(a, b) for a, b in zip(back.unbind(), value.unbind()))
            else:
                same = torch.equal(back.to_dense(), value.to_dense())
            got.append((name, same, back.layout == value.layout,
                        value.layout != torch.strided or value.is_nested or back.stride() == value.stride()))
        # Where no walk of the arguments looks (an object's attribute), and by raw torch RPC.
        boxed = g.registered_sync("both", args=(_Box(cases["csr"]),))[0][0].value
        raw = torch.distributed.rpc.rpc_sync("1", _both, args=(cases["bsc_large"],))[0][0]
        got.append(("boxed_and_raw", torch.equal(boxed.to_dense(), torch.eye(3)),
                    torch.equal(raw.to_dense(), torch.eye(1024))))
        (a,), kw = g.registered_sync("both", args=(big,), kwargs={"again": big})
        got.append(("once", torch.equal(a, big), a is kw["again"]))
    g.barrier()
    g.destroy()
    return got


def test_sparse_tensors_layouts_and_a_tensor_in_args_and_kwargs():
    """A sparse tensor crosses (it has no ``nbytes``: the shared-memory walk once raised on
    it), compressed sparse and nested ones too, as arguments and replies, wherever they sit
    (torch's RPC serializer aborted the process on them), a channels-last one keeps its
    strides small or large, and one tensor in both args and kwargs arrives as one tensor,
    as torch RPC gives."""
    got = run_world(_kinds_body, 2, timeout=120)[0]
    assert got == [("sparse", True, True, True), ("sparse_large", True, True, True),
                   ("channels_last", True, True, True), ("channels_last_large", True, True, True),
                   ("csr", True, True, True), ("bsc_large", True, True, True), ("nested_large", True, True, True),
                   ("boxed_and_raw", True, True), ("once", True, True)], got


def _arrays_body(world):
    import numpy as np

    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 1:
        g.register("both", _both)
        g.register("add_one", _add_one)
    g.barrier()
    got = []
    if world.rank == 0:
        rng = np.random.default_rng(0)
        frames = rng.integers(0, 255, size=(64, 4, 84, 84), dtype=np.uint8)  # 1.8 MB of Atari frames
        record = np.dtype([("obs", np.float32, (8,)), ("reward", np.float64), ("done", np.bool_)])
        cases = {
            "frames": frames,
            "float64": rng.random(MB // 2),
            "fortran": np.asfortranarray(rng.random((1024, 512))),
            "strided": rng.random((2048, 512))[::2, ::-1],
            "big_endian": rng.random(MB // 2).astype(">f4"),
            "read_only": np.frombuffer(rng.bytes(2 * MB), dtype=np.int16),
            "records": np.zeros(MB // 8, dtype=record),
            "datetimes": np.arange(MB // 4).astype("datetime64[s]"),
            "objects": np.array([{"k": i} for i in range(MB // 8)], dtype=object),  # pickled as before
            "small": rng.random(10),
        }
        for name, value in cases.items():
            before = _leases()
            (back,), _ = g.registered_sync("both", args=(value,))
            same = back.dtype == value.dtype and back.shape == value.shape and bool((back == value).all())
            through = _leases() > before
            order_kept = back.flags.f_contiguous == value.flags.f_contiguous or not value.flags.f_contiguous
            got.append((name, type(back) is np.ndarray, same, through, order_kept))
        (a,), kw = g.registered_sync("both", args=(frames,), kwargs={"again": frames})
        got.append(("once", a is kw["again"]))
        original = frames.copy()
        edited = g.registered_sync("add_one", args=(frames,))  # the receiver edits its own copy
        got.append(("copy", bool((edited == original + 1).all()), bool((frames == original).all())))
        held = _shm.cache().held_bytes()
        del a, kw, edited, back
        got.append(("freed", _shm.cache().held_bytes() <= held))
    g.barrier()
    g.destroy()
    return got


def test_numpy_arrays_cross_through_shared_memory():
    """RL code moves observations and replay batches as numpy arrays: a large one crosses
    through a lent segment like a tensor (pickled, it went through TensorPipe's bytes at
    0.3-0.7 GB/s, 15 times slower), in any dtype without Python objects, any order
    (Fortran order kept), strided or read-only; one found twice arrives once; the receiver
    owns a copy."""
    got = run_world(_arrays_body, 2, timeout=120)[0]
    expected = [(name, True, True, name not in ("objects", "small"), True)
                for name in ("frames", "float64", "fortran", "strided", "big_endian", "read_only", "records",
                             "datetimes", "objects", "small")]
    assert got == expected + [("once", True), ("copy", True, True), ("freed", True)], got


def _off_body(world):
    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 1:
        g.register("echo", _echo)
    g.barrier()
    if world.rank == 0:
        t = torch.rand(2 * MB)
        before = _leases()
        assert torch.equal(g.registered_sync("echo", (t,)), t)
        assert _leases() == before
        parts = world.transport_stats()  # no shared memory, hence no CUDA IPC either: the lane only,
        # which left the 8 MB call to torch RPC (more bytes of tensors than it carries)
        assert sorted(parts) == ["lane"] and parts["lane"]["not_carried"] >= 1, parts
    g.barrier()
    return True


def test_off_switch_and_settings():
    assert run_world(_off_body, 2, timeout=60, same_host_shm=False) == [True, True]
    for kwargs, match in (({"shm_threshold": 0}, "shm_threshold=0 must be an int >= 1"),
                          ({"shm_cache_bytes": -1}, "shm_cache_bytes=-1"),
                          ({"same_host_shm": "yes"}, "same_host_shm must be a bool")):
        with pytest.raises((ValueError, TypeError), match=match):
            World("x", 0, 1, **kwargs)
    with pytest.raises(ValueError, match="CUDA tensors travel through TensorPipe"):
        share(torch.ones(3, device="meta"))
    with pytest.raises(TypeError, match="must be a torch.Tensor"):
        share([1.0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_never_take_shared_memory():
    cuda = torch.ones(MB, device="cuda")
    assert _shm.encode((cuda, [cuda]), 1) == (cuda, [cuda])
    with pytest.raises(ValueError, match="CUDA tensors travel through TensorPipe"):
        share(cuda)


def _die_holding(x):
    os.kill(os.getpid(), signal.SIGKILL)


_held = threading.Event()


def _hold(x, pid):
    _kept["x"], _kept["pid"] = x, pid
    _held.set()
    return True


def _wait_exit(pid, timeout):
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:  # gone and reaped already
        return True
    try:
        return bool(select.select([fd], [], [], timeout)[0])
    finally:
        os.close(fd)


def _payload(packed, value):
    """8 MB of ``value``: one tensor (a segment of its own) or 128 of 64 KB (packed in one)."""
    if packed:
        return [torch.full((16384,), value) for _ in range(128)]
    return torch.full((2 * MB,), value)


def _total(payload):
    return sum(float(t.sum()) for t in payload) if isinstance(payload, list) else float(payload.sum())


def _sigkill_body(world, packed):
    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 1:
        g.register("die", _die_holding)
    if world.rank == 0:
        g.register("hold", _hold)
    g.barrier()
    if world.rank == 2:
        # the sender dies while the receiver holds what it sent
        assert g.registered_sync("hold", (_payload(packed, 7.0), os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    if world.rank == 1:
        return "victim"  # killed by its own service below
    pids = [os.getpid(), g.rpc_sync("1", os.getpid)]
    with pytest.raises(PeerLostError):
        g.registered_sync("die", (_payload(packed, 1.0),), timeout=20)  # the receiver dies holding it
    assert _held.wait(30)  # rank 2's call arrived; it dies right after
    assert _wait_exit(_kept["pid"], 30)
    held = _kept.pop("x")
    assert _total(held) == 7.0 * 2 * MB  # still readable after its sender died
    del held
    # Rank 1's sockets close before it is a zombie, and a lease of a taker still exiting is
    # not reclaimed yet: its exit is waited for (a loaded machine stretched that window).
    assert _wait_exit(pids[1], 30)
    reclaimed = _shm.cache().stats["reclaimed"]
    _shm.cache().lease(8 * MB)  # the killed receiver's lease (2 M float32) comes back
    assert _shm.cache().stats["reclaimed"] == reclaimed + 1
    world.stop(timeout=2)
    return _our_memory(), pids + [_kept.pop("pid")]


@pytest.mark.parametrize("packed", [False, True])
def test_sigkill_of_either_end_leaves_nothing(packed):
    before = _dev_shm()
    results = run_world(_sigkill_body, 3, args=(packed,), timeout=120, return_exceptions=True, rpc_timeout=30)
    if isinstance(results[0], BaseException):
        raise results[0]  # (rank 0's failure, its remote traceback as the cause)
    memory, pids = results[0]
    assert memory == (0, 0), results
    assert _new_in_dev_shm(before, set(pids)) == []


def _server_body(world):
    from machinlike.server import PushPullModelServerImpl

    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 0:
        PushPullModelServerImpl("server", g)
    g.barrier()
    if world.rank == 1:
        server = g.get_paired("server").to_here()
        model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))
        with torch.no_grad():
            model[0].weight.fill_(3.0)
        before = _leases()
        assert server.push(model)
        assert _leases() - before == 1  # the 4 MB weight; biases and the small layer: TensorPipe
        with torch.no_grad():
            model[0].weight.fill_(-1.0)  # the server holds a copy, not our memory
        fresh = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))
        before_server = g.rpc_sync("0", _leases)
        assert server.pull(fresh)
        assert g.rpc_sync("0", _leases) - before_server == 0  # the server's copy, read in place
        assert float(fresh[0].weight.min()) == float(fresh[0].weight.max()) == 3.0
        with torch.no_grad():
            fresh[0].weight.fill_(9.0)  # and our pulled copy is ours
        again = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))
        assert server.pull(again) and float(again[0].weight.max()) == 3.0
    g.barrier()
    return True


def test_model_server_push_and_pull_through_shared_memory():
    assert run_world(_server_body, 2, timeout=60) == [True, True]


def test_waiting_for_segments_to_be_taken_is_bounded_and_sees_each_taker():
    from machinlike._shm._segments import SegmentCache

    segments = SegmentCache(64 * MB)
    assert segments.wait_taken(0.0)  # nothing lent
    seg = segments.lease(MB)
    started = time.monotonic()
    assert not segments.wait_taken(0.05)  # lent, never taken (a message lost): gives up in time
    assert time.monotonic() - started < 1.0
    seg.header[1] = os.getpid()  # its receiver mapped it: it outlives this process now
    assert segments.wait_taken(0.05)
    other = segments.lease(MB)
    segments.release(other)  # handed back unsent: nothing to wait for
    assert segments.wait_taken(0.05)
    segments.close()


def test_a_full_cache_says_why_once_and_reads_each_taker_once(monkeypatch, caplog):
    import logging

    from machinlike._shm import _segments

    reads = []
    monkeypatch.setattr(_segments, "pid_alive", lambda pid: reads.append(pid) or True)
    segments = _segments.SegmentCache(32 * MB)
    held = [segments.lease(MB) for _ in range(32)]
    for seg in held:
        seg.header[1] = 1  # taken by a live process that keeps them (a replay buffer)
    with caplog.at_level(logging.WARNING, logger="machinlike._shm._segments"):
        reads.clear()
        assert segments.lease(MB) is None and segments.lease(MB) is None
        assert reads == [1, 1]  # one /proc read per lease, not one per lent segment
        assert segments.lease(64 * MB) is None  # larger than the whole cache
        assert segments.stats["fallbacks"] == 3
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 2, said  # each kind once
    assert "all lent to receivers that still hold" in said[0] and "clone()" in said[0]
    assert "larger than shm_cache_bytes" in said[1]
    held[0].header[0] = _segments.FREE  # the receiver let one go
    assert segments.lease(MB) is held[0]
    segments.close()


def _sample(k):
    return [torch.full((16384,), float(k)) for _ in range(50)]  # 50 frames of 64 KB


def _lent():
    return _shm.cache().lent()


def _assert_arrived_as_sent(sent_items, got_items, own_memory):
    """Each item arrived as the same type, dtype, values and layout; with ``own_memory``,
    each in memory of its own (not a view into a shared block)."""
    import numpy as np

    assert len(got_items) == len(sent_items)
    for sent, got in zip(sent_items, got_items):
        assert type(got) is type(sent), type(sent)
        if isinstance(sent, np.ndarray):
            assert got.dtype == sent.dtype and got.shape == sent.shape and (got == sent).all()
            assert got.flags.f_contiguous == sent.flags.f_contiguous
            assert not own_memory or got.base is None or got.base.nbytes == got.nbytes
        else:
            assert got.dtype == sent.dtype and torch.equal(got.detach(), sent.detach())
            assert got.stride() == sent.stride() and got.requires_grad == sent.requires_grad
            assert not own_memory or got.untyped_storage().nbytes() == got.numel() * got.element_size()


def _lent_settles_at(g, count, lane):
    # torch RPC's threads may drop their last reference to a reply a moment after the
    # caller has it; the lane's reader drops its own before it reads on: at once.
    deadline = time.monotonic() + (0.0 if lane else 10.0)
    while g.rpc_sync("1", _lent) != count:
        assert time.monotonic() < deadline, f"the callee's lent segments did not come to {count}"
        time.sleep(0.01)


def _packed_body(world, lane):
    import gc

    import numpy as np

    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 1:
        g.register("echo", _echo)
        g.register("sample", _sample)
        g.register("lent", _lent)
    g.barrier()
    if world.rank == 0:
        rng = np.random.default_rng(0)
        twice = torch.rand(8192)
        items = ([torch.rand(8192) for _ in range(40)]
                 + [torch.rand(1, 3, 32, 32).to(memory_format=torch.channels_last) for _ in range(10)]
                 + [torch.arange(4096).reshape(64, 64).t() for _ in range(10)]
                 + [torch.rand(8192).to(torch.bfloat16), torch.rand(8192) > 0.5, torch.rand(4096, dtype=torch.float64),
                    torch.nn.Parameter(torch.rand(4096), requires_grad=False), torch.rand(10), twice, twice]
                 + [rng.random(4096).astype(np.float32) for _ in range(10)]
                 + [np.asfortranarray(rng.random((64, 64))) for _ in range(5)]
                 + [rng.random((128, 64))[::2, ::-1]])  # strided: copied by numpy, not moved
        before = _leases() + g.rpc_sync("1", _leases)
        out = g.registered_sync("echo", (items,))
        assert _leases() + g.rpc_sync("1", _leases) - before == 2  # one segment there, one back
        _assert_arrived_as_sent(items, out, own_memory=False)
        assert out[-17] is out[-18]  # one tensor twice arrives as one
        assert out[-19].numel() == 10  # (small: pickled in the message)
        del out
        _lent_settles_at(g, 0, lane)
        # The lease lasts while any item of the message lives, and only that long.
        first = g.registered_sync("sample", (1,))
        assert g.rpc_sync("1", _lent) == 1
        one = first[7]
        del first
        gc.collect()
        assert g.rpc_sync("1", _lent) == 1
        second = g.registered_sync("sample", (2,))  # another segment: ours is still held
        assert float(one.sum()) == 16384.0 and all(float(t[0]) == 2.0 for t in second)
        del one, second
        _lent_settles_at(g, 0, lane)
        created = g.rpc_sync("1", lambda: _shm.cache().stats["created"])
        for k in range(30):
            assert float(g.registered_sync("sample", (k,))[-1][-1]) == k
        assert g.rpc_sync("1", lambda: _shm.cache().stats["created"]) - created <= 1  # recycled
    g.barrier()
    g.destroy()


@pytest.mark.parametrize("lane", [True, False])
def test_many_medium_tensors_and_arrays_cross_in_one_segment(lane):
    """A replay sample (hundreds of tensors or arrays under the threshold, adding up to it)
    is copied into one lent segment: every dtype, layout and order arrives as sent, one
    object twice as one; the segment is lent while any of its items lives, then recycled;
    through the lane and through torch RPC alike."""
    run_world(_packed_body, 2, args=(lane,), timeout=120, same_host_lane=lane)


def _pinning_body(world):
    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 1:
        g.register("sample", _sample)
        g.register("lent", _lent)
    g.barrier()
    result = None
    if world.rank == 0:
        kept = [g.registered_sync("sample", (k,))[3] for k in range(10)]  # one frame of each sample
        assert [float(t[0]) for t in kept] == [float(k) for k in range(10)]
        lent = g.rpc_sync("1", _lent)
        fallbacks = g.rpc_sync("1", lambda: _shm.cache().stats["fallbacks"])
        del kept
        result = lent, fallbacks, g.rpc_sync("1", _lent)
    g.barrier()
    return result


def test_a_receiver_that_keeps_a_few_items_of_each_message_pins_a_bounded_amount():
    # Each sample's 50 frames view one 4 MiB segment; keeping one frame keeps the segment.
    # Past half the receiver's shm_cache_bytes (8 MiB: one segment) it copies items out,
    # so its sender's segments come back at once and no send falls back.
    result = run_world(_pinning_body, 2, timeout=120, shm_cache_bytes=8 * MB)
    assert result[0] == (1, 0, 0), result


def _small_body(world):
    import numpy as np

    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 1:
        g.register("both", _both)
    g.barrier()
    if world.rank == 0:
        shared = torch.rand(8)
        smalls = ([torch.rand(8) for _ in range(20)]
                  + [torch.arange(12).reshape(3, 4).t(), torch.rand(1, 2, 3, 3).to(memory_format=torch.channels_last),
                     torch.rand(16) > 0.5, torch.rand(16).to(torch.bfloat16), torch.zeros(0),
                     torch.nn.Parameter(torch.rand(4), requires_grad=False), torch.rand(3, requires_grad=True),
                     np.asfortranarray(np.random.rand(4, 4)), np.arange(6, dtype=np.int16), shared,
                     torch.tensor(0.5), torch.tensor(7), np.array(2.5, dtype=np.float32),  # 0-d: a reward
                     np.arange(6, dtype=np.int16) + 1, torch.rand(8).to(torch.float16)])
        args, kwargs = g.registered_sync("both", args=tuple(smalls), kwargs={"again": shared})
        _assert_arrived_as_sent(smalls, args, own_memory=True)
        at = next(i for i, x in enumerate(smalls) if x is shared)
        assert args[at] is kwargs["again"]  # one tensor in args and kwargs arrives as one
    g.barrier()
    g.destroy()


@pytest.mark.parametrize("lane", [True, False])
def test_many_small_tensors_and_arrays_cross_as_one_bundle(lane):
    """A list of transitions holds thousands of tiny tensors: one bytes object carries them
    (per-tensor pickling cost more than their bytes); each arrives in memory of its own,
    every dtype, layout and order as sent, one object found twice as one."""
    run_world(_small_body, 2, timeout=120, same_host_lane=lane)


def test_small_items_are_bundled_from_eight_on_and_aliasing_survives():
    import pickle

    from machinlike._shm._pack import SMALL_MIN, _Packed

    few = [torch.rand(8) for _ in range(SMALL_MIN - 1)]
    data = pickle.dumps(_shm.encode(few, MB))  # too few to bother: each pickles as itself
    assert b"_load_small" not in data and all(torch.equal(a, b) for a, b in zip(pickle.loads(data), few))
    many = [torch.rand(8) for _ in range(SMALL_MIN)]
    out, kwargs = _shm.encode_parts(((many, many[0]), {"k": many[0]}), MB)
    assert all(type(x) is _Packed for x in out[0]) and out[1] is out[0][0]
    assert kwargs["k"] is out[0][0]  # args and kwargs are one walk
    back = pickle.loads(pickle.dumps(out))
    assert all(torch.equal(a, b) for a, b in zip(back[0], many)) and back[1] is back[0][0]
    assert len({t.untyped_storage().data_ptr() for t in back[0]}) == SMALL_MIN  # each its own memory


def test_same_host_verdicts_stay_bounded_through_endless_churn():
    """Each member ever called left a verdict by worker and one by process identity: an
    elastic world whose actors come and go for days grew both without end."""
    from machinlike.distributed._calls import samehost as _samehost
    from machinlike._pids import own_identity
    from machinlike.distributed._membership import process_identity

    space = process_identity().rpartition("/")[0]
    host = _samehost.SameHost(False, 1 << 20, 1 << 30, lambda worker: f"{space}/{os.getpid()}+{worker[1:]}")
    try:
        for i in range(3 * _samehost.VERDICTS_KEPT):
            assert host.local(f"w{i}")  # (this process: same host, reachable)
            assert host.word_of(f"w{i}") == own_identity()  # (the process named: this one, pid and start)
        assert len(host._by_worker) <= _samehost.VERDICTS_KEPT and len(host._verdicts) <= _samehost.VERDICTS_KEPT
        assert len(host._words) <= _samehost.VERDICTS_KEPT
        assert host.local("w7") and host.local(f"w{3 * _samehost.VERDICTS_KEPT - 1}")  # (asked again, same answer)
    finally:
        host.close()


def test_reachable_answers_for_the_process_a_pid_names_now():
    from machinlike._shm import _segments

    child = subprocess.Popen(["sleep", "30"])
    try:
        assert _segments.reachable(child.pid) and _segments.reachable(os.getpid())
    finally:
        child.kill()
        child.wait(timeout=30)
    # (gone: no verdict of the dead process is kept for whatever takes its pid next)
    assert not _segments.reachable(child.pid)
    assert not hasattr(_segments, "_reachable")
