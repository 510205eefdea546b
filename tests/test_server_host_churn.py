"""The ordered and model servers' host under churn: a SIGKILLed host is named to its
clients at once, a restarted one resumes from its checkpoint under versions never used
before, clients go on with the accessors they hold, and the host counts who it serves."""

from __future__ import annotations

import os
import select
import signal
import threading
import time

import pytest
import torch
from torch import nn

from machinlike import launch
from machinlike.exception import PeerLostError
from machinlike.server import (CheckpointError, OrderedServerSimple, OrderedServerSimpleImpl,
                               PushPullModelServerImpl)
from machinlike.server._checkpoint import Checkpointer
from machinlike.server._host import LEASE_BLOCK
from machinlike.testing import world_test

TIMEOUT = 30.0


class Lin(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(3))

    def set(self, value: float) -> "Lin":
        with torch.no_grad():
            self.w.fill_(value)
        return self


def _key(world, name):
    return world.membership.keys.scratch(f"host-churn/{name}")


def _wait(world, name):
    world.membership.registry.wait_all(_key(world, ""), [name], TIMEOUT, f"key {name!r}")


def _kill_and_wait(pid):
    """SIGKILL ``pid`` and return once the process is gone (a pidfd, no polling)."""
    fd = os.pidfd_open(pid)
    try:
        os.kill(pid, signal.SIGKILL)
        killed = time.monotonic()
        assert select.select([fd], [], [], TIMEOUT)[0], f"process {pid} did not die"
    finally:
        os.close(fd)
    return killed


def _host_body(world, directory):
    registry = world.membership.registry
    group = world.create_rpc_group("g")
    if world.name == "h":
        if world.incarnation > 1:  # come back only once the client saw the host gone
            _wait(world, "restart")
        kv = OrderedServerSimpleImpl("kv", group, version_depth=2, checkpoint_dir=directory, checkpoint_every=3)
        ms = PushPullModelServerImpl("ms", group, checkpoint_dir=directory, checkpoint_every=2)
        registry.set(_key(world, "pid"), str(os.getpid()))
        registry.set(_key(world, f"ready{world.incarnation}"), "1")
        _wait(world, "end")  # the first incarnation is SIGKILLed while it waits here
        return {"kv": kv.stats(), "ms": ms.stats()}
    _wait(world, "ready1")
    world.wait_for_members(["h"], timeout=TIMEOUT)
    kv = group.get_paired("kv", timeout=TIMEOUT).to_here()
    ms = group.get_paired("ms", timeout=TIMEOUT).to_here()
    # kv: creating "b" and "a" writes checkpoints; then every 3rd version: a3 is the last saved.
    assert kv.push("b", "b7", 7, None)
    for v in range(5):
        assert kv.push("a", f"a{v}", v, v - 1)
    # ms: the spec and version 1 create keys (saved), then every 2nd version: 3 is the last saved.
    model = Lin()
    for v in range(1, 5):
        assert ms.push(model.set(float(v)))
    assert model.pp_version == 4
    killed = _kill_and_wait(int(registry.get_or_empty(_key(world, "pid"))))
    with pytest.raises(PeerLostError, match="'h'"):
        ms.pull(model)  # the call fails at once, naming the host
    named_in = time.monotonic() - killed
    world.membership.wait_until(lambda live: world.get_incarnation("h") != 1, TIMEOUT)
    with pytest.raises(PeerLostError, match="'h'.*host of ordered server 'kv'"):
        kv.pull("a")  # once declared lost its services are gone: still named, not "not found"
    registry.set(_key(world, "restart"), "1")
    _wait(world, "ready2")
    world.membership.wait_until(lambda live: world.get_incarnation("h") == 2, TIMEOUT)
    out = {"named_in": named_in}
    # The same accessors go on. a4 died unsaved: its number never comes back with other contents.
    out["a"] = kv.pull("a")
    out["a_history"] = [kv.pull("a", v) for v in (2, 3, 4)]
    out["a_holder"] = kv.pull_if_changed("a", 4)  # a client still holding the lost a4 is told it changed
    out["b"] = kv.pull_if_changed("b", 7)
    fresh = out["a"][1]
    out["a_next"] = kv.push("a", "a5", fresh + 1, fresh), kv.pull("a")
    with pytest.raises(TypeError, match="versions must be ints"):
        kv.push("c", "x", "v1", None)
    out["rejected"] = ms.push(model.set(9.0))  # on top of the lost version 4: rejected, pulls the resumed state
    out["model"] = (model.w.detach().clone(), model.pp_version)
    out["pushed"] = ms.push(model.set(6.0)), model.pp_version
    registry.set(_key(world, "end"), "1")
    return out


