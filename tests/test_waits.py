"""Waits.wait_call: how a call pending on another host's member ends when it cannot be
answered; the end-to-end cases are tests/test_multihost.py (a lost member, a member
declared lost while it lives)."""

import threading
import time

import pytest
import torch
import torch.distributed as dist

from machinlike.distributed._membership.roster import Roster
from machinlike.distributed._membership.waits import Waits
from machinlike.distributed._store import MemberRecord, Registry
from machinlike.distributed._transport.pipes import PipeLedger
from machinlike.exception import PeerLostError

# (a process of another host: no /proc look-up ends its calls)
ELSEWHERE = "elsewhere@0:0:0/1"


@pytest.mark.parametrize("end, said", [
    ("leave", r"member 'host' is unreachable: service 's' on member 'host': it left the world while the call"),
    ("lost", r"member 'host' is unreachable: service 's' on member 'host': it was lost while the call"),
    ("cut off", r"member 'me' is unreachable: service 's' on member 'host' ended unanswered: this member was "
                r"cut off from the world \(the world's store is unreachable \(reset\)\)"),
])
def test_a_pending_call_ends_at_once_saying_why_its_answer_cannot_come(end, said):
    roster = Roster(PipeLedger(0))
    rec = MemberRecord("host", 1, "host_0", 0, ELSEWHERE)
    roster.apply("join", rec)
    waits = Waits(Registry(dist.HashStore(), "me"), roster)
    roster.when_cut_off(waits.on_cut_off)
    fut: torch.futures.Future = torch.futures.Future()  # an answer that never comes
    outcome = {}

    def call() -> None:
        try:
            waits.wait_call(fut, "host_0", "service 's' on member 'host'")
        except PeerLostError as err:
            outcome["error"] = err

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    deadline = time.monotonic() + 10
    while not waits._pending and time.monotonic() < deadline:  # (noted: the call is pending)
        time.sleep(0.001)
    start = time.monotonic()
    if end == "cut off":
        roster.mark_cut_off(PeerLostError("me", "the world's store is unreachable (reset)"))
    else:
        waits.on_gone(rec, roster.apply(end, rec) or [])  # (as Membership delivers a departure)
    caller.join(10)
    assert not caller.is_alive() and time.monotonic() - start < 1.0
    with pytest.raises(PeerLostError, match=said):
        raise outcome["error"]
    assert not waits._pending  # nothing kept for the ended call


def test_a_call_made_after_the_cut_off_ends_at_once():
    roster = Roster(PipeLedger(0))
    roster.apply("join", MemberRecord("host", 1, "host_0", 0, ELSEWHERE))
    waits = Waits(Registry(dist.HashStore(), "me"), roster)
    roster.when_cut_off(waits.on_cut_off)
    roster.mark_cut_off(PeerLostError("me", "this member was declared lost by the others"))
    with pytest.raises(PeerLostError, match="ended unanswered: this member was cut off"):
        waits.wait_call(torch.futures.Future(), "host_0", "service 's' on member 'host'")


@pytest.fixture(scope="module")
def callback_helper():
    """The process's callback helper thread, started before the leak check's snapshot (it
    stays for the process's life, by design: see _calls.future._Helpers)."""
    from machinlike.distributed._calls import future

    ran = threading.Event()
    with future._helpers_lock:
        if future._helpers is None:
            future._helpers = future._Helpers()
        helpers = future._helpers
    helpers.submit(lambda _: ran.set(), None)
    assert ran.wait(10)


def test_an_async_call_pending_on_a_member_that_goes_fails_at_once_and_its_late_answer_is_dropped(callback_helper):
    from machinlike.distributed._calls import RpcFuture, carry

    roster = Roster(PipeLedger(0))
    rec = MemberRecord("host", 1, "host_0", 0, ELSEWHERE)
    roster.apply("join", rec)
    waits = Waits(Registry(dist.HashStore(), "me"), roster)
    answered: torch.futures.Future = torch.futures.Future()
    done = carry(RpcFuture(None, "host", "rpc_async of f", 30), answered, "host_0", roster, waits)
    early: torch.futures.Future = torch.futures.Future()
    kept = carry(RpcFuture(None, "host", "rpc_async of g", 30), early, "host_0", roster, waits)
    answered.set_result(7)
    assert done.wait() == 7 and len(waits._pending["host_0"]) == 1  # (an answered call is not kept)
    seen = []
    kept.add_done_callback(lambda fut: seen.append(threading.current_thread().name))
    waits.on_gone(rec, roster.apply("lost", rec) or [])
    with pytest.raises(PeerLostError, match=r"member 'host' is unreachable: rpc_async of g: it was lost while"):
        kept.wait()
    early.set_result(8)  # the answer that came too late: dropped, not an error in torch's callback
    with pytest.raises(PeerLostError):
        kept.wait()
    assert not waits._pending
    # A call sent after its member went fails at once too, the callback on a helper thread.
    late = carry(RpcFuture(None, "host", "rpc_async of h", 30), torch.futures.Future(), "host_0", roster, waits)
    with pytest.raises(PeerLostError, match="rpc_async of h: it was lost"):
        late.wait()
    deadline = time.monotonic() + 10
    while not seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert seen and seen[0].startswith("machinlike-callback"), seen  # (not the liveness thread)


def test_a_then_future_settles_its_value_in_the_thread_that_reads_it(monkeypatch, callback_helper):
    """``InferenceServer.infer_async`` hands the caller ``then``'s future: its value was
    settled only in the thread that completed the call, so a caller reading it under a
    stream of its own was not ordered after the copies that brought it."""
    from machinlike.distributed._calls import RpcFuture, future as _future

    settled = []
    monkeypatch.setattr(_future, "settle", lambda value=None: settled.append((threading.current_thread().name, value)))
    source: torch.futures.Future = torch.futures.Future()
    derived = RpcFuture(source, "server", "infer_async", 30).then(lambda fut: fut.wait() + 1)
    completer = threading.Thread(target=source.set_result, args=(1,), name="completer")
    completer.start()
    completer.join(10)
    assert derived.wait() == 2 and derived.value() == 2
    assert settled.count((threading.current_thread().name, 2)) == 2, settled
