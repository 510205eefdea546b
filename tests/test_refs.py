"""machinlike's remote handles (get_paired, remote, registered_remote) across real processes:
what they fetch and call, how long a result stays on its owner (released, sent on, its
holder SIGKILLed), and that they follow an owner through renewals of its RPC agent."""

from __future__ import annotations

import gc
import os
import signal
import socket
import threading
import time

import pytest
import torch

import machinlike
from machinlike import launch
from machinlike.distributed import PairedRef, ResultRef, World, get_world
from machinlike.exception import PeerLostError, RemoteTraceback
from machinlike.process import Process
from machinlike.testing import world_test

MEMBERS = ["0", "1", "2"]

# Handles a member was sent (kept so that they hold their results).
_received = []


def _kept() -> int:
    """How many results this member keeps for handles."""
    return len(get_world()._session.tables.results)  # the tables its Session serves


def _until(predicate, timeout: float = 10.0):
    """Ask ``predicate()`` until it is true (a release is a one-way message: nothing to wait on)."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def _ones(n: int) -> torch.Tensor:
    return torch.ones(n)


def _bad(x: int) -> int:
    raise ValueError(f"bad input {x}")


def _take(ref: ResultRef) -> float:
    _received.append(ref)
    return float(ref.to_here().sum())


def _first_received() -> list:
    return _received[0].to_here().tolist()


def _drop() -> None:
    _received.clear()
    gc.collect()


class Box:
    def __init__(self) -> None:
        self.n = 0

    def add(self, k: int) -> int:
        self.n += k
        return self.n


@world_test(3, timeout=90)
def test_results_are_kept_while_a_handle_lives_here_or_elsewhere(world):
    g = world.create_rpc_group("refs", MEMBERS)
    if world.name == "1":
        g.register("ones", _ones)
    g.barrier()
    if world.name == "0":
        ref = g.remote("1", _ones, args=(4,))
        assert isinstance(ref, ResultRef) and ref.owner_name() == "1" and not ref.is_owner()
        assert ref.to_here().tolist() == [1.0] * 4 and ref.confirmed_by_owner()
        assert g.rpc_sync("1", _kept) == 1
        del ref
        gc.collect()
        assert _until(lambda: g.rpc_sync("1", _kept) == 0), "a collected handle did not free its result"
        # Sent on: member 2's copy holds the result after this one is gone.
        ref = g.remote("1", _ones, args=(3,))
        assert g.rpc_sync("2", _take, args=(ref,)) == 3.0
        del ref
        gc.collect()
        time.sleep(0.3)  # (the creator's release has long arrived when member 2 is asked)
        assert g.rpc_sync("2", _first_received) == [1.0] * 3
        assert g.rpc_sync("1", _kept) == 1
        g.rpc_sync("2", _drop)
        assert _until(lambda: g.rpc_sync("1", _kept) == 0), "the last copy's release did not free it"
        # registered_remote: kept by the service's owner.
        kept = g.registered_remote("ones", args=(2,))
        assert kept.owner_name() == "1" and kept.to_here().tolist() == [1.0, 1.0]
        # Errors keep their type and the remote traceback.
        with pytest.raises(ValueError, match="bad input 7") as info:
            g.remote("2", _bad, args=(7,)).to_here()
        assert isinstance(info.value.__cause__, RemoteTraceback)
        with pytest.raises(KeyError, match="not registered on any member|not found"):
            g.registered_remote("nobody").to_here()
    g.barrier()
    g.destroy()


@world_test(2, timeout=60)
def test_handles_dropped_at_once_are_released_in_batches_off_the_collector(world):
    from machinlike.distributed._calls import ref_release

    g = world.create_rpc_group("batch", ["0", "1"])
    g.barrier()
    if world.name == "0":
        before = ref_release.stats()
        refs = [g.remote("1", _ones, args=(2,)) for _ in range(200)]
        assert [r.to_here().tolist() for r in refs[:3]] == [[1.0, 1.0]] * 3
        # (each creation is its own call: the last may still be on its way when this asks)
        assert _until(lambda: g.rpc_sync("1", _kept) == 200), g.rpc_sync("1", _kept)
        refs.clear()
        gc.collect()  # (each finalizer only queues its release)
        assert _until(lambda: g.rpc_sync("1", _kept) == 0), "dropped handles did not free their results"
        after = ref_release.stats()
        sent, calls = after["sent"] - before["sent"], after["calls"] - before["calls"]
        assert sent == 200 and 1 <= calls < sent and after["not_sent"] == before["not_sent"], (before, after)
    g.barrier()
    g.destroy()


@world_test(3, timeout=90)
def test_a_paired_handle_calls_and_fetches_the_owners_object(world):
    g = world.create_rpc_group("box", MEMBERS)
    box = Box()
    if world.name == "2":
        g.pair("box", box)
    g.barrier()
    ref = g.get_paired("box")
    assert isinstance(ref, PairedRef) and ref.owner_name() == "2"
    assert ref.rpc_sync().add(1) >= 1
    assert ref.rpc_async().add(1).wait() >= 2
    assert ref.remote().add(1).to_here() >= 3
    g.barrier()
    if world.name == "2":
        assert box.n == 9 and ref.is_owner() and ref.local_value() is box
    else:
        assert ref.to_here().n == 9
        with pytest.raises(RuntimeError, match="owned by member '2'; use to_here"):
            ref.local_value()
    g.barrier()
    if world.name == "2":
        g.unpair("box")
    g.barrier()
    with pytest.raises(KeyError, match="no longer paired"):
        ref.to_here()
    g.barrier()
    g.destroy()


def _holder(address: str, done) -> None:
    with World("holder", elastic=True, init_method=address, dist_timeout=20) as world:
        group = world.create_rpc_group("open")
        refs = [group.remote("owner", _ones, args=(8,), timeout=20) for _ in range(5)]
        assert all(ref.to_here(timeout=20).sum() == 8 for ref in refs)
        done.put(os.getpid())
        time.sleep(60)  # SIGKILLed here, holding them


def _holder_killed_body(world):
    world.create_rpc_group("open")
    done = machinlike.SimpleQueue()
    child = Process(target=_holder, args=(world.store_address, done))
    child.start()
    pid = done.get(timeout=60)
    assert _kept() == 5
    os.kill(pid, signal.SIGKILL)
    world.wait_for_members(["holder"], timeout=20, gone=True)
    freed = _until(lambda: _kept() == 0)
    child.join(10)
    return freed


def test_results_held_by_a_member_that_is_sigkilled_are_freed():
    assert launch(_holder_killed_body, 1, names=["owner"], max_restarts=1, timeout=120) == [True]


def _renewing_owner_body(world):
    group = world.create_rpc_group("open")
    both = world.create_rpc_group("both", ["owner", "peer"])
    if world.name == "owner":
        group.pair("value", {"n": 7})
    both.barrier(timeout=30)  # paired
    if world.name == "owner":
        both.barrier(timeout=30)  # the peer holds its handles
        for n in (1, 2):  # two renewals of this member's agent
            host, _, port = world.membership.rpc_address()[len("uv://"):].rpartition(":")
            socket.create_connection((host, int(port)), timeout=5).close()
            # Counted once its new agent has joined (the worker's name changes as it starts:
            # CI once read the count between the two).
            deadline = time.monotonic() + 30
            while world.membership.renewals < n and time.monotonic() < deadline:
                time.sleep(0.01)
        both.barrier(timeout=30)
        both.barrier(timeout=60)
        return world.membership.renewals
    paired = group.get_paired("value", timeout=20)
    result = group.remote("owner", _ones, args=(2,), timeout=20)
    first = world.membership.worker_of("owner")
    both.barrier(timeout=30)
    both.barrier(timeout=30)
    world.membership.wait_until(lambda live: world.membership.worker_of("owner") != first, 20)
    out = (paired.to_here(timeout=20), paired.rpc_sync(timeout=20).get("n"), result.to_here(timeout=20).tolist())
    both.barrier(timeout=60)
    return out


def test_handles_follow_their_owner_through_renewals_of_its_agent():
    renewals, out = launch(_renewing_owner_body, 2, names=["owner", "peer"], max_restarts=1, timeout=150)
    assert renewals == 2
    assert out == ({"n": 7}, 7, [1.0, 1.0])


def _gone_owner_body(world):
    group = world.create_rpc_group("open")
    done, started = machinlike.SimpleQueue(), machinlike.SimpleQueue()
    child = Process(target=_paired_and_killed, args=(world.store_address, done, started))
    child.start()
    done.get(timeout=60)
    ref = group.get_paired("v", timeout=20)
    assert ref.to_here(timeout=20).n == 1
    # A call through the handle under way when the owner is SIGKILLed fails fast, naming it.
    outcome = []

    def slow_call() -> None:
        try:
            ref.rpc_sync(timeout=60).slow()
            outcome.append(("returned", time.monotonic()))
        except Exception as err:  # noqa: BLE001 - what it raised is the result
            outcome.append((err, time.monotonic()))

    caller = threading.Thread(target=slow_call)
    caller.start()
    started.get(timeout=20)  # the owner is inside slow()
    killed = time.monotonic()
    os.kill(child.pid, signal.SIGKILL)
    caller.join(30)
    during, ended = outcome[0]
    assert isinstance(during, PeerLostError) and "'victim'" in str(during), during
    assert ended - killed < 10, f"a call under way failed {ended - killed:.1f} s after its owner was killed"
    world.wait_for_members(["victim"], timeout=20, gone=True)
    try:
        ref.to_here(timeout=10)
    except PeerLostError as err:
        return str(err), time.monotonic() - killed
    finally:
        child.join(10)
    return "no error", 0.0


class _Sleeper:
    def __init__(self, started) -> None:
        self.n = 1
        self._started = started

    def __getstate__(self):
        return {"n": self.n}

    def slow(self) -> None:
        self._started.put(True)
        time.sleep(60)


def _paired_and_killed(address: str, done, started) -> None:
    with World("victim", elastic=True, init_method=address, dist_timeout=20) as world:
        world.create_rpc_group("open").pair("v", _Sleeper(started))
        done.put(True)
        time.sleep(60)


def test_a_handle_whose_owner_died_names_it():
    message, after = launch(_gone_owner_body, 1, names=["host"], max_restarts=1, timeout=120)[0]
    assert "'victim'" in message and "lost" in message, message
    assert after < 15, f"the calls through the handle took {after:.1f} s to fail after the kill"


class _SlowToMake:
    def __init__(self, seconds: float) -> None:
        time.sleep(seconds)  # (a constructor that takes its time: a model loaded, say)

    def hi(self) -> str:
        return "hi"


@world_test(2, timeout=90)
def test_a_result_being_made_names_its_owner_at_once_and_bounds_each_wait_by_its_own_timeout(world):
    # Cold trial 12: every method waited for the creation, whatever its own timeout said,
    # and rpc_async() blocked until then; torch answers owner() at once.
    group = world.create_rpc_group("g", world.get_members())
    if world.name == "0":
        ref = group.remote("1", _SlowToMake, args=(3.0,), timeout=30)
        start = time.monotonic()
        assert ref.owner_name() == "1" and not ref.is_owner()
        fut = ref.rpc_async(timeout=20).hi()  # sent once the result is made
        assert time.monotonic() - start < 1.0 and not fut.done()
        with pytest.raises(TimeoutError, match=r"was not made within the call's timeout.*member '1' still runs"):
            ref.to_here(timeout=0.3)
        with pytest.raises(TimeoutError, match="was not made within"):
            ref.rpc_sync(timeout=0.3).hi()
        assert time.monotonic() - start < 2.5
        assert fut.wait() == "hi" and ref.rpc_sync().hi() == "hi"
        for bad, error in ((0, ValueError), (-5, ValueError), ("1", TypeError)):  # torch reads 0 as no limit
            with pytest.raises(error, match=rf"timeout={bad!r} must be"):
                ref.rpc_sync(timeout=bad).hi()
            with pytest.raises(error, match=rf"timeout={bad!r} must be"):
                ref.to_here(timeout=bad)
        assert ref.rpc_sync(timeout=-1).hi() == "hi"  # torch's "unset": the default
    group.barrier()
    group.destroy()
