"""Bodies of the gradient-server churn runs, shared by tests/test_server_churn.py and
benchmarks/churn.py.

Exactness run: ``p`` (primary reducer, essential), ``s1``/``s2`` (secondary reducers),
``c1``/``c2`` (clients). Every push claims a fresh *slot* (a store counter) and pushes a
one-hot gradient there; with SGD(lr=1) the final ``-w[slot]`` is how many times that push
was applied. Each client appends ``<status> <slot>`` lines to its own file with plain
``os.write`` (kept by the kernel across a SIGKILL): ``P`` before the push, then ``A``
(acknowledged), ``R`` (refused: queue full) or ``E`` (told it failed: PeerLostError).
"""

from __future__ import annotations

import os
import time
from typing import Any, Dict

import torch
from torch import nn

from machinlike.exception import PeerLostError
from machinlike.server import PushPullGradServer, PushPullGradServerImpl, ServerStoppedError

SLOTS = 16000
TIMEOUT = 30.0


class Slots(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.zeros(SLOTS))


def _key(world: Any, name: str) -> str:
    return world.membership.keys.scratch(f"churn-test/{name}")


def _wait_key(world: Any, name: str) -> None:
    world.membership.registry.wait_all(_key(world, ""), [name], TIMEOUT, f"key {name!r}")


def churn_body(world: Any, run_seconds: float, log_dir: str) -> Dict[str, Any]:
    """One member of the exactness run; the primary returns the final weights and its stats."""
    registry = world.membership.registry
    group = world.create_rpc_group("g")  # open: restarted members rejoin at once
    me = world.name
    if me == "p":
        impl = PushPullGradServerImpl("grad", group, primary_reducer="p", reduce_batch_size=4, max_queue_size=64)
        model = Slots()
        impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=1.0))
        impl.start()
        registry.set(_key(world, "deadline"), str(time.time() + run_seconds))
        registry.set(_key(world, "ready"), "1")
        registry.wait_all(_key(world, "done/"), ["c1", "c2"], TIMEOUT + run_seconds, "clients")
        accessor = group.get_paired("grad", timeout=TIMEOUT).to_here()
        accessor.flush(timeout=TIMEOUT)  # returns once every skipped (dead) secondary is declared gone
        impl.stats()  # closes the dead sources: nothing of theirs is received from now on
        accessor.flush(timeout=TIMEOUT)  # applies what they delivered before that
        weights = model.w.detach().clone()
        stats = impl.stats()
        registry.set(_key(world, "end"), "1")
        impl.close()
        return {"w": weights, "stats": stats}
    _wait_key(world, "ready")
    if registry.get_or_empty(_key(world, "end")):
        return world.incarnation  # restarted after the run ended: the primary is gone
    try:  # "ready" may come before this view has seen p join
        world.wait_for_members(["p"], TIMEOUT)
    except (TimeoutError, PeerLostError):  # (PeerLostError at once: p left cleanly)
        if registry.get_or_empty(_key(world, "end")):
            return world.incarnation  # restarted after the run ended: the primary is gone
        raise
    if me.startswith("s"):
        try:
            impl = PushPullGradServerImpl("grad", group, primary_reducer="p", reduce_batch_size=4,
                                          max_queue_size=64)
        except (ValueError, PeerLostError):
            if registry.get_or_empty(_key(world, "end")):
                return world.incarnation  # restarted after the run ended: the primary is gone
            raise
        impl.start()
        _wait_key(world, "end")
        impl.close()
        return world.incarnation
    deadline = float(registry.get_or_empty(_key(world, "deadline")))
    accessor = group.get_paired("grad", timeout=TIMEOUT).to_here()
    model = Slots()
    fd = os.open(os.path.join(log_dir, f"{me}.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    pushes = 0
    try:
        while time.time() < deadline:
            slot = registry.add(_key(world, "slot"), 1) - 1
            if slot >= SLOTS:
                break
            grad = torch.zeros(SLOTS)
            grad[slot] = 1.0
            model.w.grad = grad
            os.write(fd, f"P {slot}\n".encode())
            pull = pushes % 8 == 7  # mostly the fast path, sometimes machin's push-then-pull
            try:
                queued = accessor.push(model, pull=pull)
                status = "A" if pull or queued else "R"
            except PeerLostError:
                status = "E"
            os.write(fd, f"{status} {slot}\n".encode())
            pushes += 1
    finally:
        os.close(fd)
    registry.set(_key(world, f"done/{me}"), "1")
    return pushes


def _started_primary(world: Any, group: Any) -> Any:
    """``p``'s server (batches of 4) over a fresh Slots model, started; "ready" is set."""
    impl = PushPullGradServerImpl("grad", group, primary_reducer="p", reduce_batch_size=4)
    model = Slots()
    impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=1.0))
    impl.start()
    world.membership.registry.set(_key(world, "ready"), "1")
    return impl, model


