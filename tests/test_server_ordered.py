"""OrderedServerSimple across real processes: machin's sequence, copies, errors, a CAS race."""

from __future__ import annotations

import threading

import pytest
import torch

from machinlike.server import OrderedServerBase, OrderedServerSimple, OrderedServerSimpleImpl
from machinlike.testing import run_world, world_test


@world_test(2, timeout=60)
def test_machin_push_pull_sequence(world):
    group = world.create_rpc_group("group", ["0", "1"])
    if world.name == "0":
        impl = OrderedServerSimpleImpl("server", group)  # version_depth=1
        adopting = OrderedServerSimpleImpl("adopting", group, adopt=lambda key, value: {"w": value["w"]},
                                           server_runner="0")  # (machin's keyword, naming this member)
        with pytest.raises(ValueError, match=r"server_runner='1', but this is member '0'.*construct it on '1'"):
            OrderedServerSimpleImpl("elsewhere", group, server_runner="1")
    group.barrier()
    if world.name == "1":
        server = group.get_paired("server").to_here()
        assert isinstance(server, OrderedServerSimple) and isinstance(server, OrderedServerBase)
        assert server.push("a", "value", 1, None)
        assert not server.push("a", "value1", 2, 0)  # stale prev_version
        assert server.push("a", "value2", 2, 1)
        assert server.push("a", "value3", -1, 2)  # versions need not increase
        assert server.pull("a") == ("value3", -1)
        assert server.pull("a", None) == ("value3", -1)
        assert server.pull("a", 2) == ("value2", 2)
        assert server.pull("a", 1) is None  # evicted: newest + 1 older are kept
        assert server.pull("b") is None
        assert server.pull_if_changed("a", -1) is None
        assert server.pull_if_changed("a", 2) == ("value3", -1)
        assert server.pull_if_changed("b", None) is None
        # a new key takes any version, whatever prev_version says
        assert server.push(("tuple", "key"), 10, 7, 123)
        assert server.pull(("tuple", "key")) == (10, 7)
        with pytest.raises(TypeError, match="key must be hashable"):
            server.push(["list"], 1, 1, None)
        # Cold trial 29: keys no pull could reach (each push's copy was a new key on the host).
        with pytest.raises(TypeError, match=r"holds a tensor, which hashes by identity.*tensor.item\(\)"):
            server.push(torch.tensor(1), 1, 1, None)
        with pytest.raises(TypeError, match="holds a tensor"):
            server.pull(("step", torch.tensor(1)))
        with pytest.raises(ValueError, match="key=nan holds nan, which equals nothing"):
            server.push(float("nan"), 1, 1, None)
        # The host's own KeyError (its adopt hook) is its own, not "the host is gone".
        adopting = group.get_paired("adopting").to_here()
        with pytest.raises(KeyError, match="'w'") as failed:
            adopting.push("k", {"x": 1}, 1, None)
        assert "on member '0'" in str(failed.value.__cause__)
        assert adopting.push("k", {"w": 2}, 1, None) and adopting.pull("k") == ({"w": 2}, 1)
        # Cold trial 20: a key pushed at version NaN could never be pushed on again.
        with pytest.raises(ValueError, match=r"version=nan equals nothing, itself included"):
            server.push("n", 1, float("nan"), None)
        assert server.pull("n") is None
        # An accessor built for a server nobody hosts says what makes one (machin: a bare KeyError).
        with pytest.raises(KeyError, match=r"Service \[nobody/_pull\] not found on Group \[group\]: no member "
                                           r"hosts ordered server 'nobody'; create OrderedServerSimpleImpl\('nobody', "
                                           r"group\) on the member that is to host it"):
            OrderedServerSimple("nobody", group).pull("a")
    if world.name == "0":
        # (it said "Service [server/_push] already registered": a name of its insides)
        with pytest.raises(KeyError, match=r"ordered server 'server' already exists in group 'group' .*close it "
                                           r"first, or pick another server_name"):
            OrderedServerSimpleImpl("server", group)
        with pytest.raises(ValueError, match=r"server_name='m/ordered' holds a '/'"):
            OrderedServerSimpleImpl("m/ordered", group)
    group.barrier()
    if world.name == "0":
        stats = impl.stats()
        assert 0 <= stats.pop("since_version") < 60
        assert stats == {"keys": 2, "pushes_accepted": 4, "pushes_rejected": 1, "pulls": 10, "pulls_unchanged": 1,
                         "clients": ["1"]}
        impl.close()
        impl.close()  # idempotent
        adopting.close()
        assert not group.is_paired("server") and not group.is_registered("server/_push")
    group.barrier()
    group.destroy()


