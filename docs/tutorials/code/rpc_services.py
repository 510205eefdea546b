"""RPC groups: services and values, async services, timeouts and failures.

Run it:  python docs/tutorials/code/rpc_services.py
"""

from __future__ import annotations

import os
import threading

import torch
from torch.distributed import rpc

import machinlike
from machinlike.exception import PeerLostError, ProcessExitedError, RemoteTraceback


# [counter]
class Counter:
    """A value paired into the group: it lives on its owner, others reach it by a handle."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # RPC runs each call on one of the owner's threads
        self.count = 0

    def add(self, amount: int) -> int:
        with self._lock:
            self.count += amount
            return self.count

    def value(self) -> int:
        return self.count
# [/counter]


# [batcher]
class Batcher:
    """An asynchronous service: it answers every caller once ``size`` calls have arrived.

    The service returns a ``torch.futures.Future`` at once, so a caller that waits for
    the others holds no RPC thread; the last caller's request completes every future.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._lock = threading.Lock()
        self._waiting: list = []  # (value, future) of the callers so far

    @rpc.functions.async_execution
    def total(self, value: float) -> torch.futures.Future:
        future: torch.futures.Future = torch.futures.Future()
        with self._lock:
            self._waiting.append((value, future))
            if len(self._waiting) < self.size:
                return future
            batch, self._waiting = self._waiting, []
        result = sum(v for v, _ in batch)
        for _, waiting in batch:
            waiting.set_result(result)
        return future
# [/batcher]


# [relay]
def relayed(world: machinlike.World) -> list:
    """Calls in a cycle: member 0's "hop" calls member 1's, which calls member 0's, ...

    A plain service holds one of its owner's RPC threads while it waits for the next hop:
    with more such calls at once than ``rpc_threads`` (16), every thread of both members
    waits for a thread that never frees, and the calls end at their timeout. This one
    returns a future at once and completes it when the next hop answers: it holds none.
    """
    group = world.create_rpc_group("relay", ["0", "1"])
    other = "1" if world.name == "0" else "0"

    @rpc.functions.async_execution
    def hop(depth: int) -> torch.futures.Future:
        if depth == 0:
            answer: torch.futures.Future = torch.futures.Future()
            answer.set_result(world.name)
            return answer
        # then() runs once the next hop answered (wait() returns at once); an error the
        # next hop raised reaches this hop's caller with its own type
        return group.registered_async(f"hop{other}", args=(depth - 1,)).then(
            lambda nested: world.name + nested.wait())

    group.register(f"hop{world.name}", hop)
    group.barrier()
    paths = []
    if world.name == "0":  # 64 cycles at once: four times the threads either member has
        calls = [group.registered_async("hop1", args=(4,), timeout=20) for _ in range(64)]
        paths = [call.wait() for call in calls]
    group.barrier()
    group.destroy()
    return paths
# [/relay]


# [coroutine]
def relayed_by_coroutines(world: machinlike.World) -> list:
    """The same cycle with ``async def`` services: each hop awaits the next one on its
    member's event loop thread, holding no RPC thread, and reads as a plain function."""
    group = world.create_rpc_group("corelay", ["0", "1"])
    other = "1" if world.name == "0" else "0"

    async def hop(depth: int) -> str:
        if depth == 0:
            return world.name
        return world.name + await group.registered_async(f"hop{other}", args=(depth - 1,))

    group.register(f"hop{world.name}", hop)
    group.barrier()
    paths = []
    if world.name == "0":  # 64 cycles at once, as above
        calls = [group.registered_async("hop1", args=(4,), timeout=20) for _ in range(64)]
        paths = [call.wait() for call in calls]
    group.barrier()
    group.destroy()
    return paths
# [/coroutine]


def check_positive(x: float) -> float:
    if x <= 0:
        raise ValueError(f"x must be positive, got {x}")
    return x


# [services]
def services(world: machinlike.World) -> dict:
    group = world.create_rpc_group("tour", world.get_members())
    me = world.name
    batcher = Batcher(size=group.size())
    release = threading.Event()  # lets member 1's slow service finish (see timeouts)
    if me == "0":
        group.pair("counter", Counter())
        group.register("total", batcher.total)  # decorated: an asynchronous service
    if me == "1":
        group.register("check", check_positive)
        group.register("slow", lambda: release.wait(30))
        group.register("release", release.set)
    group.barrier()  # registrations and pairings are group-wide from here on

    assert group.is_registered("check") and group.is_paired("counter")
    assert not group.is_registered("nothing")

    # A paired value: get_paired() returns a handle to member 0's value (it behaves as
    # torch's RRef). counter.rpc_sync() runs a method of the value on its owner.
    counter = group.get_paired("counter")
    counter.rpc_sync().add(world.rank + 1)

    # Plain RPC to a member, with a lambda (sent by value); tensors travel as tensors.
    norm = group.rpc_sync("1", lambda t: float(t.norm()), args=(torch.full((4,), 2.0),))

    # An asynchronous call: start it, do other work, then wait() for the result.
    future = group.registered_async("check", args=(2.5,))
    checked = future.wait()

    # The asynchronous service answers when all three members have called it.
    total = group.registered_sync("total", args=(float(world.rank),))
    group.barrier()
    count = counter.rpc_sync().value()  # runs on member 0, after every member's add
    outcome = {"norm": norm, "checked": checked, "total": total, "count": count}
