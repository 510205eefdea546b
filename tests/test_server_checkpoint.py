"""Checkpoints of the gradient server's primary: atomic files that refuse to load wrong,
and a SIGKILLed primary that resumes from one while its client goes on."""

from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn

from machinlike import launch
from machinlike.exception import PeerLostError
from machinlike.server import CheckpointError, PushPullGradServerImpl
from machinlike.server._checkpoint import Checkpointer


def test_checkpoints_round_trip_and_refuse_what_does_not_fit(tmp_path):
    ckpt = Checkpointer(tmp_path, "grad-server", "g")
    assert ckpt.load() is None
    ckpt.save({"version": 3, "w": torch.arange(4.0)})
    got = ckpt.load()
    assert got["version"] == 3 and torch.equal(got["w"], torch.arange(4.0))
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []
    with pytest.raises(CheckpointError, match="belongs to kind 'grad-server', not 'model-server'"):
        Checkpointer(tmp_path, "model-server", "g").load()
    data = open(ckpt.path, "rb").read()
    with open(ckpt.path, "wb") as f:
        f.write(data[: len(data) // 2])  # what a crash mid-write without the rename would leave
    with pytest.raises(CheckpointError, match=f"{ckpt.path!r} is corrupt or truncated"):
        ckpt.load()
    torch.save({"w": 1}, ckpt.path)
    with pytest.raises(CheckpointError, match="is not a machinlike checkpoint"):
        ckpt.load()
    with pytest.raises(TypeError, match="checkpoint_dir must be a path"):
        Checkpointer(5, "grad-server", "g")


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))


def _key(world, name):
    return world.membership.key(f"ckpt-test/{name}")


def _body(world, directory):
    registry = world.membership.registry
    group = world.create_rpc_group("g")
    if world.name == "p":
        if world.incarnation > 1:  # come back only once the client saw the primary gone
            registry.wait_all(_key(world, ""), ["restart"], 60, "the client")
        impl = PushPullGradServerImpl("grad", group, primary_reducer="p", secondary_reducers=None,
                                      reduce_batch_size=1, max_queue_size=8, checkpoint_dir=directory,
                                      checkpoint_every=1)
        model = Two()
        impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=1.0))
        impl.start()
        registry.set(_key(world, f"ready{world.incarnation}"), "1")
        if world.incarnation == 1:
            registry.wait_all(_key(world, ""), ["die"], 60, "the client")
            os.kill(os.getpid(), signal.SIGKILL)
        registry.wait_all(_key(world, ""), ["end"], 60, "the client")
        return impl.stats()["primary"]["version"]
    registry.wait_all(_key(world, ""), ["ready1"], 60, "the primary")
    world.wait_for_members(["p"], timeout=30)  # this member's view has seen it join
    server = group.get_paired("grad", timeout=30).to_here()
    model = Two()
    for _ in range(3):
        model.w.grad = torch.tensor([1.0, 2.0])
        server.push(model)
    version = server.flush(timeout=30)
    server.pull(model)
    before = (model.w.detach().clone(), model.pp_version)
    registry.set(_key(world, "die"), "1")
    world.membership.wait_until(lambda live: world.get_incarnation("p") != 1, 30)
    model.w.grad = torch.tensor([1.0, 2.0])
    with pytest.raises(PeerLostError, match="'p'"):
        server.push(model)  # told, by name, while the primary is gone
    registry.set(_key(world, "restart"), "1")
    registry.wait_all(_key(world, ""), ["ready2"], 60, "the restarted primary")
    world.membership.wait_until(lambda live: world.get_incarnation("p") == 2, 30)
    assert server.pull(model)  # the same accessor goes on: no restart of the client
    after = (model.w.detach().clone(), model.pp_version)
    model.w.grad = torch.tensor([1.0, 1.0])
    server.push(model)
    final = server.flush(timeout=30)
    server.pull(model)
    registry.set(_key(world, "end"), "1")
    return {"version": version, "before": before, "after": after, "final": (model.w.detach().clone(), final)}


def test_a_killed_primary_resumes_from_its_checkpoint(tmp_path):
    result = launch(_body, 2, args=(str(tmp_path),), names=["c", "p"], max_restarts=1, essential=["c"], timeout=90)
    out = result[0]
    w_before, v_before = out["before"]
    w_after, v_after = out["after"]
    assert torch.equal(w_before, torch.tensor([-3.0, -6.0]))
    assert torch.equal(w_after, w_before)  # every version was checkpointed
    assert v_after > v_before  # a resumed primary never reuses a version
    w_final, v_final = out["final"]
    assert torch.equal(w_final, torch.tensor([-4.0, -7.0])) and v_final > v_after
    assert [r.name for r in result.restarts] == ["p"]
