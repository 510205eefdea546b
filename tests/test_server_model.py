"""PushPullModelServer across real processes: machin's behaviour, the version chain under
concurrent pushers, no transfer when up to date, architecture checks, and the helper."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from machinlike import _shm
from machinlike.server import PushPullModelServer, PushPullModelServerImpl, ServerStoppedError, model_server_helper
from machinlike.testing import run_world, world_test


class Masked(nn.Module):
    """A buffer that holds -inf by design (an attention mask): pushed as it is."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(2, 2)
        self.register_buffer("mask", torch.tensor([0.0, float("-inf")]))


class Model(nn.Module):
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
        return self.fc1(x) + self.fc2(x) + self.fc3(x)

    def weights(self):
        return [self.fc1.weight.item(), self.fc2.weight.item(), self.fc3.weight.item()]


class Other(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(1, 2, bias=False)
        self.head = nn.Linear(2, 1)


def _machin_and_chain_body(world):
    group = world.create_rpc_group("group", ["0", "1", "2"])
    if world.name == "0":
        impl = PushPullModelServerImpl("server", group)
    group.barrier()
    if world.name == "1":
        server = group.get_paired("server").to_here()
        assert isinstance(server, PushPullModelServer)
        model = Model()
        assert not hasattr(model, "pp_version")  # nothing to declare
        assert not server.pull(model)  # empty server: nothing to load
        for i in range(10):
            with torch.no_grad():
                for p in model.parameters():
                    p += 1
            assert server.push(model)
            assert model.pp_version == i + 1
        assert "pp_version" not in model.state_dict()
        fresh = Model()
        assert server.pull(fresh)
        assert fresh.weights() == [11.0, 12.0, 13.0] and fresh.pp_version == 10
        assert not server.pull(fresh)  # already the newest: nothing is sent
        stale = Model()  # at version 0: its push is rejected and it pulls instead
        assert not server.push(stale)
        assert stale.weights() == [11.0, 12.0, 13.0] and stale.pp_version == 10
        kept = Model()
        assert not server.push(kept, pull_on_fail=False)
        assert kept.weights() == [1.0, 2.0, 3.0] and not hasattr(kept, "pp_version")
    group.barrier()
    if world.name == "0":
        ordered = impl.o_server_impl.stats()
        # up to date: the same-host version word answered without a call (else a call sent nothing)
        assert ordered["pulls_unchanged"] == (0 if _shm.recycled.supported() else 1)
    # Two clients race on one chain: every accepted push made exactly the next version.
    if world.name in ("1", "2"):
        server = group.get_paired("server").to_here()
        model = Model()
        server.pull(model)
        wins = 0
        for _ in range(15):
            before = model.pp_version
            with torch.no_grad():
                model.fc1.weight += 1
            if server.push(model):
                wins += 1
                assert model.pp_version == before + 1
            else:
                assert model.pp_version > before  # pulled the winner's version
        result = wins
    else:
        result = None
    group.barrier()
    if world.name == "1":
        model = Model()
        server.pull(model)
        final_version = model.pp_version
        final_fc1 = model.fc1.weight.item()
    group.barrier()
    group.destroy()
    return result, (final_version, final_fc1) if world.name == "1" else None


def test_machin_behaviour_then_concurrent_pushers_keep_a_linear_chain():
    results = run_world(_machin_and_chain_body, 3, timeout=90)
    wins = results[1][0] + results[2][0]
    version, fc1 = results[1][1]
    assert version == 10 + wins  # no accepted push was lost or duplicated
    assert fc1 == 11.0 + wins  # each accepted version added exactly one to the newest weight


@world_test(2, timeout=60)
def test_architecture_checks_and_errors(world):
    group = world.create_rpc_group("g", ["0", "1"])
    if world.name == "0":
        PushPullModelServerImpl("server", group)
        PushPullModelServerImpl("masked", group)
        with pytest.raises(TypeError, match="o_server must be an OrderedServerBase"):
            PushPullModelServerImpl("bad", group, o_server="not a server")
        with pytest.raises(KeyError, match="model server 'server' already exists in group 'g'.*pick another"):
            PushPullModelServerImpl("server", group)  # (cold trial 11: the message named an inner service)
    group.barrier()
    if world.name == "1":
        server = group.get_paired("server").to_here()
        model = Model()
        assert server.push(model)
        other = Other()
        with pytest.raises(ValueError, match=r"cannot push model 'model': the server holds another architecture: "
                                             r"this model lacks 'fc2.weight', 'fc3.weight'; this model has "
                                             r"'head.weight', 'head.bias' that the server's model does not have; "
                                             r"shapes differ \('fc1.weight': \[2, 1\] instead of \[1, 1\]\)"):
            server.push(other)
        before = [p.clone() for p in other.parameters()]
        with pytest.raises(ValueError, match=r"cannot pull model 'model' into a model of another architecture "
                                             r"\(nothing was loaded\)"):
            server.pull(other)
        assert all(torch.equal(a, b) for a, b in zip(before, other.parameters(), strict=True))
        # a fresh accessor checks too (it reads the spec the first push claimed)
        again = group.get_paired("server").to_here()
        with pytest.raises(ValueError, match=r"dtypes differ \('fc1.weight': torch.float64 instead of torch.float32"):
            again.push(Model().double())
        with pytest.raises(TypeError, match="model must be a torch.nn.Module, not OrderedDict"):
            server.push(model.state_dict())
        # A diverged learner's NaN went to every client at its next pull.
        poisoned = Model()
        server.pull(poisoned)
        version = poisoned.pp_version
        with torch.no_grad():
            poisoned.fc2.weight.fill_(float("nan"))
        with pytest.raises(ValueError, match=r"cannot push model 'model': 'fc2.weight' hold NaN or inf values; nothing "
                                             r"was sent\. The training step that made them diverged"):
            server.push(poisoned)
        fresh = Model()
        assert poisoned.pp_version == version and server.pull(fresh) and fresh.pp_version == version
        assert all(torch.isfinite(p).all() for p in fresh.parameters())
        assert group.get_paired("masked").to_here().push(Masked())  # (parameters are looked at, not buffers)
        # A version set by hand: push failed inside ("can only concatenate str"), and pull
        # overwrote it in silence (cold trial 18).
        model.pp_version = "abc"
        for call in (server.push, server.pull):
            with pytest.raises(TypeError, match=r"model.pp_version='abc' must be an int \(the version push and "
                                                r"pull set\) or None; set it to None to pull the newest"):
                call(model)
        model.pp_version = None
        with pytest.raises(TypeError, match="o_server must be an OrderedServerBase accessor"):
            PushPullModelServer("model")
    group.barrier()
    group.destroy()


@world_test(3, timeout=60)
def test_model_server_helper(world):
    servers = model_server_helper(model_num=2)
    assert len(servers) == 2 and all(isinstance(s, PushPullModelServer) for s in servers)
    assert len(servers.impls) == (2 if world.name == "0" else 0)
    first, second = servers  # unpacks like machin's tuple
    model = Model()
    if world.name == "2":
        with torch.no_grad():
            model.fc3.weight.fill_(42)
        assert second.push(model)
    servers.group.barrier()
    fresh = Model()
    assert second.pull(fresh) and fresh.weights() == [1.0, 2.0, 42.0]
    assert not first.pull(Model())  # the other server holds nothing yet
    servers.close()
    servers.close()  # idempotent
    with pytest.raises(ServerStoppedError, match="model 'model' of 'model_server_1/ordered' was closed on this member"):
        second.pull(fresh)
    with pytest.raises(RuntimeError, match="has been destroyed"):
        servers.group.barrier()  # the helper created the group, close() removed it
    # machin's call: the second argument (or group_name=) names the group to create;
    # the servers keep their names.
    for machins in (model_server_helper(1, "apex_group"), model_server_helper(1, group_name="apex_group2")):
        assert machins.group.get_group_name() in ("apex_group", "apex_group2")
        assert machins.group.is_paired("model_server_0")
        machins.close()
    with pytest.raises(TypeError, match="pass the new group's name once"):
        model_server_helper(1, "a", group_name="b")
    # members was ignored when a group was given (cold trial 20): a list that differs is refused
    own = world.create_rpc_group("own", world.get_members())
    with pytest.raises(ValueError, match=r"members=\['zz'\] differs from the members of group=.*leave members out"):
        model_server_helper(1, own, members=["zz"])
    own.destroy()


@world_test(2, timeout=90)
def test_compiled_and_wrapped_models_share_a_server_with_plain_ones_and_pulls_cast_dtypes(world):
    # A learner compiles (or wraps) its model, actors run it plain, often in bfloat16: the
    # server moves the wrapped module's names, and a pull casts as load_state_dict does.
    group = world.create_rpc_group("g", ["0", "1"])
    if world.name == "0":
        PushPullModelServerImpl("server", group)
    group.barrier()
    server = group.get_paired("server").to_here()
    if world.name == "1":
        learner = torch.compile(Model(), backend="eager")
        assert learner(torch.ones(1, 1)).item() == 6.0  # compiled and run: still the same module
        with torch.no_grad():
            learner.fc1.weight.fill_(7)
        assert server.push(learner) and learner.pp_version == 1
        wrapped = nn.DataParallel(Model())  # no GPU: it only prefixes the names with "module."
        assert server.pull(wrapped) and wrapped.module.weights() == [7.0, 2.0, 3.0] and wrapped.pp_version == 1
        with torch.no_grad():
            wrapped.module.fc2.weight.fill_(8)
        assert server.push(wrapped) and wrapped.pp_version == 2
    group.barrier()
    if world.name == "0":
        actor = Model().to(torch.bfloat16)
        assert server.pull(actor) and actor.fc1.weight.dtype == torch.bfloat16
        assert actor.weights() == [7.0, 8.0, 3.0]
        compiled = torch.compile(Model(), backend="eager")
        assert server.pull(compiled) and compiled._orig_mod.weights() == [7.0, 8.0, 3.0]
        complex_model = Model().to(torch.complex64)
        assert server.pull(complex_model)  # real into complex keeps the meaning
        with pytest.raises(ValueError, match=r"dtypes differ \('fc1.weight': torch.complex64 instead of "
                                             r"torch.float32"):
            server.push(complex_model)  # a push does not cast: the server keeps one dtype per entry
    group.barrier()
    group.destroy()


def _helper_in_an_elastic_world(world):
    import logging

    said = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: said.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("machinlike.server").addHandler(handler)
    servers = model_server_helper(1, timeout=20)
    servers.close()
    return said


def test_a_helper_over_all_members_of_an_elastic_world_says_it_is_who_joined_so_far():
    # (trial 8: a static program given max_restarts built a one-member server on rank 0 in
    # silence; its other ranks failed a minute later)
    from machinlike import launch

    said = launch(_helper_in_an_elastic_world, 1, max_restarts=1, timeout=60)[0]
    assert any("members='all' in an elastic world is who has joined so far (['0'])" in s for s in said), said
