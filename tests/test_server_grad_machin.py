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
from machinlike.server._spec import cast_loss, uncastable
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

        def jammed():
            # Full for good: the primary is in its gated step with a push queued behind
            # it and a forward parked; the secondary's thread holds the next push (taken
            # off its queue, not forwarded: it waits for the parked forward), and its
            # queue is full. Nothing moves until the gate opens. (Before the thread took
            # that push, the queue was full too, but room came as it took it.)
            stats = impl.stats()
            primary, secondary = stats["primary"], stats["secondary"]
            held = secondary["accepted"] - secondary["forwarded"] - secondary["queued"]
            return primary["queued"] == 1 and primary["parked"] >= 1 and secondary["queued"] == 1 and held == 1

        group.register("jammed", jammed)
    group.barrier()
    if world.name == "1":
        server = group.get_paired("server").to_here()
        model = Small()
        with torch.no_grad():
            model.lin.weight.fill_(7.0)  # the pull must overwrite this with the server's zeros
        _set_grads(model, 1)
        assert server.push(model) is True  # machin: push returns what pull returned
        assert model.pp_grad_version == 0 and model.lin.weight.abs().sum().item() == 0.0
        assert all(p.grad is None for p in model.parameters())
        # Jam it: the primary waits in its first step, so the fast path is soon refused...
        # (pushed until every stage is full, not a fixed count: under load a stage may
        # move an item between two pushes, and then the next push is accepted)
        _set_grads(model, 1)
        outcomes = []
        deadline = time.monotonic() + 30
        while not group.registered_sync("jammed"):
            assert time.monotonic() < deadline, f"never jammed: {outcomes}"
            outcomes.append(server.push(model, pull=False))
        assert server.push(model, pull=False) is False
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


@pytest.mark.parametrize("source, target, loss", [
    (torch.float64, torch.float32, None),
    (torch.float32, torch.bfloat16, None),
    (torch.float16, torch.float64, None),
    (torch.float32, torch.complex64, None),
    (torch.complex128, torch.complex64, None),
    (torch.complex64, torch.float32, "the imaginary part would be dropped"),
    (torch.float32, torch.int64, "the values would be truncated"),
    (torch.complex64, torch.bool, "the imaginary part would be dropped"),
    (torch.float16, torch.uint8, "the values would be truncated"),
    (torch.int32, torch.float32, None),
])
def test_cast_rules(source, target, loss):
    assert cast_loss(source, target) == loss


def test_uncastable_lists_every_lossy_entry():
    assert uncastable({"a": torch.float64, "b": torch.float16}, {"a": torch.float32, "b": torch.float32}) is None
    names = [f"p{i}" for i in range(8)]
    text = uncastable({n: torch.complex64 for n in names}, {n: torch.float32 for n in names[1:]})
    assert text.startswith("'p1': torch.complex64 to torch.float32, the imaginary part would be dropped; 'p2'")
    assert text.endswith("; and 1 more") and "'p0'" not in text  # absent names are mismatch()'s