@pytest.mark.timeout(90)
def test_a_killed_host_is_named_and_resumes_above_every_version(tmp_path):
    result = launch(_host_body, 2, args=(str(tmp_path),), names=["c", "h"], max_restarts=1, essential=["c"],
                    timeout=75)
    out, host = result[0], result[1]
    assert [r.name for r in result.restarts] == ["h"]
    assert out["named_in"] < 2.0 + 1.0, out["named_in"]  # within the loss bound (2 s liveness), with slack
    fresh = 7 + LEASE_BLOCK + 1  # the lease covered version 7 first; a resume goes past it
    assert out["a"] == ("a3", fresh)
    assert out["a_history"] == [("a2", 2), ("a3", 3), None]  # version 4 is not retained, never reused
    assert out["a_holder"] == ("a3", fresh)
    assert out["b"] == ("b7", fresh)
    assert out["a_next"] == (True, ("a5", fresh + 1))
    assert out["rejected"] is False
    w, version = out["model"]
    assert torch.equal(w, torch.full((3,), 3.0)) and version == LEASE_BLOCK + 1 > 4
    assert out["pushed"] == (True, LEASE_BLOCK + 2)
    kv, ms = host["kv"], host["ms"]
    assert kv["resumed_version"] == fresh and kv["clients"] == ["c"] and kv["checkpoint_failures"] == 0
    assert ms["version"] == LEASE_BLOCK + 2 and ms["clients"] == ["c"]
    # (the checkpoint's numbers at the top too, as the servers tutorial says; cold trial 28)
    assert ms["resumed_version"] == LEASE_BLOCK + 1 and ms["checkpoint_failures"] == 0 and ms["checkpoints"] >= 1
    assert ms["ordered"]["resumed_version"] == LEASE_BLOCK + 1 and 0 <= ms["since_version"] < TIMEOUT


def _fresh_host_body(world):
    """A model server host without a checkpoint, SIGKILLed and restarted empty."""
    registry = world.membership.registry
    group = world.create_rpc_group("g")
    if world.name == "h":
        if world.incarnation > 1:
            _wait(world, "restart")
        ms = PushPullModelServerImpl("ms", group)
        registry.set(_key(world, "pid"), str(os.getpid()))
        registry.set(_key(world, f"ready{world.incarnation}"), "1")
        _wait(world, "end")
        return ms.stats()["version"]
    _wait(world, "ready1")
    ms = group.get_paired("ms", timeout=TIMEOUT).to_here()
    old = Lin()
    for v in range(1, 4):
        assert ms.push(old.set(float(v)))
    stale = Lin().set(3.0)
    object.__setattr__(stale, "pp_version", 3)  # (another holder of the old chain's version 3)
    _kill_and_wait(int(registry.get_or_empty(_key(world, "pid"))))
    world.membership.wait_until(lambda live: world.get_incarnation("h") != 1, TIMEOUT)
    registry.set(_key(world, "restart"), "1")
    _wait(world, "ready2")
    new = Lin()
    out = {"pushes": [(ms.push(new.set(100.0 + v)), new.pp_version) for v in range(1, 4)]}
    out["pull"] = ms.pull(old), old.pp_version, old.w[0].item()
    out["stale_push"] = ms.push(stale.set(3.5)), stale.pp_version, stale.w[0].item()
    registry.set(_key(world, "end"), "1")
    return out


@pytest.mark.timeout(90)
def test_a_host_restarted_without_a_checkpoint_never_reuses_a_version():
    """Cold trial 28: the new chain began at version 1 again, so a client holding version 3
    of the old one pulled "nothing new" from the new version 3 (stale weights), and its push
    on top of it was accepted over another client's work. The versions are leased in the
    world's store: the restarted host's chain starts above every version shown before."""
    result = launch(_fresh_host_body, 2, names=["c", "h"], max_restarts=1, essential=["c"], timeout=75)
    out = result[0]
    fresh = LEASE_BLOCK + 1  # the first host leased past version 0 (its spec key); the new chain starts above
    assert out["pushes"] == [(True, fresh), (True, fresh + 1), (True, fresh + 2)], out
    assert out["pull"] == (True, fresh + 2, 103.0), out  # loaded: the old chain's 3 is not the new one's
    assert out["stale_push"] == (False, fresh + 2, 103.0), out  # rejected, and pulled the newest
    assert result[1] == fresh + 2


def _visible_body(world):
    registry = world.membership.registry
    group = world.create_rpc_group("g")
    if world.name == "h":
        impl = OrderedServerSimpleImpl("kv", group)
        rejoined = threading.Event()
        # Callbacks run in order on one thread: once this one sees the rejoin, the host's has.
        world.on_member_change(lambda e: e.member == "c" and e.incarnation == 2 and rejoined.set())
        registry.set(_key(world, "ready"), "1")
        _wait(world, "done")
        assert rejoined.wait(TIMEOUT), "the host never saw c rejoin"
        return impl.stats()
    _wait(world, "ready")
    world.wait_for_members(["h"], timeout=TIMEOUT)
    kv = group.get_paired("kv", timeout=TIMEOUT).to_here()
    kv.push(f"x{world.incarnation}", world.incarnation, 0, None)
    if world.incarnation == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    kept = kv.pull("x1")  # before "done": once it reads that, the host may close the server
    registry.set(_key(world, "done"), "1")
    return kept