def _started_secondary(world: Any, group: Any) -> Any:
    """``s1``'s reducer for ``p``'s server, started; "s1" is set."""
    impl = PushPullGradServerImpl("grad", group, primary_reducer="p", reduce_batch_size=4)
    impl.start()
    world.membership.registry.set(_key(world, "s1"), "1")
    return impl


def dead_before_flush_body(world: Any) -> Any:
    """``s1`` acknowledges 3 pushes of ``c1`` (fewer than a batch: they stay queued), then
    dies by SIGKILL; ``p`` flushes as soon as the process is gone, before the world has
    declared it lost, and reads its stats at once. Returns p's flush time and stats."""
    import select
    import signal

    registry = world.membership.registry
    group = world.create_rpc_group("g")
    me = world.name
    if me == "s1" and world.incarnation > 1:
        return None  # the restart after the kill: nothing left to do
    world.wait_for_members(["p", "s1", "c1"], TIMEOUT)  # open group: its members are the live ones seen
    if me == "p":
        impl, model = _started_primary(world, group)
        _wait_key(world, "pid")
        pid = int(registry.get_or_empty(_key(world, "pid")))
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            fd = None  # already gone
        if fd is not None:  # wait for the process to end, without polling
            assert select.select([fd], [], [], TIMEOUT)[0], "s1 did not die"
            os.close(fd)
        accessor = group.get_paired("grad", timeout=TIMEOUT).to_here()
        start = time.monotonic()
        accessor.flush(timeout=TIMEOUT)
        took = time.monotonic() - start
        stats = impl.stats()
        weights = model.w.detach().clone()
        impl.close()
        return {"took": took, "stats": stats, "applied": int((-weights).sum())}
    _wait_key(world, "ready")
    if me == "s1":
        impl = _started_secondary(world, group)
        _wait_key(world, "pushed")
        registry.set(_key(world, "pid"), str(os.getpid()))
        os.kill(os.getpid(), signal.SIGKILL)
    _wait_key(world, "s1")
    accessor = PushPullGradServer("grad", group, secondary_reducers=["s1"], timeout=TIMEOUT)
    model = Slots()
    acked = 0
    for slot in range(3):
        grad = torch.zeros(SLOTS)
        grad[slot] = 1.0
        model.w.grad = grad
        acked += bool(accessor.push(model, pull=False))
    registry.set(_key(world, "pushed"), "1")
    return acked