@world_test(2, timeout=90)
def test_push_and_pull_cast_dtypes(world):
    """machin's A3C tests: float64 clients of a float32 server. Their gradients are cast
    to float32 and applied, through the remote path (member 1) and the local one (member
    0 hosts the secondary); pulls cast back to float64. A cast that would lose meaning
    (complex to real) is refused before anything is sent."""
    group = world.create_rpc_group("dtypes", ["0", "1"])
    if world.name == "0":
        impl = PushPullGradServerImpl("server", group, primary_reducer="0", secondary_reducers=["0"],
                                      reduce_batch_size=1)
        managed = Small()
        with torch.no_grad():
            managed.lin.weight.fill_(0.25)
        impl.manage_model(managed, torch.optim.SGD(managed.parameters(), lr=1.0))
        impl.start()
        group.register("managed_dtype", lambda: str(managed.lin.weight.dtype))
    group.barrier()
    server = group.get_paired("server").to_here()
    if world.name == "1":
        double = Small().double()
        assert server.pull(double)
        assert double.lin.weight.dtype == torch.float64 and double.lin.weight.tolist() == [[0.25] * 3] * 2
        _set_grads(double, 1)
        assert server.push(double, pull=False)
        server.flush(timeout=30)
        assert server.pull(double)
        assert double.lin.weight.dtype == torch.float64 and double.lin.weight.tolist() == [[-0.75] * 3] * 2
        assert double.lin.bias.tolist() == [-1.0, -1.0]
        assert group.registered_sync("managed_dtype") == "torch.float32"

        complex_model = Small().to(torch.complex64)
        for p in complex_model.parameters():
            p.grad = torch.full_like(p, 1 + 1j)
        with pytest.raises(ValueError, match=r"cannot push to gradient server 'server': gradients cannot be cast to "
                                             r"the managed model's dtypes \('lin.weight': torch.complex64 to "
                                             r"torch.float32, the imaginary part would be dropped"):
            server.push(complex_model)
        wide = nn.Module()
        wide.lin = nn.Linear(4, 2).double()
        with pytest.raises(ValueError, match=r"shapes differ"):
            server.pull(wide)  # names and shapes stay strict
        with pytest.raises(ValueError, match=r"shapes differ"):
            server.push(wide)
    group.barrier()
    if world.name == "0":
        # The local path (this process hosts the secondary): a float64 push, with the
        # gradients copied, so changing them afterwards changes nothing.
        double = Small().double()
        assert server.pull(double)
        for p in double.parameters():
            p.grad = torch.full_like(p, 0.5)
        assert server.push(double, pull=False)
        for p in double.parameters():
            p.grad.fill_(100.0)
        server.flush(timeout=30)
        assert server.pull(double)
        assert double.lin.weight.tolist() == [[-1.25] * 3] * 2
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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@world_test(2, timeout=90)
def test_push_and_pull_cast_devices(world):
    """A learner's model on cuda:0 (float32) takes a CPU float64 actor's gradients; a
    CPU server takes a CUDA float16 client's; each pull lands on the client's device and
    in its dtype."""
    group = world.create_rpc_group("devices", ["0", "1"])
    if world.name == "0":
        on_gpu = Small().cuda()
        gpu_impl = PushPullGradServerImpl("gpu", group, primary_reducer="0", secondary_reducers=["0"],
                                          reduce_batch_size=1)
        gpu_impl.manage_model(on_gpu, torch.optim.SGD(on_gpu.parameters(), lr=1.0))
        gpu_impl.start()
        on_cpu = Small()
        cpu_impl = PushPullGradServerImpl("cpu", group, primary_reducer="0", secondary_reducers=["0"],
                                          reduce_batch_size=1)
        cpu_impl.manage_model(on_cpu, torch.optim.SGD(on_cpu.parameters(), lr=1.0))
        cpu_impl.start()
    group.barrier()
    if world.name == "1":
        gpu_server = group.get_paired("gpu").to_here()
        actor = Small().double()
        _set_grads(actor, 2)
        assert gpu_server.push(actor, pull=False)
        gpu_server.flush(timeout=30)
        assert gpu_server.pull(actor)
        assert actor.lin.weight.device.type == "cpu" and actor.lin.weight.dtype == torch.float64
        assert actor.lin.weight.tolist() == [[-2.0] * 3] * 2

        cpu_server = group.get_paired("cpu").to_here()
        learner = Small().half().cuda()
        _set_grads(learner, 0.5)
        assert cpu_server.push(learner, pull=False)
        cpu_server.flush(timeout=30)
        assert cpu_server.pull(learner)
        assert learner.lin.weight.device.type == "cuda" and learner.lin.weight.dtype == torch.float16
        assert learner.lin.weight.tolist() == [[-0.5] * 3] * 2
    group.barrier()
    if world.name == "0":
        assert on_gpu.lin.weight.device.type == "cuda" and on_gpu.lin.weight.dtype == torch.float32
        assert on_gpu.lin.weight.tolist() == [[-2.0] * 3] * 2
        gpu_impl.close()
        cpu_impl.close()
