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