# [/services]

# [errors]
    # A remote exception keeps its type; the remote traceback is its __cause__.
    try:
        group.registered_sync("check", args=(-1.0,))
    except ValueError as err:
        assert isinstance(err.__cause__, RemoteTraceback)
        assert "on member '1'" in str(err.__cause__)
        outcome["error"] = str(err)

    # An unknown key is a KeyError on the caller.
    try:
        group.registered_sync("no-such-service")
    except KeyError as err:
        outcome["missing"] = err.args[0]
# [/errors]

# [timeouts]
    # Every call takes a timeout (seconds; None: the World's rpc_timeout).
    if me == "0":
        try:
            group.registered_sync("slow", timeout=0.5)
        except TimeoutError as err:
            outcome["timeout"] = str(err)
        group.registered_sync("release")  # the slow service returns; nothing stays blocked
    group.barrier()
    group.destroy()
    return outcome
# [/timeouts]


# [samehost]
def scale_(tensor: torch.Tensor, factor: float) -> torch.Tensor:
    return tensor.mul_(factor)


def large_tensors(world: machinlike.World) -> bool:
    group = world.create_rpc_group("tensors", world.get_members())
    if world.name == "1":
        group.register("scale_", scale_)
    group.barrier()
    if world.name == "0":
        # A copy, through a recycled shared-memory segment (same host, >= 256 KiB):
        # the owner's in-place edit stays on its side.
        batch = torch.ones(1024, 1024)  # 4 MB
        doubled = group.registered_sync("scale_", args=(batch, 2.0))
        assert float(doubled[0, 0]) == 2.0 and float(batch[0, 0]) == 1.0
        # Shared explicitly: the same memory on both sides, no copy.
        weights = machinlike.distributed.share(torch.ones(1024, 1024))
        group.registered_sync("scale_", args=(weights, 3.0))
        assert float(weights[0, 0]) == 3.0
    group.barrier()
    group.destroy()
    return True
# [/samehost]


# [dead]
def dead_member(world: machinlike.World) -> str:
    group = world.create_rpc_group("fragile", world.get_members())
    survivors = world.create_rpc_group("survivors", ["0", "1"]) if world.name != "2" else None
    if world.name == "2":
        group.register("crash", lambda: os._exit(3))  # the process dies inside the call
    group.barrier()
    if world.name == "2":
        threading.Event().wait(30)  # serve until the crash service ends this process
        return "still alive"
    if world.name == "0":
        try:
            group.registered_sync("crash", timeout=10)
        except PeerLostError as err:
            print(f"[0] {err}")
    world.wait_for_members(["2"], timeout=5, gone=True)  # detected within 2 s (liveness)
    survivors.barrier(timeout=20)
    try:
        group.rpc_sync("2", os.getpid, timeout=5)  # fails at once, not after 5 s
    except PeerLostError as err:
        assert err.member == "2"
    try:
        group.barrier(timeout=30)  # fails at once too: a barrier never waits for the lost
    except PeerLostError as err:
        print(f"[{world.name}] {err}")  # ... members: '2' left or died while being waited for
    survivors.destroy()
    return "survived"
# [/dead]


def main() -> None:
    # [run]
    outcomes = machinlike.launch(services, 3, timeout=60)
    for rank, outcome in enumerate(outcomes):
        print(rank, outcome)
    assert all(o["total"] == 0.0 + 1.0 + 2.0 for o in outcomes)
    assert all(o["count"] == 1 + 2 + 3 for o in outcomes)
    assert "did not answer within 0.5 s" in outcomes[0]["timeout"]
    paths = machinlike.launch(relayed, 2, timeout=60)[0]
    assert paths == ["10101"] * 64  # member 1, 0, 1, 0, 1: every hop answered
    assert machinlike.launch(relayed_by_coroutines, 2, timeout=60)[0] == ["10101"] * 64

    # A member that dies: calls to it fail fast with PeerLostError naming it, and the
    # launcher reports how its process ended. stop_timeout bounds how long the
    # survivors' World.stop waits for a peer that will never stop.
    assert machinlike.launch(large_tensors, 2, timeout=60) == [True, True]
    results = machinlike.launch(dead_member, 3, timeout=60, return_exceptions=True, stop_timeout=1)
    print(results)
    assert results[:2] == ["survived", "survived"]
    assert isinstance(results[2], ProcessExitedError) and results[2].exitcode == 3
    # [/run]


if __name__ == "__main__":
    main()
