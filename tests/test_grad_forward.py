"""A secondary reducer's forwards to a primary that stopped: every push it took and the
primary never applied is counted in ``lost_forwarding``, in a static world too.

(The transport is not the point here: the primary is a local ``accept`` whose futures
fail as a stopped primary's do; tests/test_server_churn.py runs the elastic case across
processes.)
"""

from __future__ import annotations

import pytest
import torch

from machinlike.server import ServerStoppedError
from machinlike.server._grad.forward import Forwarder
from machinlike.server._grad.items import Item, completed


def _item(count: int) -> Item:
    return Item({"w": torch.ones(2)}, count, [0] * count)


@pytest.mark.parametrize("elastic", [False, True])
def test_pushes_sent_to_a_stopped_primary_and_those_behind_them_are_counted_lost(elastic):
    stopped = ServerStoppedError("gradient server 'g': the primary reducer on member 'p' is stopped")
    answers = [completed(True), completed(error=stopped), completed(error=stopped)]
    forwarder = Forwarder(None, "g", "s1", "p", lambda item: answers.pop(0), 5.0, elastic)  # type: ignore[arg-type]
    forwarder.send(_item(2))  # lands
    forwarder.send(_item(2))  # sent; its answer (the stop) is read at the next send
    if elastic:  # counted, said, and the reducer goes on
        forwarder.send(_item(3))
        forwarder.drain()
        assert (forwarder.forwarded, forwarder.lost) == (7, 5)
    else:  # the reducer fails with the stop; the sum that found it is never sent
        with pytest.raises(ServerStoppedError, match="is stopped"):
            forwarder.send(_item(3))
        # (trial 8: 4 pushes taken, 2 "forwarded", 0 lost: 2 appeared nowhere)
        assert (forwarder.forwarded, forwarder.lost) == (4, 5)


def test_a_secondary_stopped_after_its_primary_stopped_says_why_its_queue_was_not_applied(caplog):
    # (the end of param_server --chaos: the stop's warning advised a flush, which the
    # stopped primary could not have honoured)
    from machinlike.server._grad.reducer import SecondaryReducer

    stopped = ServerStoppedError("gradient server 'g': the primary reducer on member 'p' is stopped")
    fail = lambda item: completed(error=stopped)  # noqa: E731  (a stopped primary's answer)
    forwarder = Forwarder(None, "g", "s1", "p", fail, 5.0, True)  # type: ignore[arg-type]
    reducer = SecondaryReducer("g", "s1", 2, 10, torch.device("cpu"), forward=forwarder)
    for _ in range(2):
        assert reducer.accept({"w": torch.ones(2)}, 0, "c")
    reducer.flush().wait()  # its forward was lost: the primary is stopped
    assert reducer.accept({"w": torch.ones(2)}, 0, "c")  # one queued, short of a batch
    with caplog.at_level("WARNING", logger="machinlike.server._grad.reducer"):
        reducer.stop(5.0)
    said = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
    assert len(said) == 1 and "could not take them" in said[0] and "is stopped" in said[0], said
    assert "flush()" not in said[0], said


def test_a_secondary_stopped_while_its_primary_serves_advises_a_flush(caplog):
    from machinlike.server._grad.reducer import SecondaryReducer

    forwarder = Forwarder(None, "g", "s1", "p", lambda item: completed(True), 5.0, True)  # type: ignore[arg-type]
    reducer = SecondaryReducer("g", "s1", 2, 10, torch.device("cpu"), forward=forwarder)
    assert reducer.accept({"w": torch.ones(2)}, 0, "c")
    with caplog.at_level("WARNING", logger="machinlike.server._grad.reducer"):
        reducer.stop(5.0)
    said = [r.getMessage() for r in caplog.records if "not applied" in r.getMessage()]
    assert len(said) == 1 and "flush() before stop()" in said[0] and "member 'p' still serves" in said[0], said
