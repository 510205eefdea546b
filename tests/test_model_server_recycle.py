"""A model server's host, and a gradient server's primary, reuse the shared memory of
superseded states (server/_state_pool) under a seqlock (_shm/_recycled): what nothing holds
is rewritten, what a reply, the chain or anyone here holds is not, and a same-host puller
whose state was rewritten while it read it loads the newest state again instead of keeping
a mix under an old version."""

from __future__ import annotations

import pytest
import torch

from machinlike import _shm
from machinlike.server import _state_pool
from machinlike.server._state_pool import KEEP, StatePool, unchanged
from machinlike.testing import run_world

MB = 1 << 20
needs_recycling = pytest.mark.skipif(not _shm.recycled.supported(), reason="recycling is off on this architecture")


def _state(value: float) -> dict:
    return {"w": torch.full((MB // 2,), value), "b": torch.full((4,), value)}  # 2 MB: adopted; 16 B: kept


@needs_recycling
def test_the_memory_of_a_state_nobody_holds_is_reused_and_a_held_one_never():
    pool = StatePool()
    try:
        states = [pool("m", _state(float(i))) for i in range(KEEP)]  # KEEP storages made first
        addresses = [s["w"].untyped_storage().data_ptr() for s in states]
        assert len(set(addresses)) == KEEP and len(pool._slots[("m", "w", MB * 2)]) == KEEP
        del states[1]  # nobody holds the second any more: its memory is rewritten next
        again = pool("m", _state(7.0))
        assert again["w"].untyped_storage().data_ptr() == addresses[1]
        assert float(again["w"].min()) == float(again["w"].max()) == 7.0
        assert [float(s["w"][0]) for s in states] == [0.0, 2.0, 3.0]  # the held ones untouched
        beyond = pool("m", _state(8.0))  # all KEEP held: fresh memory, not kept
        assert beyond["w"].untyped_storage().data_ptr() not in addresses
        assert len(pool._slots[("m", "w", MB * 2)]) == KEEP and float(beyond["w"][-1]) == 8.0
        assert _shm.recycled.sequence(beyond["w"].untyped_storage()) is None
        assert _shm.recycled.sequence(again["w"].untyped_storage()) == 4  # written twice
    finally:
        pool.close()


@needs_recycling
def test_a_pool_keeps_at_most_its_share_of_open_files(monkeypatch):
    # Each kept storage holds an open file: a model of many large tensors must not take the
    # process's allowance (torch's agent aborts the process without descriptors).
    monkeypatch.setattr(_state_pool.resource, "getrlimit", lambda which: (1024, 1024))
    assert _state_pool.kept_most() == 128
    unlimited = _state_pool.resource.RLIM_INFINITY
    monkeypatch.setattr(_state_pool.resource, "getrlimit", lambda which: (unlimited, unlimited))
    assert _state_pool.kept_most() == _state_pool._KEPT_MOST
    pool = StatePool(most=KEEP + 1)
    try:
        states = [pool("m", {"w": torch.full((MB // 2,), float(i)), "v": torch.full((MB // 2,), -float(i))})
                  for i in range(3)]
        assert pool._kept == KEEP + 1 == sum(len(kept) for kept in pool._slots.values())
        last = states[2]["v"]  # past the bound: fresh shared memory, not kept
        assert _shm.recycled.sequence(last.untyped_storage()) is None and float(last[0]) == -2.0
        published = pool.snapshot("g", {"p": torch.ones(MB // 2)})  # a grad server's version: private memory
        assert not published["p"].untyped_storage().is_shared() and float(published["p"].sum()) == MB // 2
        assert pool._kept == KEEP + 1
    finally:
        pool.close()
    assert pool._kept == 0
    # And at most its share of /dev/shm's bytes: here room for three 2 MB storages.
    pool = StatePool(most_bytes=3 * (MB * 2 + _shm.recycled.HEADER))
    try:
        states = [pool("m", {"w": torch.full((MB // 2,), float(i))}) for i in range(4)]
        assert pool._kept == 3 and _shm.recycled.sequence(states[3]["w"].untyped_storage()) is None
    finally:
        pool.close()


@needs_recycling
def test_a_pool_works_under_torchs_file_system_sharing_strategy():
    # Its memory is made by descriptor whatever the strategy (a by-name one cannot be sent by reference).
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    pool = StatePool()
    try:
        published = pool.snapshot("g", {"p": torch.ones(MB // 2)})
        pushed = pool("m", {"w": torch.full((MB // 2,), 2.0)})
        assert _shm.recycled.sequence(published["p"].untyped_storage()) == 2 and float(published["p"][0]) == 1.0
        assert _shm.is_shared_by_reference(pushed["w"]) and float(pushed["w"][-1]) == 2.0
    finally:
        pool.close()
        tmp.set_sharing_strategy(before)


def test_without_recycling_each_state_gets_fresh_memory(monkeypatch):
    monkeypatch.setattr(_shm.recycled, "supported", lambda: False)
    pool = StatePool()
    first = pool("m", _state(1.0))
    assert _shm.is_shared_by_reference(first["w"]) and not torch.equal(first["w"], first["b"])
    del first
    second = pool("m", _state(2.0))
    assert not pool._slots and float(second["w"].max()) == 2.0
    assert _shm.recycled.sequence(second["w"].untyped_storage()) is None


@needs_recycling
def test_a_received_view_knows_when_its_memory_was_rewritten():
    storage = _shm.recycled.make(64)
    try:
        assert _shm.recycled.sequence(storage) == 0
        view = torch.empty(0).set_(storage, _shm.recycled.HEADER // 4, (16,))
        reader = _shm.recycled.note(torch.empty(0).set_(storage, _shm.recycled.HEADER // 4, (16,)), 0)
        assert unchanged({"w": reader, "n": 3}) and _shm.recycled.unchanged(view)  # (not received: always)
        with _shm.recycled.rewrite(storage):
            assert not _shm.recycled.unchanged(reader)  # odd while written
            view.fill_(5.0)
        assert _shm.recycled.sequence(storage) == 2 and not unchanged({"w": reader})
    finally:
        _shm.recycled.forget(storage)
    assert _shm.recycled.sequence(storage) is None


def _model(value: float) -> torch.nn.Module:
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Linear(1024, 4))  # a 4 MB weight
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(value)
    return model


def _values(model: torch.nn.Module) -> set:
    return {float(v) for p in model.parameters() for v in (p.min(), p.max())}


class _Overtaken(torch.nn.Module):
    """A puller whose first load is overtaken: four newer versions are pushed (each rewriting
    memory on the host) after the state arrived and before it is read."""

    def __init__(self, server, pusher) -> None:
        super().__init__()
        self.net = _model(0.0)
        self.loads = 0
        self._peers = (server, pusher)  # (a tuple: not a submodule)

    def load_state_dict(self, state, *args, **kwargs):  # type: ignore[override]
        self.loads += 1
        server, pusher = self._peers
        if self.loads == 1:
            for _ in range(4):
                with torch.no_grad():
                    for p in pusher.parameters():
                        p.fill_(float(pusher.pp_version + 1))
                assert server.push(pusher)
        return super().load_state_dict(state, *args, **kwargs)


def _hosted(world):
    """The world's group, and the model server rank 0 hosts (None elsewhere), met at a barrier."""
    from machinlike.server import PushPullModelServerImpl

    g = world.create_rpc_group("g", world.get_members())
    impl = PushPullModelServerImpl("server", g) if world.rank == 0 else None
    g.barrier()
    return g, impl


def _holder(value: float) -> torch.nn.Module:
    """A module whose ``net`` is ``_model(value)`` (its version, a plain attribute, beside it)."""
    holder = torch.nn.Module()
    holder.net = _model(value)
    return holder


def _overtaken_body(world):
    g, impl = _hosted(world)
    out = None
    if world.rank == 1:
        server = g.get_paired("server").to_here()
        pusher = _holder(0.0)
        for _ in range(3):
            with torch.no_grad():
                for p in pusher.parameters():
                    p.fill_(float(getattr(pusher, "pp_version", 0) + 1))
            assert server.push(pusher)
        reader = _Overtaken(server, pusher)
        assert server.pull(reader)
        out = (reader.loads, reader.pp_version, _values(reader.net), pusher.pp_version)
        for _ in range(40):  # many more pushes: the host's memory stays bounded
            assert server.push(pusher)
    g.barrier()
    if impl is not None:
        out = max(len(storages) for storages in impl._pool._slots.values())
    g.barrier()
    return out


def _plain_pull_body(world):
    from machinlike.server import OrderedServerSimple

    g, impl = _hosted(world)
    out = None
    if world.rank == 1:
        server = g.get_paired("server").to_here()
        assert server.push(_holder(3.0))
        chain = OrderedServerSimple("server/ordered", g)
        state, version = chain.pull("model")
        state["net.0.weight"].fill_(-1.0)  # the caller's copy: nothing reaches the server
        again, _ = chain.pull_if_changed("model", None)
        reader = _holder(0.0)
        assert server.pull(reader)
        out = (float(again["net.0.weight"].min()), _values(reader.net), version == reader.pp_version)
    g.barrier()
    if impl is not None:
        impl.close()
    g.barrier()
    return out


@needs_recycling
def test_a_plain_pull_of_a_model_servers_chain_is_the_callers_copy():
    _, (seen, loaded, same) = run_world(_plain_pull_body, 2, timeout=90)
    assert seen == 3.0 and loaded == {3.0} and same


@needs_recycling
def test_a_pull_overtaken_by_rewrites_loads_the_newest_state_whole():
    kept, (loads, version, values, newest) = run_world(_overtaken_body, 2, timeout=90)
    assert newest == 7
    # Its state's memory was rewritten while it waited: it loaded again, the newest, whole.
    assert (loads, version, values) == (2, 7, {7.0})
    assert kept <= KEEP


def _race_body(world, seconds):
    import time

    g, _ = _hosted(world)
    out = None
    if world.rank > 0:
        server = g.get_paired("server").to_here()
        model = _holder(0.0)
        end = time.monotonic() + seconds
        if world.rank == 1:  # the learner: version v holds the value v everywhere
            pushes = 0
            while time.monotonic() < end:
                with torch.no_grad():
                    for p in model.parameters():
                        p.fill_(float(getattr(model, "pp_version", 0) + 1))
                pushes += server.push(model)
            out = pushes
        else:  # an actor: every state it loads is one version, whole
            torn, pulls = [], 0
            while time.monotonic() < end:
                if server.pull(model):
                    pulls += 1
                    if _values(model.net) != {float(model.pp_version)}:
                        torn.append((model.pp_version, sorted(_values(model.net))))
            out = (pulls, torn)
    g.barrier()
    return out


def test_an_actor_pulling_while_a_learner_pushes_only_ever_loads_whole_versions():
    _, pushes, (pulls, torn) = run_world(_race_body, 3, args=(1.0,), timeout=90)
    assert pushes > 20 and pulls > 5
    assert torn == [], (pushes, pulls, torn[:3], len(torn))


def _grad_race_body(world, seconds):
    import time

    from machinlike.server import PushPullGradServerImpl

    g = world.create_rpc_group("g", world.get_members())
    impl = None
    if world.rank == 0:  # batches of one push, summed: SGD(lr=1) on a gradient of -1 adds 1 a version
        impl = PushPullGradServerImpl("grad", g, primary_reducer="0", secondary_reducers=["0"], reduce_method="sum",
                                      reduce_batch_size=1, max_queue_size=1024)
        managed = _model(0.0)
        impl.manage_model(managed, torch.optim.SGD(managed.parameters(), lr=1.0))
        impl.start()
    g.barrier()
    out = None
    if world.rank > 0:
        server = g.get_paired("grad").to_here()
        model = _model(0.0)
        end = time.monotonic() + seconds
        if world.rank == 1:  # the trainer
            for p in model.parameters():
                p.grad = torch.full_like(p, -1.0)
            pushes = 0
            while time.monotonic() < end:
                pushes += server.push(model, pull=False)
            out = (pushes, server.flush())
        else:  # an actor: every state it loads is one version, whole
            torn, pulls = [], 0
            while time.monotonic() < end:
                if server.pull(model):
                    pulls += 1
                    if _values(model) != {float(model.pp_grad_version)}:
                        torn.append((model.pp_grad_version, sorted(_values(model))))
            out = (pulls, torn)
    g.barrier()
    if impl is not None:
        newest = impl.o_server_impl._data["model"][-1][1]  # (the hosted chain: version, state)
        out = (max(len(storages) for storages in impl._pool._slots.values()),
               _shm.recycled.sequence(newest["0.weight"].untyped_storage()))
        impl.close()
    g.barrier()
    return out


@needs_recycling
def test_a_grad_servers_versions_reuse_memory_and_its_pullers_load_them_whole():
    (kept, sequence), (pushes, version), (pulls, torn) = run_world(_grad_race_body, 3, args=(1.0,), timeout=90)
    assert pushes > 20 and pulls > 5 and version == pushes  # a step a push, none lost
    assert torn == [], (pushes, pulls, torn[:3], len(torn))
    # Published into the pool's memory (a seqlock header: rewritten in turn), KEEP storages at most.
    assert kept <= KEEP and sequence is not None and sequence % 2 == 0
