"""The gradient server under churn: clients and secondary reducers are SIGKILLed (by the
launcher's chaos) and restarted while they push; the final weights must be exactly the
acknowledged pushes less those the primary reports dropped with a dead reducer."""

from __future__ import annotations

import collections
import os

import pytest

from machinlike import launch

from churn_targets import churn_body, dead_before_flush_body, renewed_secondary_body, stopped_primary_body


def _read_log(path):
    status = {}
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                kind, slot = line.split()
                status[int(slot)] = kind  # the last word on a slot: P (in flight), A, R or E
    return status


# ~15 s on an idle machine; slow process starts under load stretch it, the launch's
# timeout bounds it.
@pytest.mark.timeout(75)
def test_exact_sums_while_clients_and_secondaries_die(tmp_path):
    names = ["p", "s1", "s2", "c1", "c2"]
    results = launch(churn_body, 5, args=(6.0, str(tmp_path)), names=names, max_restarts=4, essential=["p"],
                     chaos=1.5, chaos_seed=4, timeout=60)
    kills = [r.name for r in results.restarts]
    assert len(kills) >= 3, results.restarts
    w = results[0]["w"]
    stats = results[0]["stats"]["primary"]
    applied = (-w).round().long()
    assert bool(((-w) == applied.to(w.dtype)).all()), "weights must stay integers"
    assert int(applied.max()) <= 1, "a push was applied twice"
    assert int(applied.min()) >= 0
    dropped = stats["dropped_by_client"]
    for client in ("c1", "c2"):
        log = _read_log(os.path.join(tmp_path, f"{client}.log"))
        kinds = collections.Counter(log.values())
        assert kinds["A"] > 20, kinds
        acked_lost = sum(1 for s, k in log.items() if k == "A" and applied[s] == 0)
        unsure = [s for s, k in log.items() if k in ("P", "E")]
        unsure_lost = sum(1 for s in unsure if applied[s] == 0)
        # Refused pushes never count; acknowledged ones count unless reported dropped; a
        # push whose outcome the client did not learn counts once or not at all.
        assert all(applied[s] == 0 for s, k in log.items() if k == "R")
        assert acked_lost <= dropped.get(client, 0) <= acked_lost + unsure_lost, (client, dropped, acked_lost,
                                                                                  unsure_lost, kills)
    mine = {s for c in ("c1", "c2") for s in _read_log(os.path.join(tmp_path, f"{c}.log"))}
    assert set(applied.nonzero().flatten().tolist()) <= mine
    assert stats["dropped_dead_reducer"] == sum(dropped.values())
    seen = results[0]["stats"]["members"]
    assert seen["losses"] >= 1 and seen["rejoins"] >= 1, seen


@pytest.mark.timeout(60)
def test_pushes_of_a_secondary_dead_before_a_flush_are_reported_when_it_returns():
    # A call to a dead process on this host fails at once, before the world declares it
    # lost: the flush must not return (and the counts must not be read as final) until
    # the primary can count what died with it.
    results = launch(dead_before_flush_body, 3, names=["p", "s1", "c1"], max_restarts=1, essential=["p"],
                     timeout=45)
    assert results[2] == 3
    out = results[0]
    assert out["applied"] == 0
    assert out["stats"]["primary"]["dropped_by_client"] == {"c1": 3}, out["stats"]
    assert out["took"] < 2 * 2.0 + 1.5, out["took"]  # within the loss bound


@pytest.mark.timeout(60)
def test_a_secondary_that_renews_its_agent_keeps_forwarding():
    # A renewal (or a recycling) gives the secondary a new RPC worker name in the same
    # incarnation: what it accepted before and after still reaches the primary, and
    # nothing is reported dropped.
    results = launch(renewed_secondary_body, 3, names=["p", "s1", "c1"], max_restarts=1, essential=["p", "s1", "c1"],
                     timeout=50)
    out = results[0]
    assert results[1] is True and results[2] == 6
    assert out["applied"] == list(range(6)), str(out["stats"]["primary"])
    assert not out["stats"]["primary"]["dropped_by_client"], out["stats"]


@pytest.mark.timeout(60)
def test_a_secondary_whose_primary_stopped_counts_what_it_cannot_forward_and_goes_on():
    # The end of an elastic run: the primary's member closes the server while trainers
    # still push. Their secondary's thread failed (an ERROR with a traceback, the
    # trainers' pushes refused); now it counts the lost forwards, says so once, goes on.
    out = launch(stopped_primary_body, 2, names=["p", "s1"], max_restarts=1, essential=["p", "s1"], timeout=45)[1]
    assert out["failed"] is None and out["stats"]["state"] == "running", out
    assert "the primary reducer on member 'p' is stopped" in out["refused"], out  # (a flush is told)
    assert out["stats"]["forwarded"] == 12 and out["stats"]["lost_forwarding"] == 8, out  # (sent, then lost)
    assert len(out["warnings"]) == 1 and "is stopped" in out["warnings"][0], out


def test_source_tags_name_an_incarnation_and_old_tags_still_parse():
    from machinlike.server._churn import Source, parse_source

    assert parse_source("s1_7#2@3") == Source("s1", "s1_7", 2, 3)
    assert parse_source("s1_7@3") == Source("s1", "s1_7", None, 3)  # a checkpoint's tag from before
