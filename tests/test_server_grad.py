"""PushPullGradServer across real processes: machin's numbers, exact sums under concurrent
load with every reducer running, a killed secondary, bad input, overflow, thread errors,
and the helper."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

from machinlike import _shm
from machinlike.exception import PeerLostError
from machinlike.server import PushPullGradServer, PushPullGradServerImpl, ServerStoppedError, grad_server_helper
from grad_targets import GatedSGD, Small
from machinlike.testing import run_world, world_test


class Chain(nn.Module):
    """machin's test model: three bias-free 1x1 layers with weights 1, 2, 3.

    At x = 1 the output is w1*w2*w3, so the gradients are (6, 3, 2).
    """

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(1, 1, bias=False)
        self.fc2 = nn.Linear(1, 1, bias=False)
        self.fc3 = nn.Linear(1, 1, bias=False)
        with torch.no_grad():
            self.fc1.weight.fill_(1)
            self.fc2.weight.fill_(2)
            self.fc3.weight.fill_(3)

    def forward(self, x):
        return self.fc3(self.fc2(self.fc1(x)))

    def weights(self):
        return (self.fc1.weight.item(), self.fc2.weight.item(), self.fc3.weight.item())


def _our_threads():
    return [t.name for t in threading.enumerate() if t.name.startswith("machinlike-grad")]


EXPECTED = {"mean": (-5.0, -1.0, 1.0), "sum": (-23.0, -10.0, -5.0)}


@world_test(3, timeout=90)
def test_machin_numbers(world):
    """Two servers side by side, one per reduce_method, fed the same pushes."""
    group = world.create_rpc_group("group", ["0", "1", "2"])
    if world.name == "0":
        managed = {}
        for method in EXPECTED:
            # one secondary reducer (on the primary's process), so the batches are known:
            # 4 pushes -> 2 partial sums -> 1 optimizer step
            impl = PushPullGradServerImpl(method, group, primary_reducer="0", secondary_reducers=["0"],
                                          reduce_method=method, reduce_batch_size=2)
            model = Chain()
            optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # p -= p.grad
            scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0)
            impl.manage_model(model, optimizer, scheduler)
            impl.start()
            managed[method] = (impl, model, list(model.parameters()), scheduler)
        assert sorted(managed["sum"][0].threads()) == ["machinlike-grad-sum-primary", "machinlike-grad-sum-secondary"]
    group.barrier()
    servers = {method: group.get_paired(method).to_here() for method in EXPECTED}
    assert all(isinstance(s, PushPullGradServer) for s in servers.values())
    if world.name != "0":
        model = Chain()
        for _ in range(2):
            model.zero_grad()
            model(torch.ones(1, 1)).sum().backward()
            assert servers["mean"].push(model, pull=False) and servers["sum"].push(model, pull=False)
    group.barrier()
    if world.name == "1":
        assert servers["mean"].flush(timeout=30) == 1 and servers["sum"].flush(timeout=30) == 1
    group.barrier()
    if world.name != "0":
        for method, expected in EXPECTED.items():
            fresh = Chain()
            assert servers[method].pull(fresh) and fresh.pp_grad_version == 1
            assert fresh.weights() == expected
            assert not servers[method].pull(fresh)  # up to date: nothing transferred
    group.barrier()
    if world.name == "0":
        for method, (impl, model, params, scheduler) in managed.items():
            stats = impl.stats()
            assert stats["primary"]["steps"] == 1 and stats["primary"]["applied"] == 4
            assert stats["secondary"]["batches"] == 2 and stats["secondary"]["accepted"] == 4
            # up to date: the same-host version word answered without a call (else 2 calls sent nothing)
            assert stats["primary"]["ordered"]["pulls_unchanged"] == (0 if _shm.recycled.supported() else 2)
            assert scheduler.last_epoch == 1  # the lr scheduler is stepped with the optimizer
            assert model.weights() == EXPECTED[method]
            # the managed model is the caller's object, parameters and device unchanged
            assert list(model.parameters()) == params and all(p.device.type == "cpu" for p in params)
            impl.stop()
            impl.stop()
            assert impl.threads() == []
        assert _our_threads() == []
    group.barrier()
    group.destroy()


class Lookup(nn.Module):
    """An embedding with sparse gradients: the rows a batch looked up, each once per lookup."""

    def __init__(self):
        super().__init__()
        self.table = nn.Embedding(8, 2, sparse=True)
        with torch.no_grad():
            self.table.weight.copy_(torch.arange(16.0).reshape(8, 2))

    def forward(self, rows):
        return self.table(rows).sum()


SPARSE_PUSHES = {"1": [1, 1, 2], "2": [2, 5]}  # rows each client looks up
SPARSE_OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=1.0),  # steps on the sparse sum as it is
    "sparse_adam": lambda params: torch.optim.SparseAdam(params, lr=0.5),  # raises on a dense one
    "adam": lambda params: torch.optim.Adam(params, lr=0.5),  # raises on a sparse one: made dense
}


def _expected_after_one_step(name):
    model = Lookup()
    for rows in SPARSE_PUSHES.values():
        model(torch.tensor(rows)).backward()  # accumulates, sparse: the sum the server makes
    if name == "adam":
        model.table.weight.grad = model.table.weight.grad.to_dense()
    SPARSE_OPTIMIZERS[name](model.parameters()).step()
    return model.table.weight.detach()


@world_test(3, timeout=90)
def test_sparse_gradients_are_summed_sparse_and_stepped_by_any_optimizer(world):
    """Embedding gradients (``sparse=True``) from two clients: sent and summed sparse, then
    stepped as they are by an optimizer that takes them (SparseAdam would raise on a dense
    one) and made dense for one that does not (Adam would raise on a sparse one)."""
    group = world.create_rpc_group("group", ["0", "1", "2"])
    if world.name == "0":
        impls = []
        for name, make in SPARSE_OPTIMIZERS.items():
            # one secondary on the primary's process, batches of two: both pushes in one sum
            impl = PushPullGradServerImpl(name, group, primary_reducer="0", secondary_reducers=["0"],
                                          reduce_batch_size=2)
            model = Lookup()
            impl.manage_model(model, make(model.parameters()))
            impl.start()
            impls.append(impl)
    group.barrier()
    servers = {name: group.get_paired(name).to_here() for name in SPARSE_OPTIMIZERS}
    if world.name != "0":
        model = Lookup()
        model(torch.tensor(SPARSE_PUSHES[world.name])).backward()
        assert model.table.weight.grad.layout == torch.sparse_coo
        for server in servers.values():
            assert server.push(model, pull=False)
    group.barrier()
    if world.name == "1":
        for name, server in servers.items():
            assert server.flush(timeout=30) == 1
            fresh = Lookup()
            assert server.pull(fresh) and fresh.pp_grad_version == 1
            assert torch.allclose(fresh.table.weight, _expected_after_one_step(name)), name
    group.barrier()
    if world.name == "2":  # none_as_zero: a zero gradient SparseAdam can step on (a dense one stopped it)
        model = Lookup()
        assert servers["sparse_adam"].push(model, none_as_zero=True, pull=False)
        assert servers["sparse_adam"].flush(timeout=30) == 2  # (the version it made)
        assert servers["sparse_adam"].pull(model) and model.pp_grad_version == 2
    group.barrier()
    if world.name == "0":
        for impl in impls:
            assert impl.stats()["primary"]["applied"] == (3 if impl is impls[1] else 2)
            impl.stop()
    group.barrier()
    group.destroy()


def test_reduce_items_sums_sparse_and_dense_gradients_in_any_order():
    from machinlike.server._grad.items import Item, reduce_items

    def sparse(rows):
        return torch.sparse_coo_tensor(torch.tensor([rows]), torch.ones(len(rows), 2), (4, 2), check_invariants=True)

    dense = torch.full((4, 2), 0.5)
    expected = dense + sparse([0, 0, 3]).to_dense() + sparse([3]).to_dense()
    for order in ([sparse([0, 0, 3]), sparse([3]), dense], [dense, sparse([0, 0, 3]), sparse([3])],
                  [sparse([0, 0, 3]), dense.clone(), sparse([3])]):
        got = reduce_items([Item({"w": grad.clone()}, 1, [0]) for grad in order], torch.device("cpu")).grads["w"]
        assert got.layout == torch.strided and torch.equal(got, expected)
    only_sparse = reduce_items([Item({"w": sparse([0, 0, 3])}, 1, [0]), Item({"w": sparse([3, 1])}, 1, [0])],
                               torch.device("cpu")).grads["w"]
    assert only_sparse.layout == torch.sparse_coo and only_sparse.is_coalesced() and only_sparse._nnz() == 3
    assert torch.equal(only_sparse.to_dense(), sparse([0, 0, 3, 3, 1]).to_dense())


CLIENT_THREADS = 2
ROUNDS = 15


def _exact_body(world):
    """Four clients x two threads push integer gradients; two secondaries reduce in batches
    of 3, the primary (not a secondary) sums and steps SGD(lr=1). Every accepted gradient
    must be applied exactly once."""
    group = world.create_rpc_group("load", world.get_members())
    impl = None
    if world.name in ("0", "1", "2"):
        impl = PushPullGradServerImpl("server", group, primary_reducer="0", secondary_reducers=["1", "2"],
                                      reduce_method="sum", reduce_batch_size=3, max_queue_size=8)
        if world.name == "0":
            model = Small()
            impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=1.0))
        impl.start()
    group.barrier()
    server = group.get_paired("server").to_here()
    me = int(world.name)
    accepted = [0] * CLIENT_THREADS  # sum of the accepted gradient values, per thread
    counts = [[0, 0] for _ in range(CLIENT_THREADS)]  # accepted, rejected
    errors = []

    def client(t):
        try:
            model = Small()
            for r in range(ROUNDS):
                server.pull(model)
                value = (me + 1) * (r + 1) + t
                for p in model.parameters():
                    p.grad = torch.full_like(p, float(value))
                if server.push(model, pull=False):
                    accepted[t] += value
                    counts[t][0] += 1
                else:
                    counts[t][1] += 1
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(t,), name=f"client-{t}") for t in range(CLIENT_THREADS)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    group.barrier()
    if world.name == "3":
        server.flush(timeout=30)
    group.barrier()
    final = Small()
    server.pull(final)
    group.barrier()
    stats = impl.stats() if impl is not None else {}
    if impl is not None:
        impl.stop()
        assert _our_threads() == []
    group.barrier()
    group.destroy()
    return {"sum": sum(accepted), "accepted": sum(c[0] for c in counts), "rejected": sum(c[1] for c in counts),
            "weight": final.lin.weight.tolist(), "bias": final.lin.bias.tolist(), "stats": stats,
            "version": final.pp_grad_version}


def test_exact_sums_under_concurrent_load_and_every_reducer_runs():
    results = run_world(_exact_body, 4, timeout=120)
    total = sum(r["sum"] for r in results)
    accepted = sum(r["accepted"] for r in results)
    rejected = sum(r["rejected"] for r in results)
    assert accepted + rejected == 4 * CLIENT_THREADS * ROUNDS
    # SGD(lr=1) from zero: every weight is minus the sum of every accepted gradient, exactly
    for r in results:
        assert r["weight"] == [[-float(total)] * 3] * 2 and r["bias"] == [-float(total)] * 2, (r, total)
    primary = results[0]["stats"]["primary"]
    secondaries = [results[i]["stats"]["secondary"] for i in (1, 2)]
    assert primary["applied"] == accepted and primary["dropped"] == 0
    assert primary["steps"] >= 2 and results[0]["version"] == primary["steps"] == primary["version"]
    assert sum(s["accepted"] for s in secondaries) == accepted
    assert sum(s["rejected"] for s in secondaries) == rejected  # overflow is counted, not hidden
    assert all(s["batches"] >= 2 and s["forwarded"] == s["accepted"] for s in secondaries)  # both ran
    assert primary["lag_max"] >= 0 and "secondary" not in results[0]["stats"]


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def _wait_in_stop(world, victim):
    """Until ``victim`` entered World.stop: it reported its result to the launcher before
    that (a call that killed it sooner left it unreported: the lane runs a call at once)."""
    members = world.membership
    members.registry.wait_all(members.keys.stop_prefix(), [victim], 20, f"member {victim} entering World.stop")


def _killed_secondary_body(world):
    group = world.create_rpc_group("g", ["0", "1", "2", "3"])
    survivors = world.create_rpc_group("s", ["0", "1", "3"]) if world.name != "2" else None
    impl = None
    if world.name != "3":
        impl = PushPullGradServerImpl("server", group, primary_reducer="0", secondary_reducers=["1", "2"],
                                      reduce_batch_size=1)
        if world.name == "0":
            model = Small()
            impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=1.0))
        impl.start()
    if world.name == "2":
        group.register("die", _die)
    group.barrier()
    if world.name == "2":
        return "victim"  # waits in World.stop until the client has it killed
    if world.name == "3":
        server = group.get_paired("server").to_here()
        model = Small()
        server.pull(model)
        _wait_in_stop(world, "2")
        with pytest.raises(PeerLostError):
            group.registered_sync("die", timeout=10)
        before = server.flush(timeout=20)
        # the accessor learnt from the flush that '2' is gone; a fresh one has to find out
        fresh = group.get_paired("server").to_here()
        for p in model.parameters():
            p.grad = torch.full_like(p, 2.0)
        outcomes = []
        for _ in range(3):
            start = time.monotonic()
            try:
                outcomes.append(fresh.push(model, pull=False))
            except PeerLostError as err:
                assert err.member == "2" and time.monotonic() - start < 8
                outcomes.append("lost")
        # '2' fails one push, named; or, when the world freed its services before the push
        # (a busy machine: the flush above took longer than the loss bound), it is skipped
        # without an error, for nothing was queued there.
        lost = outcomes.count("lost")
        assert lost <= 1 and outcomes.count(True) == 3 - lost, outcomes
        after = fresh.flush(timeout=20)  # the primary keeps serving through secondary '1'
        assert after == before + 3 - lost
        assert server.pull(model) and model.lin.bias.tolist() == [-2.0 * (3 - lost)] * 2
    survivors.barrier(timeout=30)
    if impl is not None:
        impl.stop()
    survivors.barrier(timeout=30)
    world.stop(timeout=2)
    return "survived"


def test_killed_secondary_fails_its_pushes_clearly_and_the_rest_keeps_serving():
    results = run_world(_killed_secondary_body, 4, timeout=120, return_exceptions=True, rpc_timeout=10)
    assert results[0] == results[1] == results[3] == "survived", results
    assert results[2] == "victim"  # it reported, then was SIGKILLed inside World.stop


def _killed_primary_body(world):
    group = world.create_rpc_group("g", ["0", "1", "2"])
    survivors = world.create_rpc_group("s", ["0", "2"]) if world.name != "1" else None
    impl = None
    if world.name != "0":
        impl = PushPullGradServerImpl("gs", group, primary_reducer="1", secondary_reducers=["2"], reduce_batch_size=1)
        if world.name == "1":
            model = Small()
            impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=1.0))
            group.register("die", _die)
        impl.start()
    group.barrier()
    if world.name == "1":
        return "victim"  # waits in World.stop until the client has it killed
    if world.name == "0":
        server = group.get_paired("gs").to_here()
        model = Small()
        server.pull(model)
        _wait_in_stop(world, "1")
        with pytest.raises(PeerLostError):
            group.registered_sync("die", timeout=10)
        # The secondary learns of the loss from its next forward: a push or two may still be
        # accepted (and dropped with the primary); then every push names the dead primary.
        deadline = time.monotonic() + 20
        while True:
            for p in model.parameters():
                p.grad = torch.full_like(p, 1.0)
            try:
                assert server.push(model, pull=False) is True
            except PeerLostError as err:
                lost = err
                break
            assert time.monotonic() < deadline, "pushes kept being accepted after the primary died"
            time.sleep(0.2)
        assert lost.member == "1" and "primary reducer of gradient server 'gs' is gone" in str(lost), lost
        for p in model.parameters():
            p.grad = torch.full_like(p, 1.0)
        with pytest.raises(PeerLostError, match="primary reducer") as again:
            server.push(model)  # machin's way: push, then pull
        assert again.value.member == "1"
        with pytest.raises(PeerLostError) as flushed:
            server.flush(timeout=20)
        assert flushed.value.member == "1", flushed.value
    survivors.barrier(timeout=30)
    if impl is not None:
        impl.stop()
        assert impl.stats()["secondary"]["state"] == "failed"
    survivors.barrier(timeout=30)
    world.stop(timeout=2)
    return "survived"


def test_killed_primary_fails_pushes_naming_it():
    results = run_world(_killed_primary_body, 3, timeout=120, return_exceptions=True, rpc_timeout=10)
    assert results[0] == results[2] == "survived", results
    assert results[1] == "victim"


class Boom(Exception):
    pass


class ExplodingOptimizer:
    def __init__(self, params):
        self.params = list(params)

    def step(self):
        raise Boom("the optimizer blew up")


def impl_rejected(group):
    return group.registered_sync("rejected")


@world_test(2, timeout=90)
def test_bad_input_overflow_stop_and_thread_errors(world):
    group = world.create_rpc_group("g", ["0", "1"])
    if world.name == "0":
        bad = [
            (dict(reduce_method="median"), ValueError, "reduce_method='median' must be 'sum' or 'mean'"),
            (dict(reduce_batch_size=0), ValueError, "reduce_batch_size=0 must be a positive int"),
            (dict(max_queue_size=2), ValueError, "max_queue_size=2 must be at least reduce_batch_size=4"),
            (dict(primary_reducer="9"), ValueError, "primary_reducer='9' is not a member"),
            (dict(secondary_reducers=["0", "0"]), ValueError, "must be distinct members"),
            (dict(secondary_reducers="0"), TypeError, "must be a list of member names"),
            (dict(primary_reducer="1", secondary_reducers=["1"]), ValueError, "member '0' is neither the primary"),
            (dict(reduce_device="nowhere"), ValueError, "reduce_device='nowhere' is not a torch device"),
        ]
        for kwargs, kind, message in bad:
            with pytest.raises(kind, match=message):
                PushPullGradServerImpl("x", group, **kwargs)
        impl = PushPullGradServerImpl("server", group, primary_reducer="0", secondary_reducers=["0"],
                                      reduce_batch_size=2, max_queue_size=3)
        with pytest.raises(RuntimeError, match="call manage_model"):
            impl.start()
        model = Small()
        gate = threading.Event()
        impl.manage_model(model, GatedSGD(model.parameters(), gate))
        with pytest.raises(RuntimeError, match="already manages a model"):
            impl.manage_model(model, None)
        impl.start()  # its first step waits for the gate: the queues fill up behind it
        group.register("rejected", lambda: impl.stats()["secondary"]["rejected"])
        failing = PushPullGradServerImpl("failing", group, primary_reducer="0", secondary_reducers=["0"],
                                         reduce_batch_size=1)
        doomed = Small()
        failing.manage_model(doomed, ExplodingOptimizer(doomed.parameters()))
        failing.start()
    group.barrier()
    if world.name == "1":
        server = group.get_paired("server").to_here()
        other = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 2))
        other(torch.ones(1, 3)).sum().backward()
        with pytest.raises(ValueError, match=r"cannot push to gradient server 'server': this model lacks "
                                             r"'lin.weight', 'lin.bias'; this model has '0.weight', '0.bias', "
                                             r"'1.weight', '1.bias' that"):
            server.push(other)
        wide = nn.Module()
        wide.lin = nn.Linear(4, 2)
        with pytest.raises(ValueError, match=r"shapes differ \('lin.weight': \[2, 4\] instead of \[2, 3\]\)"):
            server.push(wide)
        complex_model = Small().to(torch.complex64)
        for p in complex_model.parameters():
            p.grad = torch.ones_like(p)
        with pytest.raises(ValueError, match=r"cannot be cast to the managed model's dtypes \('lin.weight': "
                                             r"torch.complex64 to torch.float32, the imaginary part would be "
                                             r"dropped; 'lin.bias': torch.complex64"):
            server.push(complex_model)
        model = Small()
        with pytest.raises(ValueError, match=r"no gradient \(.grad is None\) for 'lin.weight', 'lin.bias': run "
                                             r"backward\(\) before push\(\), or pass none_as_zero=True"):
            server.push(model)
        with pytest.raises(RuntimeError, match=r"no gradient"):  # machin's type for it: its except clauses
            server.push(model)
        poisoned = Small()
        poisoned.lin.weight.grad, poisoned.lin.bias.grad = torch.ones(2, 3), torch.tensor([1.0, float("nan")])
        with pytest.raises(ValueError, match=r"the gradients of 'lin.bias' hold NaN or inf values, which would make "
                                             r"the managed parameters NaN; nothing was sent"):
            server.push(poisoned)
        poisoned.lin.bias.grad[1] = 0.0
        poisoned.lin.weight.grad[1, 2] = float("-inf")
        with pytest.raises(ValueError, match=r"the gradients of 'lin.weight' hold NaN or inf"):
            server.push(poisoned, pull=False)  # (none of them counted below: accepted + rejected == 61)
        with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
            server.push({"lin.weight": torch.zeros(2, 3)})
        with pytest.raises(ValueError, match="cannot pull from gradient server 'server' into this model"):
            server.pull(wide)
        with pytest.raises(TypeError, match="pull must be a bool"):
            server.push(model, pull="no")
        model.lin.weight.grad = torch.ones(2, 3)
        assert server.push(model, none_as_zero=True, pull=False)  # bias: zero
        model.lin.bias.grad = torch.ones(2)
        # The fast path refuses a push that finds the queue full (max_queue_size=3) and
        # says so; the primary is jammed, so the queues fill within a few dozen pushes.
        outcomes = [server.push(model, pull=False) for _ in range(60)]
        accepted = 1 + outcomes.count(True)
        assert outcomes.count(False) >= 1 and outcomes[-1] is False
    group.barrier()
    if world.name == "0":
        secondary = impl.stats()["secondary"]
        assert secondary["rejected"] >= 1 and secondary["queued"] == 3
        gate.set()
    group.barrier()
    if world.name == "1":
        # every accepted push is applied, none of the refused ones
        assert server.flush(timeout=30) >= 1
        fresh = Small()
        assert server.pull(fresh)
        assert fresh.lin.weight.tolist() == [[-float(accepted)] * 3] * 2
        assert fresh.lin.bias.tolist() == [-float(accepted - 1)] * 2
        assert accepted + impl_rejected(group) == 61
        failing = group.get_paired("failing").to_here()
        model = Small()
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        assert failing.push(model, pull=False)
        with pytest.raises(ServerStoppedError, match=r"the primary reducer on member '0' failed with "
                                                     r"Boom\('the optimizer blew up'\)"):
            failing.flush(timeout=30)
        # The secondary beside the failed primary fails too, at its next forward.
        with pytest.raises(ServerStoppedError, match="the primary reducer on member '0' failed"):
            failing.push(model, pull=False)
            failing.flush(timeout=30)
    group.barrier()
    if world.name == "0":
        assert isinstance(failing.secondary.error, ServerStoppedError)  # (cold trial 29: watch() raised this)
        with pytest.raises(Boom, match="the optimizer blew up"):
            failing.watch()  # the thread's own exception, with its traceback (the primary's first)
        failing.stop(timeout=10)  # joins the threads: the failed one has ended, the other stops
        assert failing.threads() == []
        with pytest.raises(Boom):
            failing.watch()  # still reported after stop
        impl.stop()
        impl.watch()  # a cleanly stopped server has nothing to report
    group.barrier()
    if world.name == "1":
        with pytest.raises(ServerStoppedError, match="the secondary reducer on member '0' is stopped"):
            server.push(model)
    group.barrier()
    if world.name == "0":
        failing.close()
        impl.close()
        assert _our_threads() == []
        with pytest.raises(RuntimeError, match="is closed"):
            impl.start()
    group.barrier()
    group.destroy()


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _tiny():
    return nn.Linear(2, 1)


@world_test(3, timeout=90)
def test_grad_server_helper_runs_every_reducer(world):
    servers = grad_server_helper([_mlp, _tiny], optimizer=torch.optim.SGD, learning_rate=[0.1, 0.5],
                                 lr_scheduler=torch.optim.lr_scheduler.StepLR,
                                 lr_scheduler_kwargs={"step_size": 1, "gamma": 0.5}, reduce_batch_size=2)
    assert len(servers) == 2 and len(servers.impls) == 2  # every member reduces
    mlp_server, tiny_server = servers
    model, tiny = _mlp(), _tiny()
    assert mlp_server.pull(model) and tiny_server.pull(tiny) and model.pp_grad_version == 0
    servers.group.barrier()  # nobody pushes (and so makes version 1) before all pulled version 0
    torch.manual_seed(int(world.name) + 1)
    for _ in range(2):
        for m, s, inputs in ((model, mlp_server, 4), (tiny, tiny_server, 2)):
            m.zero_grad()
            m(torch.randn(5, inputs)).pow(2).mean().backward()
            assert s.push(m, pull=False)
    servers.group.barrier()
    if world.name == "0":
        assert mlp_server.flush(timeout=30) >= 1 and tiny_server.flush(timeout=30) >= 1
    servers.group.barrier()
    assert mlp_server.pull(model) and tiny_server.pull(tiny)
    stats = servers.stats()
    assert all(s["secondary"]["batches"] >= 1 for s in stats)  # each member's reducer ran
    if world.name == "0":
        # 3 members x 2 pushes, reduced 2 by 2 on each member: 3 partial sums, so one
        # full primary batch and one flushed partial batch
        assert stats[0]["primary"]["steps"] == 2 and stats[0]["primary"]["applied"] == 6
        lr = servers.impls[0]._managed.optimizer.param_groups[0]["lr"]
        assert lr == 0.1 * 0.5 ** 2  # the scheduler was stepped with each optimizer step
    servers.watch()
    servers.close()
    assert _our_threads() == []


def _frozen_encoder():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model[0].requires_grad_(False)  # a pretrained encoder, fine-tuned above
    return model


@world_test(2, timeout=90)
def test_frozen_parameters_stay_frozen_and_compiled_clients_push_plain_names(world):
    # AdamW decays every parameter it steps on; torch's optimizers skip one whose .grad is
    # None, and the server must too, or a frozen encoder drifts. A frozen parameter needs no
    # none_as_zero; a compiled client pushes and pulls the names of the module it wraps.
    servers = grad_server_helper([_frozen_encoder], optimizer=torch.optim.AdamW, learning_rate=0.1)
    server = servers[0]
    model = _frozen_encoder()
    encoder = model[0].weight.detach().clone()
    if world.name == "1":
        compiled = torch.compile(model, backend="eager")
        for _ in range(3):
            compiled(torch.randn(5, 4)).pow(2).mean().backward()
            assert model[2].weight.grad is not None and model[0].weight.grad is None
            assert server.push(compiled, pull=False)
        head = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))  # nothing frozen, no backward
        with pytest.raises(ValueError, match=r"no gradient \(.grad is None\) for '0.weight', '0.bias', "
                                             r"'2.weight', '2.bias'"):
            server.push(head)
        assert server.flush(timeout=30) >= 1
        assert server.pull(compiled) and compiled.pp_grad_version >= 1
    servers.group.barrier()
    fresh = _frozen_encoder()
    assert server.pull(fresh)
    assert torch.equal(fresh[0].weight, encoder)  # the frozen encoder did not move
    assert not torch.equal(fresh[2].weight, _frozen_encoder()[2].weight)  # the head learned
    servers.close()
    # (trial 8: a push after close() said an internal service was missing, with the advice
    # to register it)
    for call in (lambda: server.push(model, pull=False), lambda: server.pull(fresh), server.flush):
        with pytest.raises(ServerStoppedError, match="gradient server 'grad_server_0' was closed on this member"):
            call()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@world_test(2, timeout=90)
def test_managed_model_stays_on_its_gpu(world):
    group = world.create_rpc_group("gpu", ["0", "1"])
    if world.name == "0":
        impl = PushPullGradServerImpl("server", group, primary_reducer="0", secondary_reducers=["0"],
                                      reduce_device="cuda", reduce_batch_size=2)
        model = Chain().cuda()
        params = list(model.parameters())
        impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=1.0))
        impl.start()
    group.barrier()
    server = group.get_paired("server").to_here()
    if world.name == "1":
        model = Chain().cuda()  # a GPU client: gradients leave it through the CPU
        for _ in range(4):
            model.zero_grad()
            model(torch.ones(1, 1, device="cuda")).sum().backward()
            assert server.push(model, pull=False)
        assert server.flush(timeout=30) == 1
        assert server.pull(model) and model.weights() == EXPECTED["sum"]
        assert all(p.device.type == "cuda" for p in model.parameters())
    group.barrier()
    if world.name == "0":
        assert list(model.parameters()) == params and all(p.device.type == "cuda" for p in params)
        assert model.weights() == EXPECTED["sum"]
        impl.close()
    group.barrier()
    group.destroy()