def renewed_secondary_body(world: Any) -> Any:
    """``c1`` pushes 3 one-hot gradients through ``s1`` (fewer than a batch: they stay
    queued), then ``s1`` renews its RPC agent (its listener closed: a new worker name, the
    same incarnation) and ``c1`` pushes 3 more. Returns p's applied slots and stats."""
    import socket

    registry = world.membership.registry
    group = world.create_rpc_group("g")
    me = world.name
    world.wait_for_members(["p", "s1", "c1"], TIMEOUT)
    if me == "p":
        impl, model = _started_primary(world, group)
        _wait_key(world, "moved")
        moved = registry.get_or_empty(_key(world, "moved"))
        # This view too has seen the move before the next pushes: s1's old worker is gone here.
        world.membership.wait_until(lambda live: world.membership.roster.worker_of("s1") == moved, TIMEOUT)
        registry.set(_key(world, "renewed"), "1")
        _wait_key(world, "pushed")
        accessor = group.get_paired("grad", timeout=TIMEOUT).to_here()
        accessor.flush(timeout=TIMEOUT)
        stats = impl.stats()
        applied = (-model.w.detach()).round().long()
        registry.set(_key(world, "end"), "1")
        impl.close()
        return {"applied": applied.nonzero().flatten().tolist(), "stats": stats}
    _wait_key(world, "ready")
    if me == "s1":
        impl = _started_secondary(world, group)
        _wait_key(world, "half")
        old = world.membership.worker
        address = world.membership.rpc_address()
        assert address, (old, world.membership.endpoint.renewals, world.membership.endpoint.recycles)
        host, _, port = address[len("uv://"):].rpartition(":")
        socket.create_connection((host, int(port)), timeout=5).close()  # TensorPipe closes the listener
        world.membership.wait_until(lambda live: world.membership.worker != old, TIMEOUT)
        registry.set(_key(world, "moved"), world.membership.worker)
        _wait_key(world, "end")
        impl.close()
        return old != world.membership.worker
    _wait_key(world, "s1")
    accessor = PushPullGradServer("grad", group, secondary_reducers=["s1"], timeout=TIMEOUT)
    model = Slots()
    acked = 0
    for slot in range(6):
        if slot == 3:
            registry.set(_key(world, "half"), "1")
            _wait_key(world, "renewed")
        grad = torch.zeros(SLOTS)
        grad[slot] = 1.0
        model.w.grad = grad
        acked += bool(accessor.push(model, pull=False))
    registry.set(_key(world, "pushed"), "1")
    _wait_key(world, "end")
    return acked


def stopped_primary_body(world: Any) -> Any:
    """``p`` stops its server (its member closing it, as at the end of a run) while ``s1``
    still takes pushes: ``s1``'s secondary counts what it can no longer forward and goes
    on (the primary may come back). Returns s1's secondary stats, whether its reducer
    failed, and the warnings it logged."""
    import logging

    registry = world.membership.registry
    group = world.create_rpc_group("g")
    world.wait_for_members(["p", "s1"], TIMEOUT)
    if world.name == "p":
        impl, _ = _started_primary(world, group)
        _wait_key(world, "pushed")
        impl.stop()
        registry.set(_key(world, "stopped"), "1")
        _wait_key(world, "done")
        impl.close()
        return None
    _wait_key(world, "ready")
    warnings: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warnings.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("machinlike.server").addHandler(handler)
    impl = _started_secondary(world, group)
    accessor = PushPullGradServer("grad", group, secondary_reducers=["s1"], timeout=TIMEOUT)
    model = Slots()
    model.w.grad = torch.ones(SLOTS)
    for _ in range(4):
        assert accessor.push(model, pull=False)
    accessor.flush(timeout=TIMEOUT)
    registry.set(_key(world, "pushed"), "1")
    _wait_key(world, "stopped")
    for _ in range(8):  # two batches, each forward refused: the primary is stopped
        assert accessor.push(model, pull=False)
    try:  # (the secondary's part, then the primary's: which refuses, and the caller is told)
        accessor.flush(timeout=TIMEOUT)
        refused = None
    except ServerStoppedError as err:
        refused = str(err)
    stats = impl.stats()["secondary"]
    failed = None
    try:
        impl.watch()
    except Exception as err:  # noqa: BLE001 (what the test reports)
        failed = repr(err)
    registry.set(_key(world, "done"), "1")
    impl.close()
    return {"stats": stats, "failed": failed, "refused": refused,
            "warnings": [w for w in warnings if "could not forward" in w]}
