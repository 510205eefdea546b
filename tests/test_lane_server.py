"""The lane's callee (lane_server, lane_crew): the thread that read a call runs it, nobody
woken; a request that comes meanwhile wakes the spare, and another thread reads it, so a
call that waits for a later one on its connection is served; at most ``threads`` calls run
at once. The lane here calls its own process, through its real socket."""

from __future__ import annotations

import collections
import os
import threading
import time

import pytest

from machinlike.distributed._transport import lane as _lane
from machinlike.distributed._transport import lane_frames

_gate = threading.Event()
_count = threading.Lock()
_now = [0, 0]  # calls running, most at once


def _wait_for_gate():
    return _gate.wait(10)


def _open_gate():
    _gate.set()
    return threading.current_thread().name


_read_by = [0]  # the thread that read the last frame


def _read_here():
    return _read_by[0] == threading.get_ident(), threading.get_ident()


def _occupy(seconds):
    with _count:
        _now[0] += 1
        _now[1] = max(_now)
    time.sleep(seconds)
    with _count:
        _now[0] -= 1
    return threading.current_thread().name


@pytest.fixture
def lane():
    if _lane.current() is not None:
        pytest.skip("this process runs a World's lane (one listening address a process)")
    made = _lane.Lane(2)
    yield made
    made.close(1.0)


def _serving():
    return [t for t in threading.enumerate() if t.name == "machinlike-lane-serve"]


def test_a_call_that_waits_for_a_later_call_on_its_connection_is_served(lane):
    _gate.clear()
    first = lane.call_async(os.getpid(), _wait_for_gate, (), 10.0)
    assert lane.call_sync(os.getpid(), _open_gate, (), 10.0) == "machinlike-lane-serve"
    assert first.wait() is True
    assert lane.stats()["connections"] == 1


def test_at_most_threads_calls_run_at_once_and_the_rest_wait_their_turn(lane):
    _now[:] = [0, 0]
    start = time.monotonic()
    futures = [lane.call_async(os.getpid(), _occupy, (0.2,), 10.0) for _ in range(6)]
    assert [f.wait() for f in futures] == ["machinlike-lane-serve"] * 6
    took = time.monotonic() - start
    assert _now == [0, 2], _now
    assert 0.55 < took < 3.0, took  # three turns of two
    # Idle threads are kept up to the most that run at once, besides the connection's reader.
    deadline = time.monotonic() + 5
    while len(_serving()) > 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(_serving()) <= 3


def test_the_thread_that_read_a_call_runs_it_and_nobody_is_woken_for_it(lane, monkeypatch):
    read = lane_frames.FrameReader.read

    def noting(self, timeout):
        frame = read(self, timeout)
        if frame is not None:
            _read_by[0] = threading.get_ident()
        return frame

    monkeypatch.setattr(lane_frames.FrameReader, "read", noting)
    answers = [lane.call_sync(os.getpid(), _read_here, (), 10.0) for _ in range(50)]
    assert all(here for here, _ in answers)  # whichever thread read a call ran it
    # One after another, the calls mostly find their connection's reader back and waiting:
    # one thread reads and runs them (another is started only when a request comes before
    # the reader is back from its call: rare here, under load more often).
    idents = collections.Counter(ident for _, ident in answers)
    assert idents.most_common(1)[0][1] >= 25, idents


def test_a_caller_that_hangs_up_while_its_call_runs_leaves_no_connection_behind(lane):
    import socket

    from machinlike.distributed._transport.lane_wire import HELLO, REQ, address, read_frame, request_bytes, send_frame

    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(5)
    sock.connect(address(os.getpid()))
    assert read_frame(sock, patient=False)[0] == HELLO
    send_frame(sock, REQ, 1, request_bytes(_occupy, (0.3,)), time.monotonic() + 5)
    time.sleep(0.1)  # (its reader runs it now; the spare watches the connection)
    sock.close()
    deadline = time.monotonic() + 5
    while lane._server._links and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not lane._server._links  # a reader met the end (woken by the spare, or the call's own, back)
    assert lane.call_sync(os.getpid(), _occupy, (0.0,), 10.0) == "machinlike-lane-serve"
