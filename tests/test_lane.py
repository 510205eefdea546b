"""The same-host lane (issue 37) across real processes: RpcGroup calls between members of
one host go through machinlike's Unix socket, what it does not carry goes through torch
RPC, an idle member sleeps, a SIGKILLed callee fails its calls at once, and the off switch."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest
import torch

from machinlike.distributed import World
from machinlike.distributed._calls.send import translate_error
from machinlike.distributed._transport import lane as _lane
from machinlike.distributed._transport import lane_conn
from machinlike.distributed._transport.lane_wire import NotForLane, load_body, request_bytes
from machinlike.exception import PeerLostError
from machinlike.testing import run_world


class Refused(Exception):
    """A custom exception: it arrives as itself through the lane too."""


def _echo(x):
    return x


def _refuse(why):
    raise Refused(why)


def _sleep(seconds):
    time.sleep(seconds)
    return seconds


def _stats():
    lane = _lane.current()
    return None if lane is None else lane.stats()


def _cpu_seconds():
    with open("/proc/self/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _calls_body(world):
    g = world.create_rpc_group("g", world.get_members())
    g.register(f"echo{world.rank}", _echo)
    g.register(f"refuse{world.rank}", _refuse)
    g.barrier()
    if world.rank == 1:
        before = _stats()
        small = torch.arange(6.0).reshape(2, 3)
        got = g.registered_sync("echo0", ({"t": small, "n": 3},))
        assert torch.equal(got["t"], small) and got["n"] == 3
        assert g.registered_async("echo0", (small.t(),)).wait().tolist() == small.t().tolist()
        assert g.rpc_sync("0", _echo, args=("plain",)) == "plain"
        assert g.rpc_async("0", lambda: os.getpid()).wait() != os.getpid()  # a shipped lambda
        leaf = torch.ones(3, requires_grad=True)
        back = g.registered_sync("echo0", (leaf,))
        assert back.requires_grad and back.grad_fn is None
        with pytest.raises(Refused, match="no entry"):
            g.registered_sync("refuse0", ("no entry",))
        with pytest.raises(Refused):
            g.registered_async("refuse0", ("later",)).wait()
        middle = _stats()
        assert middle["calls"] - before["calls"] >= 7, (before, middle)
        # What the lane leaves to torch RPC still arrives: autograd history, a large
        # tensor with the shared-memory path off (below), a handle.
        grown = torch.ones(2, requires_grad=True) * 2
        assert g.registered_sync("echo0", (grown,)).tolist() == [2.0, 2.0]
        after = _stats()
        assert after["not_carried"] == middle["not_carried"] + 1, (middle, after)
        assert after["calls"] == middle["calls"]
        assert after["connections"] == 1  # one to rank 0, however many calls
    g.barrier()
    return world.rank


def test_calls_take_the_lane_and_what_it_refuses_takes_torch_rpc():
    assert run_world(_calls_body, 2, timeout=90) == [0, 1]


def test_the_lane_refuses_before_sending():
    with pytest.raises(NotForLane, match="autograd history"):
        request_bytes(_echo, (torch.ones(2, requires_grad=True) * 3,))
    with pytest.raises(NotForLane, match="bytes"):
        request_bytes(_echo, (torch.zeros(_lane.TENSOR_LIMIT // 4 + 1),))
    with pytest.raises(NotForLane, match="PicklingError|lambda"):
        request_bytes(_echo, (lambda: 1,))
    with pytest.raises(NotForLane):
        request_bytes(_echo, (threading.Lock(),))
    assert request_bytes(_echo, (torch.zeros(_lane.TENSOR_LIMIT // 4),))  # the bound itself travels
    # The bound is the call's, not each tensor's: many medium tensors moved through the
    # lane's socket at a quarter of TensorPipe's speed (200 x 64 KB: 55 ms against 15).
    with pytest.raises(NotForLane, match="more than"):
        request_bytes(_echo, ([torch.zeros(_lane.TENSOR_LIMIT // 16) for _ in range(5)],))


def test_large_buffers_travel_out_of_band_each_into_a_buffer_of_its_own():
    """Their bytes go from the tensor to the socket and from the socket into the receiver's
    own buffer (they were copied five times each way inside the pickle); a tensor kept
    alone keeps only its own bytes."""
    import numpy as np

    from machinlike.distributed._transport.lane_wire import OUT_OF_BAND, read_frame, reply_bytes, send_frame

    big, small = torch.randn(OUT_OF_BAND // 4 * 3), torch.randn(8)
    array = np.arange(OUT_OF_BAND, dtype=np.uint8)
    body = reply_bytes([big, small, array, big[::2]])
    assert [b.nbytes for b in body.buffers] == [big.nbytes, array.nbytes, big.nbytes // 2]
    assert len(body.data) < 2048  # the bulk is not in the pickle
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine.settimeout(5)
    theirs.settimeout(5)
    with mine, theirs:
        sender = threading.Thread(target=send_frame, args=(mine, 1, 7, body, time.monotonic() + 5))
        sender.start()
        kind, cid, got = read_frame(theirs)
        sender.join()
    back = load_body(got)
    assert (kind, cid) == (1, 7)
    assert torch.equal(back[0], big) and torch.equal(back[1], small) and (back[2] == array).all()
    assert torch.equal(back[3], big[::2])
    assert back[0].untyped_storage().nbytes() == big.nbytes  # its own buffer, not the frame's
    back[0].add_(1)  # writable, and nobody else's
    assert torch.equal(back[3], big[::2])


def _conn_to(peer_closes_reading: bool):
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    if peer_closes_reading:
        theirs.shutdown(socket.SHUT_RD)  # our sends break (EPIPE); our reader sees no eof
    return lane_conn.Conn(4242, mine, lambda conn: None), theirs


def test_a_frame_cut_inside_its_buffers_reads_as_eof():
    """A peer killed while writing a frame's out-of-band buffers: the reader sees the end
    (its calls then fail as lost), not a short buffer or a wait for bytes that never come."""
    from machinlike.distributed._transport.lane_wire import OUT_OF_BAND, read_frame, reply_bytes

    body = reply_bytes([torch.zeros(OUT_OF_BAND // 4), torch.zeros(OUT_OF_BAND // 4)])
    whole = _frame_bytes(body)
    for cut in (15, 15 + 8, len(whole) - OUT_OF_BAND - 1, len(whole) - 1):  # sizes, pickle, buffers
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        theirs.settimeout(5)
        with mine, theirs:
            mine.sendall(whole[:cut])
            mine.close()
            assert read_frame(theirs) is None, cut


def _frame_bytes(body):
    from machinlike.distributed._transport.lane_wire import send_frame

    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    mine.settimeout(5)
    theirs.settimeout(5)
    got = bytearray()
    with mine, theirs:
        sender = threading.Thread(target=lambda: (send_frame(mine, 1, 3, body, time.monotonic() + 5), mine.close()))
        sender.start()
        while chunk := theirs.recv(1 << 20):
            got += chunk
        sender.join()
    return bytes(got)


def test_a_send_that_breaks_names_a_lost_peer_and_one_out_of_time_a_timeout():
    # A callee that died before this reader noticed breaks the send itself: that must
    # read as a lost peer, not as a timeout (CI once saw a 60 s "did not answer" here).
    conn, theirs = _conn_to(peer_closes_reading=True)
    with pytest.raises(RuntimeError) as broke:
        conn.send(b"x" * 100, lane_conn.Pending(None, time.monotonic() + 5))
    assert isinstance(translate_error(broke.value, "h", "the call", 5), PeerLostError), broke.value
    deadline = time.monotonic() + 5
    while conn._sock.fileno() != -1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert conn._sock.fileno() == -1  # its reader closed the descriptor (it waited for GC before)
    theirs.close()
    # A callee that reads nothing: the frame cannot leave by its deadline.
    conn, theirs = _conn_to(peer_closes_reading=False)
    with pytest.raises(RuntimeError) as late:
        conn.send(b"x" * (8 << 20), lane_conn.Pending(None, time.monotonic() + 0.2))
    assert isinstance(translate_error(late.value, "h", "the call", 0.2), TimeoutError), late.value
    conn.close("test over")
    theirs.close()


def test_the_expiry_heap_sheds_answered_calls_and_survives_an_answer_during_its_add():
    # rpc.py's 64-in-flight loop once met an IndexError here: past 4,096 entries the heap
    # sheds answered calls, and a call answered before its own add left nothing in it.
    expiry = _lane._Expiry()
    conn, theirs = _conn_to(peer_closes_reading=False)
    far = time.monotonic() + 600

    def add(cid, answered_first=False):
        pending = lane_conn.Pending(_lane.LaneFuture(), far)
        if answered_first:
            pending.fut.set_result(cid)
        expiry.add(conn, cid, pending)
        pending.fut.done() or pending.fut.set_result(cid)  # (answered after its add: the common order)
        return pending

    try:
        for cid in range(4096):
            add(cid)
        late = add(4096, answered_first=True)  # the 4,097th: answered before its add
        assert all(entry[4] is not late for entry in expiry._heap)
        for cid in range(4097, 6000):
            add(cid)
        assert len(expiry._heap) <= 4097  # shed, not one entry per call ever made
        live = lane_conn.Pending(_lane.LaneFuture(), time.monotonic() + 0.2)
        expiry.add(conn, conn.send(b"call", live), live)  # (a real send: the peer never answers)
        with pytest.raises(RuntimeError, match="timed out"):
            live.fut.wait()  # still expired at its deadline
    finally:
        expiry.stop()
        conn.close("test over")
        theirs.close()


def test_an_answered_calls_expiry_entry_lets_its_future_go():
    # An entry stays in the heap until its deadline (or the heap's shedding): it must not
    # keep the future alive, nor what an RpcFuture holds (its retry, the call's arguments).
    import gc
    import weakref

    fut = _lane.LaneFuture()
    gone = weakref.ref(fut)
    pending = lane_conn.Pending(fut, time.monotonic() + 600)
    heap = [pending]  # (what the expiry keeps)
    pending.complete("answer", None)
    assert fut.wait() == "answer" and pending.fut is None
    del fut
    gc.collect()
    assert gone() is None and heap[0].fut is None


def _idle_body(world, same_host_lane):
    g = world.create_rpc_group("g", world.get_members())
    g.barrier()
    assert g.rpc_sync(str(1 - world.rank), _echo, args=(1,)) == 1  # the pipes are open
    g.barrier()
    before = _cpu_seconds()
    time.sleep(2.0)
    used = (_cpu_seconds() - before) / 2.0
    g.barrier()
    return used


def test_an_idle_member_sleeps():
    # With TensorPipe's shared-memory transport each idle process here spins (about a
    # core between them); with the lane (TensorPipe on TCP) they sleep.
    used = run_world(_idle_body, 2, args=(True,), timeout=90)
    assert max(used) < 0.10, f"idle members used {used} of a core each"


def _kill_body(world):
    g = world.create_rpc_group("g", world.get_members())
    g.register(f"sleep{world.rank}", _sleep)
    g.barrier()
    if world.rank == 1:
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGKILL)).start()
        g.barrier(timeout=30)
        return "killed"
    pending = g.registered_async("sleep1", (20,), timeout=30)
    chained = g.registered_async("sleep1", (20,), timeout=30).then(lambda f: f.wait())  # (the loss, as itself)
    start = time.monotonic()
    with pytest.raises(PeerLostError, match="'1'"):
        g.registered_sync("sleep1", (20,), timeout=30)
    took = time.monotonic() - start
    with pytest.raises(PeerLostError):
        pending.wait()
    with pytest.raises(PeerLostError, match="'1'"):
        chained.wait()
    assert took < 5.0, took
    with pytest.raises(TimeoutError, match="within 0.3 s"):
        g.registered_sync("sleep0", (2,), timeout=0.3)  # (its own lane: a call to itself)
    return _stats()


def test_a_killed_callee_fails_its_lane_calls_at_once():
    results = run_world(_kill_body, 2, timeout=90, return_exceptions=True, rpc_timeout=30)
    stats = results[0]
    assert isinstance(stats, dict), results
    assert stats["connections"] <= 1  # the dead peer's is gone (its own may stay)


def _off_body(world):
    g = world.create_rpc_group("g", world.get_members())
    g.register(f"echo{world.rank}", _echo)
    g.barrier()
    value = g.registered_sync(f"echo{1 - world.rank}", (torch.ones(3),))
    g.barrier()
    return float(value.sum()), _stats()


def test_the_off_switch():
    assert run_world(_off_body, 2, timeout=90, same_host_lane=False) == [(3.0, None), (3.0, None)]
    with pytest.raises(TypeError, match="same_host_lane must be a bool"):
        World("x", elastic=True, same_host_lane="yes")


@pytest.mark.parametrize("make", [
    lambda: torch.tensor(5).expand(1),           # one element, stride 0
    lambda: torch.zeros(3).expand(4, 3),         # expanded
    lambda: torch.arange(12).reshape(3, 4).t(),  # not contiguous
    lambda: torch.arange(10)[2:7:2],             # offset and step
    lambda: torch.empty(0, 3),
    lambda: torch.tensor(2.5),                   # 0-dim
    lambda: torch.tensor([True, False]),
    lambda: torch.randn(3, dtype=torch.complex64).conj(),
    lambda: -torch.randn(2, 2, dtype=torch.complex64).conj().imag,
    lambda: torch.randn(4).to(torch.bfloat16),
    lambda: torch.nn.Parameter(torch.randn(2, 3)),
], ids=["stride0", "expanded", "transposed", "strided", "empty", "0-dim", "bool", "conj", "neg", "bf16", "param"])
def test_the_lanes_pickling_keeps_every_plain_tensor(make):

    from machinlike.distributed._transport.lane_wire import reply_bytes

    tensor = make()
    fn, (back,) = load_body(request_bytes(_echo, (tensor,)))
    assert fn is _echo and type(back) is type(tensor) and back.dtype == tensor.dtype
    assert back.shape == tensor.shape and back.requires_grad == tensor.requires_grad
    assert torch.equal(back.detach().resolve_conj(), tensor.detach().resolve_conj())
    assert torch.equal(load_body(reply_bytes(tensor)).detach().resolve_conj(), tensor.detach().resolve_conj())


@pytest.mark.parametrize("make", [
    lambda: torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
    lambda: torch.randn(2, 3, 2, 4, 5).to(memory_format=torch.channels_last_3d),
    lambda: torch.arange(12.).reshape(3, 4).t(),
], ids=["channels_last", "channels_last_3d", "transposed"])
def test_a_dense_tensor_keeps_its_layout_both_ways(make):
    """As through torch RPC: a channels-last batch arrives channels-last (and a transpose as
    a transpose), not as a contiguous copy the receiver's convolutions convert again."""

    from machinlike import pickle as mpickle
    from machinlike.distributed._transport.lane_wire import reply_bytes

    tensor = make()
    _, (back,) = load_body(request_bytes(_echo, (tensor,)))
    replied = load_body(reply_bytes(tensor))
    copied = mpickle.loads(mpickle.dumps(tensor, copy_tensor=True))
    for got in (back, replied, copied):
        assert torch.equal(got, tensor) and got.stride() == tensor.stride()



def _kept_futures_body(world):
    import gc
    import weakref
    group = world.create_rpc_group("kept", ["0", "1"])
    group.register(f"echo{world.rank}", _echo)
    group.barrier()
    freed = None
    if world.rank == 0:
        sent = [torch.rand(50_000) for _ in range(4)]
        refs = [weakref.ref(t) for t in sent]
        futures = [group.registered_async("echo1", args=(t,)) for t in sent]  # an actor's habit
        assert all(torch.equal(f.wait(), t) for f, t in zip(futures, sent))
        del sent
        gc.collect()
        freed = [ref() is None for ref in refs]  # the futures live on, the arguments must not
        assert futures
    group.barrier()
    return freed


@pytest.mark.parametrize("lane", [True, False])
def test_a_kept_future_does_not_keep_its_arguments(lane):
    # Each future held the closure that resends the call (for a stale owner cache), so an
    # actor that kept its futures kept every trajectory it had sent: 100 KB a call.
    assert run_world(_kept_futures_body, 2, timeout=90, same_host_lane=lane)[0] == [True] * 4