@world_test(2, timeout=60)
def test_depth_copies_and_local_use(world):
    group = world.create_rpc_group("g", ["0", "1"])
    if world.name == "0":
        with pytest.raises(ValueError, match="version_depth=-1 must be an int of at least 0"):
            OrderedServerSimpleImpl("bad", group, version_depth=-1)
        with pytest.raises(TypeError, match="group must be an RpcGroup"):
            OrderedServerSimpleImpl("bad", "g")
        with pytest.raises(ValueError, match="server_name=.. is empty"):
            OrderedServerSimpleImpl("", group)
        OrderedServerSimpleImpl("deep", group, version_depth=3)
        OrderedServerSimpleImpl("shallow", group, version_depth=0)
        with pytest.raises(KeyError, match="already"):
            OrderedServerSimpleImpl("deep", group)
    group.barrier()
    # Both members use the servers, the host included (its calls still go through RPC).
    deep = OrderedServerSimple("deep", group)
    shallow = OrderedServerSimple("shallow", group)
    key = f"k{world.name}"
    for v in range(1, 6):
        assert deep.push(key, torch.full((3,), float(v)), v, v - 1 if v > 1 else None)
        assert shallow.push(key, v, v, v - 1 if v > 1 else None)
    assert [deep.pull(key, v) is None for v in range(1, 6)] == [True, False, False, False, False]
    assert shallow.pull(key, 4) is None and shallow.pull(key) == (5, 5)
    value, version = deep.pull(key)
    assert version == 5 and value.tolist() == [5.0] * 3
    value.add_(100)  # a pulled value is a copy: the server keeps its own
    assert deep.pull(key)[0].tolist() == [5.0] * 3
    mine = torch.zeros(2)
    assert deep.push(key, mine, 6, 5)
    mine.add_(1)  # and so is a pushed one
    assert deep.pull(key, 6)[0].tolist() == [0.0, 0.0]
    with pytest.raises(KeyError, match=r"Service \[nowhere/_pull\] not found"):
        OrderedServerSimple("nowhere", group).pull("x")
    with pytest.raises(ValueError, match="timeout=0 must be a positive number"):
        OrderedServerSimple("deep", group, timeout=0)
    group.barrier()
    group.destroy()


ROUNDS = 12
THREADS = 4


def _race_body(world):
    """Every round, all threads of all members push version r+1 on prev r at once."""
    members = world.get_members()
    group = world.create_rpc_group("race", members)
    if world.name == "0":
        OrderedServerSimpleImpl("server", group, version_depth=ROUNDS)
    group.barrier()
    server = OrderedServerSimple("server", group)
    start = threading.Barrier(THREADS)
    wins = [[0] * ROUNDS for _ in range(THREADS)]
    errors = []

    def pusher(t):
        try:
            for r in range(ROUNDS):
                start.wait(timeout=30)
                if t == 0:
                    group.barrier(timeout=30)  # every member's threads enter the round together
                start.wait(timeout=30)
                value = (world.name, t, r)
                if server.push("chain", value, r + 1, r if r else None):
                    wins[t][r] += 1
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)
            start.abort()

    threads = [threading.Thread(target=pusher, args=(t,), name=f"pusher-{t}") for t in range(THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    group.barrier()
    history = [server.pull("chain", v) for v in range(1, ROUNDS + 1)]
    group.barrier()
    group.destroy()
    return [sum(w[r] for w in wins) for r in range(ROUNDS)], history


def test_concurrent_pushers_exactly_one_wins_per_version():
    results = run_world(_race_body, 3, timeout=90)
    per_round = [sum(r[0][i] for r in results) for i in range(ROUNDS)]
    assert per_round == [1] * ROUNDS, per_round  # 12 contenders per round, one winner
    history = results[0][1]
    assert all(h is not None for h in history)
    assert [h[1] for h in history] == list(range(1, ROUNDS + 1))  # a linear chain
    assert [h[0][2] for h in history] == list(range(ROUNDS))  # each version written in its own round
    # each round's winner is exactly the one member/thread that counted the win
    for r, (value, _) in enumerate(history):
        member, _thread, _ = value
        assert results[int(member)][0][r] == 1
