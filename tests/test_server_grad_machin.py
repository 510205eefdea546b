"""The gradient server used the way machin's own code uses it, across real processes:
built by machin's helper recipe (start() on the primary only), machin's push contract
(push, then pull, gradients cleared), and pulls into a model of another dtype."""

from __future__ import annotations

import gc
import threading
import time
import weakref

import pytest
import torch
from torch import nn

from machinlike.server import PushPullGradServerImpl
from grad_targets import GatedSGD, Small
from machinlike.testing import world_test


def _set_grads(model, value):
    for p in model.parameters():
        p.grad = torch.full_like(p, float(value))


@world_test(3, timeout=90)
def test_built_the_machin_way_every_members_gradients_are_applied(world):
    """machin's grad_server_helper: the impl on every member (and dropped by the
    non-primaries), manage_model() and start() on the primary only."""
    group = world.create_rpc_group("machin_way", ["0", "1", "2"])
    impl = PushPullGradServerImpl("grad_server_0", group, primary_reducer="0", reduce_batch_size=2)
    if world.name == "0":
        model = Small()
        impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=1.0))
        impl.start()
        kept = impl
    else:
        assert impl.threads() == []  # nobody started this member's secondary
        kept = weakref.ref(impl)  # machin's helper keeps no reference to it
        del impl
        gc.collect()
    group.barrier()
    server = group.get_paired("grad_server_0").to_here()
    model = Small()
    value = int(world.name) + 1
    for _ in range(3):
        _set_grads(model, value)
        server.push(model)  # machin's A3C ignores what push returns
        assert all(p.grad is None for p in model.parameters()), "push clears the gradients"
    group.barrier()
    if world.name == "0":
        server.flush(timeout=30)
    group.barrier()
    fresh = Small()
    assert server.pull(fresh)
    # SGD(lr=1), sum: every push of every member is in the weights, exactly
    assert fresh.lin.weight.tolist() == [[-3.0 * (1 + 2 + 3)] * 3] * 2
    if world.name == "0":
        stats = kept.stats()
        assert stats["primary"]["applied"] == 9 and stats["secondary"]["rejected"] == 0
    else:
        impl = kept()
        assert impl is not None, "the group's services keep a member's share alive"
        assert impl.stats()["secondary"] == dict(impl.stats()["secondary"], accepted=3, rejected=0, forwarded=3)
        kept = impl
    group.barrier()
    kept.stop(timeout=10)
    group.barrier()
    kept.close()


@world_test(2, timeout=90)
def test_default_push_pulls_clears_and_waits_for_room(world):
    group = world.create_rpc_group("contract", ["0", "1"])
    if world.name == "0":
        gate = threading.Event()
        impl = PushPullGradServerImpl("server", group, primary_reducer="0", secondary_reducers=["0"],
                                      reduce_batch_size=1, max_queue_size=1)
        managed = Small()
        impl.manage_model(managed, GatedSGD(managed.parameters(), gate))
        impl.start()
        group.register("open_gate", gate.set)
    group.barrier()
    if world.name == "1":
        server = group.get_paired("server").to_here()
        model = Small()
        with torch.no_grad():
            model.lin.weight.fill_(7.0)  # the pull must overwrite this with the server's zeros
        _set_grads(model, 1)
        assert server.push(model) is True  # machin: push returns what pull returned
        assert model.pp_version == 0 and model.lin.weight.abs().sum().item() == 0.0
        assert all(p.grad is None for p in model.parameters())
        # Jam it: the primary waits in its first step, so the fast path is soon refused...
        _set_grads(model, 1)
        outcomes = [server.push(model, pull=False) for _ in range(20)]
        assert outcomes[-1] is False
        accepted = 1 + outcomes.count(True)
        # ...while the default push waits for room instead of dropping the gradients.
        result = []
        pusher = threading.Thread(target=lambda: result.append(server.push(model)))
        pusher.start()
        pusher.join(0.5)
        assert pusher.is_alive() and not result, "a default push into a full queue waits"
        group.registered_sync("open_gate")
        pusher.join(30)
        assert not pusher.is_alive() and isinstance(result[0], bool)
        server.flush(timeout=30)
        fresh = Small()
        assert server.pull(fresh)
        assert fresh.lin.weight.tolist() == [[-float(accepted + 1)] * 3] * 2  # the waiting push is in
    group.barrier()
    if world.name == "0":
        impl.close()


@world_test(2, timeout=90)
def test_pull_converts_dtype_and_push_stays_strict(world):
    group = world.create_rpc_group("dtypes", ["0", "1"])
    if world.name == "0":
        impl = PushPullGradServerImpl("server", group, primary_reducer="0", secondary_reducers=["0"],
                                      reduce_batch_size=1)
        managed = Small()
        with torch.no_grad():
            managed.lin.weight.fill_(0.25)
        impl.manage_model(managed, torch.optim.SGD(managed.parameters(), lr=1.0))
        impl.start()
    group.barrier()
    if world.name == "1":
        server = group.get_paired("server").to_here()
        double = Small().double()  # machin's A3C tests: float64 clients, float32 server
        assert server.pull(double)
        assert double.lin.weight.dtype == torch.float64 and double.lin.weight.tolist() == [[0.25] * 3] * 2
        _set_grads(double, 1)
        with pytest.raises(ValueError, match=r"dtypes differ \('lin.weight': torch.float64 instead of torch.float32"):
            server.push(double)  # push stays strict: the client model does not match the server's
        wide = nn.Module()
        wide.lin = nn.Linear(4, 2).double()
        with pytest.raises(ValueError, match=r"shapes differ"):
            server.pull(wide)  # names and shapes stay strict on pull
    group.barrier()
    if world.name == "0":
        impl.close()


@world_test(3, timeout=90)
def test_flush_does_not_wait_for_a_reducer_nobody_started(world):
    """Built the machin way, member '2' never pushes, so its secondary never starts: a flush
    on the primary returns at once instead of waiting its whole timeout on it."""
    group = world.create_rpc_group("unstarted", ["0", "1", "2"])
    impl = PushPullGradServerImpl("grad_server_0", group, primary_reducer="0", reduce_batch_size=2)
    if world.name == "0":
        model = Small()
        impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=1.0))
        impl.start()
    group.barrier()
    server = group.get_paired("grad_server_0").to_here()
    if world.name == "1":
        model = Small()
        for _ in range(2):
            _set_grads(model, 1)
            server.push(model)  # starts member '1''s secondary
    group.barrier()
    if world.name == "0":
        start = time.monotonic()
        version = server.flush(timeout=60)
        took = time.monotonic() - start
        assert took < 10, f"flush waited {took:.1f} s on the secondary nobody started"
        assert version == 1
        fresh = Small()
        assert server.pull(fresh) and fresh.lin.weight.tolist() == [[-2.0] * 3] * 2
    group.barrier()
    if world.name == "2":
        assert impl.threads() == [] and impl.stats()["secondary"]["state"] == "new"
    impl.stop(timeout=10)
    group.barrier()
    impl.close()