@pytest.mark.timeout(60)
def test_the_host_reports_clients_losses_and_rejoins():
    result = launch(_visible_body, 2, names=["h", "c"], max_restarts=1, essential=["h"], timeout=45)
    stats = result[0]
    assert result[1] == (1, 0)  # what the dead incarnation pushed is still there
    assert stats["clients"] == ["c"] and stats["keys"] == 2
    assert stats["members"] == {"losses": 1, "rejoins": 1}, stats
    assert 0 <= stats["since_version"] < TIMEOUT


@world_test(1, timeout=60)
def test_checkpoint_files_are_checked_and_a_closed_host_resumes(world, tmp_path):
    group = world.create_rpc_group("g", [world.name])
    Checkpointer(tmp_path, "grad-server", "kv").save({"version": 1})
    with pytest.raises(CheckpointError, match=f"{os.path.join(str(tmp_path), 'kv.ckpt')!r} belongs to kind "
                                              f"'grad-server', not 'ordered-server'"):
        OrderedServerSimpleImpl("kv", group, checkpoint_dir=tmp_path)
    with pytest.raises(ValueError, match="checkpoint_every=0 must be a positive int"):
        OrderedServerSimpleImpl("kv2", group, checkpoint_dir=tmp_path, checkpoint_every=0)
    with pytest.raises(ValueError, match="needs the ordered server hosted here"):
        PushPullModelServerImpl("ms", group, o_server=OrderedServerSimple("elsewhere", group), checkpoint_dir=tmp_path)
    impl = OrderedServerSimpleImpl("kv3", group, checkpoint_dir=tmp_path, checkpoint_every=1000)
    kv = group.get_paired("kv3").to_here()
    assert kv.push("k", 0, 0, None) and kv.push("k", 1, 1, 0)
    with pytest.raises(TypeError, match="versions must be ints"):
        impl.store("k", 2, True, 1)
    assert impl.stats()["checkpoints"] == 1  # the key's creation; version 1 is not due yet
    impl.close()  # writes what it holds
    again = OrderedServerSimpleImpl("kv3", group, checkpoint_dir=tmp_path, checkpoint_every=1000)
    assert again.stats()["resumed_version"] == LEASE_BLOCK + 1
    assert kv.pull("k") == (1, LEASE_BLOCK + 1) and kv.pull("k", 1) == (1, 1)
    again.close()
    by_time = OrderedServerSimpleImpl("kv4", group, checkpoint_dir=tmp_path, checkpoint_every=1000,
                                      checkpoint_interval=1e-6)
    for v in range(3):
        assert by_time.store("t", v, v, v - 1)
    assert by_time.stats()["checkpoints"] == 3  # the key's creation, then each version (time is up)
    by_time.close()
    os.remove(os.path.join(tmp_path, "kv3.lease"))
    with pytest.raises(CheckpointError, match="has no lease file"):
        OrderedServerSimpleImpl("kv3", group, checkpoint_dir=tmp_path)
    group.destroy()


def _host_leaves_body(world):
    group = world.create_rpc_group("g", ["0", "1"])
    if world.name == "0":
        impl = PushPullModelServerImpl("ms", group)
        group.barrier(timeout=TIMEOUT)
        group.barrier(timeout=TIMEOUT)  # (the client pushed)
        impl.close()  # what a helper's close() does before its member leaves
        return None
    group.barrier(timeout=TIMEOUT)
    server = group.get_paired("ms").to_here()
    assert server.push(Lin().set(1.0))
    group.barrier(timeout=TIMEOUT)
    world.wait_for_members(["0"], timeout=TIMEOUT, gone=True)
    try:
        server.push(Lin().set(2.0))
    except KeyError as err:
        return str(err)
    return "pushed"


def test_a_model_server_whose_host_closed_it_and_left_says_so_not_how_to_make_one():
    """The client was told to 'create OrderedServerSimpleImpl(...) on the member that is to
    host it first' (cold trial 17): the host had made it, closed it and left."""
    said = launch(_host_leaves_body, 2, max_restarts=1, timeout=60)[1]  # (elastic: a member that returns leaves)
    assert "its owner, member '0', left the world" in said and "create OrderedServerSimpleImpl" not in said, said
    assert "no member hosts ordered server 'ms/ordered' now; calls fail until a member hosts it again" in said, said
