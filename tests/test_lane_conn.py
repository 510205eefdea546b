"""A lane connection's answers: a sync caller reads its own, the watcher the rest (lane_conn).

The peer is the other end of a socket pair, answering by hand, so each test chooses what
comes when: answers out of order, half a frame, a hang-up.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import torch

from machinlike.distributed._transport.lane_conn import Conn, LaneTimeout, Pending
from machinlike.distributed._transport.lane_frames import FrameReader
from machinlike.distributed._transport.lane_future import LaneFuture
from machinlike.distributed._transport.lane_wire import (
    OK, OUT_OF_BAND, REQ, load_body, read_frame, reply_bytes, send_frame,
)


def _thread_name() -> str:
    return threading.current_thread().name


class Where:
    """Unpickles as the name of the thread that unpickles it."""

    def __reduce__(self):
        return _thread_name, ()


def _frame_bytes(cid, value):
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(5)
    with a, b:
        def send():
            send_frame(a, OK, cid, reply_bytes(value), time.monotonic() + 5)
            a.shutdown(socket.SHUT_WR)
        sender = threading.Thread(target=send)  # (a frame larger than the socket's buffer)
        sender.start()
        out = bytearray()
        while chunk := b.recv(1 << 20):
            out += chunk
        sender.join()
    return bytes(out)


@pytest.fixture
def pair():
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    theirs.settimeout(5)
    conn = Conn(4242, mine, lambda c: None)
    yield conn, theirs
    conn.close("test over")
    theirs.close()


def _requests(theirs, count):
    """The ids of the next ``count`` requests the peer reads."""
    ids = []
    for _ in range(count):
        kind, cid, _ = read_frame(theirs)
        assert kind == REQ
        ids.append(cid)
    return ids


def _answer(theirs, cid, value):
    send_frame(theirs, OK, cid, reply_bytes(value), time.monotonic() + 5)


def test_a_frame_read_in_pieces_across_deadlines_comes_whole():
    big = torch.arange(OUT_OF_BAND // 4 * 2, dtype=torch.float32)
    whole = _frame_bytes(7, [big, "small"])
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(0.0)
        reader = FrameReader(b)
        sent = 0
        for cut in (3, 15 + 4, 15 + 8 + 30, len(whole) - 100):  # in the header, sizes, pickle, buffer
            a.sendall(whole[sent:cut])
            sent = cut
            assert reader.read(0.01) is None  # out of time mid-frame: what came is kept
        a.sendall(whole[sent:])
        kind, cid, body = reader.read(1.0)
        assert (kind, cid) == (OK, 7)
        got = load_body(body)
        assert torch.equal(got[0], big) and got[1] == "small"
        a.sendall(_frame_bytes(8, None)[:10])  # inside the header
        a.close()
        with pytest.raises(EOFError):
            reader.read(1.0)


def test_a_sync_caller_unpickles_its_answer_itself_and_the_watcher_an_async_one(pair):
    conn, theirs = pair
    fut = LaneFuture()
    async_id = conn.send(b"a", Pending(fut, time.monotonic() + 5))
    sync = Pending(None, time.monotonic() + 5)
    sync_id = conn.send(b"s", sync)
    assert _requests(theirs, 2) == [async_id, sync_id]
    # The sync caller reads both: the async answer comes first and goes to the watcher.
    threading.Timer(0.05, lambda: (_answer(theirs, async_id, Where()), _answer(theirs, sync_id, Where()))).start()
    assert conn.wait(sync_id, sync) == threading.current_thread().name
    assert fut.wait() == "machinlike-lane-4242"
    assert conn._due == 0 and conn.late == 0


def test_concurrent_sync_callers_each_get_their_own_answer(pair):
    conn, theirs = pair
    got = {}

    def call(tag):
        pending = Pending(None, time.monotonic() + 5)
        cid = conn.send(b"x", pending)
        got[tag] = (cid, conn.wait(cid, pending))

    threads = [threading.Thread(target=call, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    ids = _requests(theirs, 4)
    for cid in reversed(ids):  # answered last to first: most are read by another caller
        _answer(theirs, cid, cid * 10)
    for t in threads:
        t.join(5)
    assert sorted(got.values()) == sorted((cid, cid * 10) for cid in ids)


def test_a_caller_out_of_time_mid_frame_lets_the_next_reader_finish_it(pair):
    conn, theirs = pair
    late = Pending(None, time.monotonic() + 0.2)
    late_id = conn.send(b"x", late)
    (seen,) = _requests(theirs, 1)
    whole = _frame_bytes(seen, torch.ones(OUT_OF_BAND // 4))
    theirs.sendall(whole[:40])  # half a frame, then nothing until the caller gave up
    start = time.monotonic()
    with pytest.raises(LaneTimeout):
        conn.wait(late_id, late)
    assert time.monotonic() - start < 1.0
    theirs.sendall(whole[40:])  # the rest: the watcher reads it to the end and drops it
    deadline = time.monotonic() + 5
    while conn.late == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert conn.late == 1
    after = Pending(None, time.monotonic() + 5)
    after_id = conn.send(b"y", after)
    threading.Timer(0.02, lambda: _answer(theirs, _requests(theirs, 1)[0], "framed")).start()
    assert conn.wait(after_id, after) == "framed"  # the stream is still framed


def test_a_peer_that_hangs_up_fails_the_waiting_caller_and_the_descriptor_closes(pair):
    conn, theirs = pair
    pending = Pending(None, time.monotonic() + 5)
    cid = conn.send(b"x", pending)
    _requests(theirs, 1)
    threading.Timer(0.05, theirs.close).start()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="closed under the call: eof"):
        conn.wait(cid, pending)
    assert time.monotonic() - start < 1.0
    deadline = time.monotonic() + 5
    while conn._sock.fileno() != -1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert conn._sock.fileno() == -1


def test_an_idle_connection_notices_its_peer_hang_up(pair):
    conn, theirs = pair
    theirs.close()  # no call pending: only the watcher can notice
    deadline = time.monotonic() + 5
    while conn.closed is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert conn.closed == "eof"
    with pytest.raises(Exception, match="closed"):
        conn.send(b"x", Pending(None, time.monotonic() + 5))


def _async_then_sync(conn, theirs):
    """An async call, then a sync one, both read by the peer: (future, its id, the sync
    call's Pending, its id)."""
    fut = LaneFuture()
    async_id = conn.send(b"a", Pending(fut, time.monotonic() + 5))
    sync = Pending(None, time.monotonic() + 5)
    sync_id = conn.send(b"s", sync)
    _requests(theirs, 2)
    return fut, async_id, sync, sync_id


def test_an_async_answer_a_caller_handed_over_is_settled_though_the_watcher_woke_for_it(pair):
    # The watcher, awake for answers (async ones came last), and a sync caller both wake
    # for the same bytes; the caller reads them (an async answer, handed over, then its
    # own) and lets go; the watcher then took the role and waited for a next frame before
    # settling what it was handed: the IMPALA example's actors waited for their answers.
    conn, theirs = pair
    for round_ in range(200):
        fut, async_id, sync, sync_id = _async_then_sync(conn, theirs)
        both = _frame_bytes(async_id, round_) + _frame_bytes(sync_id, -round_)
        threading.Timer(0.001, theirs.sendall, (both,)).start()
        assert conn.wait(sync_id, sync) == -round_
        deadline = time.monotonic() + 5
        while not fut.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert fut.done() and fut.wait() == round_, f"round {round_}: the async answer was never settled"


def test_many_small_frames_come_in_one_read_and_a_large_buffer_straight_into_its_own():
    big = torch.arange(OUT_OF_BAND // 4 * 4, dtype=torch.float32)  # 256 KB: read into itself
    burst = b"".join(_frame_bytes(cid, cid * 10) for cid in range(1, 41)) + _frame_bytes(41, big)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.settimeout(0.0)
        reader = FrameReader(b)
        assert reader.take() is None and not reader.ahead  # (nothing read yet: no system call)
        a.sendall(burst[:5000])
        first = reader.read(1.0)
        assert first[:2] == (OK, 1) and load_body(first[2]) == 10
        assert reader.ahead  # the rest of the 5,000 bytes came with it
        taken = []
        while (frame := reader.take()) is not None:  # whole ones only, no system call
            taken.append(load_body(frame[2]))
        assert taken == [cid * 10 for cid in range(2, len(taken) + 2)] and 10 < len(taken) < 40
        sender = threading.Thread(target=a.sendall, args=(burst[5000:],))  # (more than the socket holds)
        sender.start()
        rest = [reader.read(2.0) for _ in range(40 - len(taken))]
        sender.join()
        assert [load_body(f[2]) for f in rest[:-1]] == [cid * 10 for cid in range(len(taken) + 2, 41)]
        assert rest[-1][1] == 41 and torch.equal(load_body(rest[-1][2]), big)
        assert not reader.ahead


def _awake_for_answers(conn, theirs):
    """An async call answered while no caller read: the watcher now wakes for answers."""
    warm = LaneFuture()
    warm_id = conn.send(b"a", Pending(warm, time.monotonic() + 5))
    _requests(theirs, 1)
    _answer(theirs, warm_id, 0)
    assert warm.wait() == 0
    deadline = time.monotonic() + 5
    while not conn._answers and time.monotonic() < deadline:
        time.sleep(0.001)
    assert conn._answers


def test_answers_a_caller_read_ahead_reach_their_futures_though_no_byte_is_left_to_wake_the_watcher(pair):
    conn, theirs = pair
    _awake_for_answers(conn, theirs)
    for round_ in range(20):
        fut, async_id, sync, sync_id = _async_then_sync(conn, theirs)
        # The caller holds the read role when both answers come in one write: its one read
        # takes them both, and the socket is empty when it lets go.
        both = _frame_bytes(sync_id, "s") + _frame_bytes(async_id, round_)
        threading.Timer(0.02, theirs.sendall, (both,)).start()
        assert conn.wait(sync_id, sync) == "s"
        deadline = time.monotonic() + 2
        while not fut.done() and time.monotonic() < deadline:
            time.sleep(0.001)
        assert fut.done() and fut.wait() == round_, f"round {round_}: the async answer stayed read ahead"


def test_the_watcher_stops_waking_for_answers_once_none_is_due_to_it(pair):
    conn, theirs = pair
    _awake_for_answers(conn, theirs)
    deadline = time.monotonic() + 5
    sync = Pending(None, time.monotonic() + 5)
    sync_id = conn.send(b"s", sync)
    _requests(theirs, 1)
    _answer(theirs, sync_id, "s")  # before its caller waits: the watcher wakes and reads it
    while not sync.done and time.monotonic() < deadline:
        time.sleep(0.001)
    assert conn.wait(sync_id, sync) == "s"
    assert not conn._answers  # no answer is due to it: the next sync answers do not wake it
