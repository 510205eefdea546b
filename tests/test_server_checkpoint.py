"""Checkpoints of the gradient server's primary: atomic files that refuse to load wrong,
and a SIGKILLed primary that resumes from one while its client goes on."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
import torch
from torch import nn

from machinlike import get_world, launch
from machinlike.exception import PeerLostError
from machinlike.server import (CheckpointError, OrderedServerBase, OrderedServerSimple, OrderedServerSimpleImpl,
                               PushPullGradServerImpl)
from machinlike.server._checkpoint import Checkpointer
from machinlike.server._grad.checkpoint import PrimaryCheckpoint
from machinlike.server._host import HostCheckpoint


def test_a_due_checkpoint_is_claimed_while_it_is_written(tmp_path, monkeypatch):
    # Cold trial 29: every push accepted while a checkpoint was being written found one due
    # too (the count moved on only once the write ended): 4 pushers of 1 MB values wrote
    # about 3x as many checkpoints as checkpoint_every asks, each rewriting every history.
    host = HostCheckpoint(tmp_path, "ordered-server", "kv", 20, None)
    assert host.due(20) and not host.due(21) and not host.due(39)  # 20 is being written
    host.save(20, {"data": {}})
    assert not host.due(39) and host.due(40)
    failing = host.file.save

    def full_disk(state):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(host.file, "save", full_disk)
    with pytest.raises(OSError):
        host.save(40, {"data": {}})
    assert host.due(41)  # the failed one is not claimed any more: the next version tries again
    monkeypatch.setattr(host.file, "save", failing)
    host.save(41, {"data": {}})
    assert host.written == 2 and not host.due(60) and host.due(61)
    timed = HostCheckpoint(tmp_path, "ordered-server", "kv2", 1000, 3600.0)
    timed._when -= 3601  # an hour since the last: due once, not again while it is written
    assert timed.due(1) and not timed.due(2)


def test_checkpoints_round_trip_and_refuse_what_does_not_fit(tmp_path):
    ckpt = Checkpointer(tmp_path, "grad-server", "g")
    assert ckpt.load() is None
    ckpt.save({"version": 3, "w": torch.arange(4.0)})
    got = ckpt.load()
    assert got["version"] == 3 and torch.equal(got["w"], torch.arange(4.0))
    assert [p for p in os.listdir(tmp_path) if ".tmp-" in p] == []
    with pytest.raises(CheckpointError, match="belongs to kind 'grad-server', not 'model-server'"):
        Checkpointer(tmp_path, "model-server", "g").load()
    with open(ckpt.path, "rb") as f:
        data = f.read()
    with open(ckpt.path, "wb") as f:
        f.write(data[: len(data) // 2])  # what a crash mid-write without the rename would leave
    with pytest.raises(CheckpointError, match=f"{ckpt.path!r} is corrupt or truncated"):
        ckpt.load()
    torch.save({"w": 1}, ckpt.path)
    with pytest.raises(CheckpointError, match="is not a machinlike checkpoint"):
        ckpt.load()
    with pytest.raises(TypeError, match="checkpoint_dir must be a path"):
        Checkpointer(5, "grad-server", "g")
    # A file given as the directory was taken, and the first save failed with a bare
    # FileExistsError, long after the server was built (cold trial 17).
    with pytest.raises(ValueError, match=r"checkpoint_dir='.*/g.ckpt' is a file, not a directory: pass a directory"):
        Checkpointer(ckpt.path, "grad-server", "g")
    with pytest.raises(ValueError, match=r"checkpoint_dir='.*/g.ckpt/runs/1' lies under '.*/g.ckpt', a file"):
        Checkpointer(os.path.join(ckpt.path, "runs", "1"), "grad-server", "g")
    assert Checkpointer(tmp_path / "runs" / "1", "grad-server", "g").load() is None  # missing: made at the first save
    # A directory that cannot be made was taken; the host logged, counted nothing, and its
    # first push of a key failed with a bare FileNotFoundError (cold trial 20). The host
    # tries it as it is built (load), naming it; other members do not (the path may be
    # the host machine's alone).
    from machinlike.server._host import HostCheckpoint

    unmakeable = HostCheckpoint("/proc/machinlike-nope/ckpt", "ordered-server", "kv", 1, None)  # (built: no probe)
    with pytest.raises(FileNotFoundError, match=r"checkpoint_dir='/proc/machinlike-nope/ckpt' of ordered-server "
                                                r"'kv' cannot hold its checkpoint \(No such file or directory\): "
                                                r"pass a directory this process can make and write"):
        unmakeable.load()
    assert not os.path.exists("/proc/machinlike-nope")


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(2))


def _key(world, name):
    return world.membership.keys.scratch(f"ckpt-test/{name}")


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
    before = (model.w.detach().clone(), model.pp_grad_version)
    registry.set(_key(world, "die"), "1")
    world.membership.wait_until(lambda live: world.get_incarnation("p") != 1, 30)
    model.w.grad = torch.tensor([1.0, 2.0])
    with pytest.raises(PeerLostError, match="'p'"):
        server.push(model)  # told, by name, while the primary is gone
    registry.set(_key(world, "restart"), "1")
    registry.wait_all(_key(world, ""), ["ready2"], 60, "the restarted primary")
    world.membership.wait_until(lambda live: world.get_incarnation("p") == 2, 30)
    assert server.pull(model)  # the same accessor goes on: no restart of the client
    after = (model.w.detach().clone(), model.pp_grad_version)
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


class _DiesOncePublished(OrderedServerBase):
    """The primary's way to an ordered server hosted elsewhere; the first incarnation of
    the primary SIGKILLs itself the moment version ``at`` is stored there: visible to
    clients, before the gradient server did anything else about it."""

    def __init__(self, inner: OrderedServerBase, at: int) -> None:
        self.inner, self.at = inner, at

    def push(self, key, value, version, prev_version):
        stored = self.inner.push(key, value, version, prev_version)
        if stored and version == self.at and get_world().incarnation == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        return stored

    def pull(self, key, version=None):
        return self.inner.pull(key, version)

    def pull_if_changed(self, key, have_version):
        return self.inner.pull_if_changed(key, have_version)


def _published_body(world, directory, every):
    registry = world.membership.registry
    group = world.create_rpc_group("g")
    if world.name == "p":
        registry.wait_all(_key(world, ""), ["restart" if world.incarnation > 1 else "ordered"], 60, "the client")
        impl = PushPullGradServerImpl("grad", group, primary_reducer="p", secondary_reducers=None,
                                      o_server=_DiesOncePublished(OrderedServerSimple("ord", group), at=3),
                                      reduce_batch_size=1, max_queue_size=8, checkpoint_dir=directory,
                                      checkpoint_every=every)
        model = Two()
        impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=1.0))
        impl.start()
        registry.set(_key(world, f"ready{world.incarnation}"), "1")
        registry.wait_all(_key(world, ""), ["end"], 60, "the client")
        return impl.stats()["primary"]["version"]
    ordered = OrderedServerSimpleImpl("ord", group)  # on the client: outlives the primary
    registry.set(_key(world, "ordered"), "1")
    registry.wait_all(_key(world, ""), ["ready1"], 60, "the primary")
    world.wait_for_members(["p"], timeout=30)
    server = group.get_paired("grad", timeout=30).to_here()
    model = Two()
    for _ in range(3):  # versions 1, 2 and 3; the primary dies once 3 is visible
        model.w.grad = torch.tensor([1.0, 2.0])
        assert server.push(model, pull=False)
    world.membership.wait_until(lambda live: world.get_incarnation("p") != 1, 30)
    assert server.pull(model)
    seen = (model.w.detach().clone(), model.pp_grad_version)
    registry.set(_key(world, "restart"), "1")
    registry.wait_all(_key(world, ""), ["ready2"], 60, "the restarted primary")
    changed = server.pull(model)
    registry.set(_key(world, "end"), "1")
    world.wait_for_members(["p"], timeout=30, gone=True)
    ordered.close()
    return {"seen": seen, "changed": changed, "after": (model.w.detach().clone(), model.pp_grad_version)}


# every=1: the checkpoint holds version 2; every=100: only the one written before version 0.
@pytest.mark.parametrize("every, resumed", [(1, [-2.0, -4.0]), (100, [0.0, 0.0])])
def test_a_primary_killed_right_after_publishing_never_reuses_that_version(tmp_path, every, resumed):
    # The kill lands after version 3 became visible and before the primary noted or
    # checkpointed it: the resumed primary must still publish above 3, or a client
    # holding 3 would never pull the different contents.
    result = launch(_published_body, 2, args=(str(tmp_path), every), names=["c", "p"], max_restarts=1,
                    essential=["c"], timeout=90)
    out = result[0]
    w_seen, v_seen = out["seen"]
    assert v_seen == 3 and torch.equal(w_seen, torch.tensor([-3.0, -6.0]))
    w_after, v_after = out["after"]
    assert out["changed"] and v_after > v_seen, (v_seen, v_after)
    assert torch.equal(w_after, torch.tensor(resumed))  # the checkpoint's, under a fresh version
    assert result[1] == v_after and [r.name for r in result.restarts] == ["p"]


def test_a_primary_checkpoint_needs_its_lease(tmp_path):
    params = dict(Two().named_parameters())
    state = {"params": {"w": torch.zeros(2)}, "optimizer": {}, "lr_scheduler": None, "version": 7, "applied": {}}
    ckpt = PrimaryCheckpoint(HostCheckpoint(tmp_path, "grad-server", "g", every=1, interval=None))
    assert ckpt.resume(params, torch.optim.SGD(params.values(), lr=1.0), None) is None
    Checkpointer(tmp_path, "grad-server", "g").save(state)
    with pytest.raises(CheckpointError, match="has no lease file .*g.lease"):
        ckpt.resume(params, torch.optim.SGD(params.values(), lr=1.0), None)
    Checkpointer(tmp_path, "grad-server", "g", suffix=".lease").save({"lease": 5})
    with pytest.raises(CheckpointError, match="holds version 7, above the lease 5"):
        ckpt.resume(params, torch.optim.SGD(params.values(), lr=1.0), None)


def _closing_body(world, directory, pushes):
    group = world.create_rpc_group("g")
    impl = PushPullGradServerImpl("grad", group, primary_reducer=world.name, secondary_reducers=[world.name],
                                  reduce_batch_size=1, max_queue_size=8, checkpoint_dir=directory,
                                  checkpoint_every=100)
    model = Two()
    impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=1.0))
    impl.start()
    server = group.get_paired("grad", timeout=30).to_here()
    client = Two()
    server.pull(client)
    start = client.w.detach().clone()
    for _ in range(pushes):
        client.w.grad = torch.tensor([1.0, 2.0])
        server.push(client)
    server.flush(timeout=30)
    server.pull(client)
    primary = impl.stats()["primary"]
    impl.close()
    return start.tolist(), client.w.detach().tolist(), primary["resumed_version"], primary["steps"]


def test_a_closing_primary_checkpoints_the_versions_made_since_its_last_checkpoint(tmp_path):
    # checkpoint_every=100 and 5 pushes: only the first checkpoint (version 0) was due; a
    # whole job restarted from the directory lost every version after it.
    (start, end, resumed_version, steps), = launch(_closing_body, 1, args=(str(tmp_path), 5), timeout=60)
    assert start == [0.0, 0.0] and end == [-5.0, -10.0] and resumed_version is None and steps == 5
    (resumed, _, resumed_version, steps), = launch(_closing_body, 1, args=(str(tmp_path), 0), timeout=60)
    assert resumed == end
    assert resumed_version is not None and resumed_version > 5 and steps == 0  # (its stats count from the resume)


def _helper_body(world, directory):
    from machinlike.server import grad_server_helper

    servers = grad_server_helper([Two, Two], optimizer=torch.optim.SGD, learning_rate=1.0, reduce_batch_size=1,
                                 checkpoint_dir=directory, checkpoint_every=100)
    seen = []
    for i, server in enumerate(servers):
        client = Two()  # (one per server: a pull from another server loads whole anyway)
        server.pull(client)
        seen.append(client.w.detach().tolist())
        client.w.grad = torch.tensor([1.0, float(i + 1)])
        server.push(client)
        server.flush(timeout=30)
    written = [os.path.basename(path) for path in servers.checkpoint(timeout=30)]
    assert written == ["grad_server_0.ckpt", "grad_server_1.ckpt"], written
    servers.close()
    return seen


def test_the_gradient_helper_checkpoints_each_of_its_servers(tmp_path):
    # A job restarted (torchrun --max-restarts, or by hand) with the same directory resumes
    # every model where the last run stopped, each from its own file.
    first = launch(_helper_body, 1, args=(str(tmp_path),), timeout=60)[0]
    again = launch(_helper_body, 1, args=(str(tmp_path),), timeout=60)[0]
    assert first == [[0.0, 0.0], [0.0, 0.0]] and again == [[-1.0, -1.0], [-1.0, -2.0]]
    assert sorted(os.listdir(tmp_path)) == ["grad_server_0.ckpt", "grad_server_0.lease", "grad_server_1.ckpt",
                                            "grad_server_1.lease"]


class _SlowSGD(torch.optim.SGD):
    """SGD whose step says it began, then takes 1 s: a step a checkpoint must not cut."""

    def __init__(self, params, began):
        super().__init__(params, lr=1.0)
        self.began = began

    def step(self, closure=None):
        self.began.set()
        time.sleep(1.0)
        return super().step(closure)


def _now_body(world, directory):
    group = world.create_rpc_group("g")
    out = {}
    plain = PushPullGradServerImpl("plain", group, primary_reducer=world.name, secondary_reducers=[world.name])
    with pytest.raises(RuntimeError, match="keeps no checkpoint: create it with checkpoint_dir="):
        plain.checkpoint()
    plain.close()
    impl = PushPullGradServerImpl("grad", group, primary_reducer=world.name, secondary_reducers=[world.name],
                                  reduce_batch_size=1, max_queue_size=8, checkpoint_dir=directory,
                                  checkpoint_every=100)
    with pytest.raises(RuntimeError, match="no model yet"):
        impl.checkpoint()
    model, began = Two(), threading.Event()
    impl.manage_model(model, _SlowSGD(model.parameters(), began))
    impl.start()
    server = group.get_paired("grad", timeout=30).to_here()
    client = Two()
    server.pull(client)
    client.w.grad = torch.tensor([1.0, 2.0])
    server.push(client)
    assert began.wait(10)
    with pytest.raises(TimeoutError, match="did not end within 0.2 s, so no checkpoint was written"):
        impl.checkpoint(timeout=0.2)  # (mid-step: the model and the optimizer are being changed)
    path = impl.checkpoint(timeout=10)  # waits for the step, then writes version 1
    saved = Checkpointer(directory, "grad-server", "grad").load()
    out["grad"] = (path == impl.checkpoint_path, saved["version"], saved["params"]["w"].tolist())
    # An ordered server's history, written before the periodic cadence (100) asked for it.
    kv = OrderedServerSimpleImpl("kv", group, checkpoint_dir=directory, checkpoint_every=100)
    kv.store("k", "a", 1, None)  # (a new key is written at once)
    kv.store("k", "b", 2, 1)
    before = Checkpointer(directory, "ordered-server", "kv").load()["data"]["k"]
    kv.checkpoint()
    out["ordered"] = (before, Checkpointer(directory, "ordered-server", "kv").load()["data"]["k"])
    kv.close()
    with pytest.raises(RuntimeError, match="is closed"):
        kv.checkpoint()
    impl.close()
    return out


def test_checkpoint_now_writes_the_newest_version_between_two_steps(tmp_path):
    # The recipe of a job told to stop (SIGTERM): write the servers' checkpoints now,
    # not at their next cadence; a step in progress is waited for, never cut.
    out, = launch(_now_body, 1, args=(str(tmp_path),), timeout=60)
    assert out["grad"] == (True, 1, [-1.0, -2.0])
    assert out["ordered"] == ([(1, "a")], [(1, "a"), (2, "b")])


def test_a_directory_with_other_servers_checkpoints_but_not_this_ones_is_named(tmp_path, caplog):
    # A renamed server or a mistyped directory started afresh in silence: a run that looked resumed.
    with caplog.at_level("INFO", logger="machinlike.server._host"):
        assert HostCheckpoint(tmp_path / "new", "grad-server", "g", 1, None).load() is None  # a first run
        assert [r.levelname for r in caplog.records] == ["INFO"]
        Checkpointer(tmp_path, "grad-server", "digits").save({"version": 3})
        assert HostCheckpoint(tmp_path, "grad-server", "digits_0", 1, None).load() is None
    warned = caplog.records[-1]
    assert warned.levelname == "WARNING" and "no checkpoint 'digits_0.ckpt'" in warned.getMessage()
    assert "which holds digits.ckpt; starting afresh" in warned.getMessage()


def _model_helper_body(world, directory, value):
    from machinlike.server import model_server_helper

    servers = model_server_helper(model_num=1, checkpoint_dir=directory)
    (server,) = servers
    resumed = Two()
    server.pull(resumed)  # what the last run left (nothing on the first)
    if value is not None:
        pushed = Two()
        with torch.no_grad():
            pushed.w.fill_(value)
        assert server.push(pushed)
    paths = [os.path.basename(path) for path in servers.checkpoint()]
    servers.close()
    return resumed.w.detach().tolist(), paths


def test_the_model_helper_checkpoints_its_servers_and_a_later_run_resumes_them(tmp_path):
    assert launch(_model_helper_body, 1, args=(str(tmp_path), 3.0), timeout=60)[0] == (
        [0.0, 0.0], ["model_server_0.ckpt"])
    assert launch(_model_helper_body, 1, args=(str(tmp_path), None), timeout=60)[0][0] == [3.0, 3.0]


def _broken_host_body(world, directory):
    from machinlike.server import grad_server_helper, model_server_helper

    if world.rank == 0:  # the host: its checkpoint is corrupt
        with open(os.path.join(directory, "model_server_0.ckpt"), "wb") as f:
            f.write(b"not a checkpoint")
        with open(os.path.join(directory, "grad_server_0.ckpt"), "wb") as f:
            f.write(b"not a checkpoint")
    group = world.create_rpc_group("g", ["0", "1"])
    group.barrier(timeout=30)  # (the files are there before either helper starts)
    said = []
    for helper in (lambda: model_server_helper(1, group, checkpoint_dir=directory, timeout=30),
                   lambda: grad_server_helper([Two], group, checkpoint_dir=directory, timeout=30)):
        start = time.monotonic()
        try:
            helper()
            said.append(("built", 0.0))
        except Exception as err:  # (the host: CheckpointError; the other: told at the barrier)
            said.append((f"{type(err).__name__}: {err}", time.monotonic() - start))
    return said


def test_a_helper_whose_host_fails_tells_the_other_members_at_once_and_why(tmp_path):
    """The other members waited out the helper's timeout at its barrier, told only that
    the host "did not arrive" (cold trial 17); they are told at once, with the host's error."""
    host, other = launch(_broken_host_body, 2, args=(str(tmp_path),), timeout=90)
    for (mine, _), (theirs, waited) in zip(host, other):
        assert mine.startswith("CheckpointError:"), mine
        assert theirs.startswith("RuntimeError: barrier of RpcGroup 'g': members: '0' failed instead of arriving: "
                                 "CheckpointError:"), theirs
        assert waited < 10, waited
