"""One rank of the multi-host tests (``tests/test_multihost.py``), run on a "host".

    ip netns exec <host> python tests/_multihost_job.py round|meet|unreachable|elastic|stall

The World comes from the environment, as a cluster launcher sets it: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` (a job script, torchrun) or srun's
``SLURM_PROCID``, ``SLURM_NTASKS``, node list and job id; ``MLK_TEST_TIMEOUT`` is the
World's ``dist_timeout`` and ``rpc_timeout`` (seconds) and ``MLK_HOST_ADDR`` this host's
address (what its services report, so callers can tell which host answered).

The last line of stdout is ``RESULT <json>``: the outcome, or the error this rank raised.
"""

from __future__ import annotations

import datetime
import json
import os
import threading
import sys
import time
from typing import Any, Dict

import torch
import torch.distributed as dist

from machinlike.distributed import RpcGroup, World
from machinlike.distributed._store import rendezvous as _rendezvous
from machinlike.server import grad_server_helper


def where() -> str:
    return os.environ["MLK_HOST_ADDR"]


def make_model() -> torch.nn.Module:
    model = torch.nn.Linear(4, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(8.0).reshape(2, 4))
        model.bias.copy_(torch.tensor([10.0, 20.0]))
    return model


def gradient_round(world: World, group: RpcGroup) -> Dict[str, Any]:
    """One gradient-server round across the hosts: every rank pushes, rank 0 steps, all pull.

    Every rank computes the gradients of ``model(x).sum()`` with ``x`` filled with
    ``rank + 1`` and pushes them through ``PushPullGradServer``; the single secondary
    reducer (on rank 0) gathers all of them in one batch, the primary takes their mean and
    steps SGD(lr=1), so the expected parameters are exact.
    """
    servers = grad_server_helper(
        [make_model], group=group, optimizer=torch.optim.SGD, learning_rate=1.0,
        primary_reducer="0", secondary_reducers=["0"], reduce_method="mean",
        reduce_batch_size=world.world_size)
    (server,) = servers
    model = make_model()
    model(torch.full((1, 4), float(world.rank + 1))).sum().backward()
    assert server.push(model, pull=False)
    group.barrier()  # every push is queued on the secondary
    if world.rank == 0:
        server.flush()  # one step over all of them
    group.barrier()
    server.pull(model)
    group.barrier()  # nobody stops the servers while a peer still pulls
    servers.close()
    return {k: v.tolist() for k, v in model.state_dict().items()}


def run_round(world: World, full: bool = True) -> Dict[str, Any]:
    """Services, calls, barriers and an all-reduce across the hosts; ``full`` adds a
    collective group made after start-up and a gradient-server round."""
    rank, size = world.rank, world.world_size
    group = world.create_rpc_group("hosts", world.get_members())
    group.register(f"where/{world.name}", where)
    group.barrier()
    peer = world.get_members()[(rank + 1) % size]
    out: Dict[str, Any] = {
        "interface": world.interface,
        "where": [group.registered_sync(f"where/{m}") for m in world.get_members()],
        # a tensor through a torch function, and a closure sent by value (dill)
        "add": group.rpc_sync(peer, torch.add, args=(torch.arange(3.0), rank)).tolist(),
        "closure": group.rpc_sync(peer, lambda t: t * (rank + 1), args=(torch.ones(2),)).tolist(),
    }
    start = time.monotonic()
    for _ in range(3):
        group.barrier()
    out["barriers_s"] = time.monotonic() - start
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    out["all_reduce"] = total.item()
    if not full:
        group.barrier()
        group.destroy()
        return out
    # A group created after start-up is a new gloo context: it must find the same interface.
    pair = world.create_collective_group([1, 2])
    if rank in (1, 2):
        mine = torch.tensor([float(rank)])
        pair.all_reduce(mine)
        out["pair_all_reduce"] = mine.item()
    pair.destroy()
    out["params"] = gradient_round(world, group)
    group.barrier()
    group.destroy()
    return out


def _fifo_line(path: str, timeout: float) -> str:
    """One line from the test through a named pipe, within ``timeout`` seconds."""
    import select

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        assert ready, f"nothing on {path} within {timeout} s"
        return os.read(fd, 100).decode().strip()
    finally:
        os.close(fd)


def _store_client(timeout: float) -> dist.TCPStore:
    """A plain client of the world's store (the test's own keys, beside the World's)."""
    return dist.TCPStore(os.environ["MLK_MASTER"], int(os.environ["MLK_PORT"]), is_master=False,
                         timeout=datetime.timedelta(seconds=timeout))


def elastic_role(role: str, timeout: float) -> Dict[str, Any]:
    """Elastic scenario: "host" hosts the store; "remote" joins, is called, leaves; "victim"
    joins and then its host is unplugged by the test (host loss: no word, no RST)."""
    address = f"tcp://{os.environ['MLK_MASTER']}:{os.environ['MLK_PORT']}"
    events = []
    victim_lost = threading.Event()

    def record(event) -> None:  # runs on the liveness thread, after the views changed
        events.append((event.kind, event.member, time.monotonic()))
        if (event.kind, event.member) == ("lost", "victim"):
            victim_lost.set()

    # A short bound: what this scenario measures is how soon a silent host is declared lost.
    live = dict(dist_timeout=timeout, rpc_timeout=timeout, liveness=2.0)
    # The others join once the host listens: a join before on_member_change is not an event.
    listening = "mlk-test/host-listening"
    if role == "host":
        world = World("host", rank=0, elastic=True, init_method=address, **live)
        world.on_member_change(record)
        _store_client(timeout).set(listening, "1")
    else:
        _store_client(timeout).wait([listening])
        world = World(role, elastic=True, init_method=address, **live)
    group = world.create_rpc_group("open")
    group.register(f"where/{role}", where)
    if role == "victim":
        group.register("block", lambda: threading.Event().wait(60))  # answers only when it is too late
    out: Dict[str, Any] = {"role": role, "members_at_join": world.get_members()}
    world.create_rpc_group("ready", ["host", "remote", "victim"]).barrier(timeout=timeout)
    if role == "remote":
        out["host_is_at"] = group.registered_sync("where/host", timeout=timeout)
        world.create_rpc_group("done", ["host", "remote"]).barrier(timeout=timeout)
        world.stop(timeout)
        return out
    if role == "victim":
        world.wait_for_members(["host"], timeout=timeout, gone=True)  # never: its host is unplugged
        return out
    out["remote_is_at"] = group.registered_sync("where/remote", timeout=timeout)
    out["victim_is_at"] = group.registered_sync("where/victim", timeout=timeout)
    world.create_rpc_group("done", ["host", "remote"]).barrier(timeout=timeout)
    world.wait_for_members(["remote"], timeout=timeout, gone=True)
    try:
        group.registered_sync("where/remote", timeout=timeout)
        out["after_leave"] = "answered"
    except KeyError as err:
        out["after_leave"] = f"KeyError: {err}"
    pending: Dict[str, Any] = {}

    def call_victim() -> None:  # a call in flight when its host goes
        try:
            group.registered_sync("block", timeout=timeout)
            pending["outcome"] = "answered"
        except Exception as err:
            pending["outcome"] = f"{type(err).__name__}: {err}"
        pending["at"] = time.monotonic()

    caller = threading.Thread(target=call_victim)
    caller.start()
    in_flight = group.registered_async("block", timeout=timeout)  # and one the caller holds
    with open(os.environ["MLK_TO_TEST"], "w") as fifo:  # "unplug the victim's host now"
        fifo.write("unplug\n")
    assert _fifo_line(os.environ["MLK_FROM_TEST"], timeout) == "unplugged"
    unplugged = time.monotonic()
    world.wait_for_members(["victim"], timeout=timeout, gone=True)
    out["detected_after"] = time.monotonic() - unplugged
    victim_lost.wait(timeout)  # the callback runs just after the views changed
    caller.join(timeout)
    out["pending_call"] = pending.get("outcome")
    out["pending_failed_after"] = pending.get("at", float("inf")) - unplugged
    try:
        in_flight.wait()
        out["pending_async"] = "answered"
    except Exception as err:
        out["pending_async"] = f"{type(err).__name__}: {err}"
    out["pending_async_after"] = time.monotonic() - unplugged
    try:
        group.rpc_sync("victim", where, timeout=timeout)
    except ConnectionError as err:
        out["call_after_loss"] = f"{type(err).__name__}: {err}"
    out["events"] = [(k, m) for k, m, _ in events]
    world.stop(timeout)
    return out


def _answer_late(done: str, timeout: float) -> str:
    """A service that answers once the sleeper reported (its caller is cut off by then)."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(done) and time.monotonic() < deadline:
        time.sleep(0.05)
    return "late"


def _pending_call(group: RpcGroup, done: str, timeout: float, into: Dict[str, Any]) -> None:
    try:
        into["outcome"] = f"answered: {group.registered_sync('late/host', (done, timeout), timeout=timeout)}"
    except Exception as err:
        into["outcome"] = f"{type(err).__name__}: {err}"
    into["at"] = time.monotonic()


def stall_role(role: str, timeout: float) -> Dict[str, Any]:
    """Stall scenario: "host" hosts the store; "sleeper" joins and is then SIGSTOPped by the
    test for longer than the lease, so the host declares it lost though it lives. Resumed,
    the sleeper must learn that it was declared lost from its own calls, and a call it had
    pending on the host (answered only after the sleeper reported) must end with it."""
    address = f"tcp://{os.environ['MLK_MASTER']}:{os.environ['MLK_PORT']}"
    done = os.environ["MLK_DONE_FILE"]
    world = World(role, rank=0 if role == "host" else None, elastic=True, init_method=address,
                  dist_timeout=timeout, rpc_timeout=timeout, liveness=1.0)
    group = world.create_rpc_group("open")
    group.register(f"where/{role}", where)
    if role == "host":
        group.register("late/host", _answer_late)
    out: Dict[str, Any] = {"role": role}
    if role == "host":
        world.wait_for_members(["sleeper"], timeout=timeout)
        print("JOINED", flush=True)
        world.wait_for_members(["sleeper"], timeout=timeout, gone=True)  # stopped, not dead
        print("LOST", flush=True)
        deadline = time.monotonic() + timeout
        while not os.path.exists(done) and time.monotonic() < deadline:  # the sleeper's report
            time.sleep(0.1)
        out["sleeper_reported"] = os.path.exists(done)
        world.stop(timeout)
        return out
    deadline = time.monotonic() + timeout
    while not group.is_registered("where/host"):  # a slow host may not have registered it yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"the host did not register 'where/host' within {timeout:g} s")
        time.sleep(0.05)
    group.registered_sync("where/host", timeout=timeout)
    while not group.is_registered("late/host"):  # (registered just after where/host)
        time.sleep(0.05)
    pending: Dict[str, Any] = {}
    caller = threading.Thread(target=_pending_call, args=(group, done, timeout, pending), daemon=True)
    caller.start()
    print("READY", flush=True)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:  # stopped somewhere in here, then resumed
            group.registered_sync("where/host", timeout=5)
            time.sleep(0.05)
        out["outcome"] = "no error"
    except Exception as err:
        out["outcome"] = f"{type(err).__name__}: {err}"
    told = time.monotonic()
    try:  # (an open group lists the live: its register said "not a member", not why; CI once)
        group.register("after/sleeper", where)
        out["register"] = "no error"
    except Exception as err:
        out["register"] = f"{type(err).__name__}: {err}"
    caller.join(timeout)
    out["pending_call"] = pending.get("outcome")
    out["pending_ended_after"] = pending.get("at", float("inf")) - told  # (before the sleeper reports)
    with open(done, "w") as stream:
        stream.write("done\n")
    world.stop(timeout)
    return out


def main() -> None:
    scenario = sys.argv[1]
    if scenario in ("elastic", "stall"):
        role_of = elastic_role if scenario == "elastic" else stall_role
        start = time.monotonic()
        try:
            result = {"ok": True, **role_of(os.environ["MLK_ROLE"], float(os.environ["MLK_TEST_TIMEOUT"]))}
        except Exception as exc:
            result = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
        result["elapsed"] = time.monotonic() - start
        print("RESULT " + json.dumps(result), flush=True)
        return
    timeout = float(os.environ["MLK_TEST_TIMEOUT"])
    start = time.monotonic()
    world = None
    try:
        world = World(dist_timeout=timeout, rpc_timeout=timeout)
        # Where the environment put the master (torchrun's variables, or srun's).
        result: Dict[str, Any] = {"ok": True, "master": list(_rendezvous._master_from(None)[:2])}
        if scenario in ("round", "meet"):
            result.update(run_round(world, full=scenario == "round"))
    except Exception as exc:  # the test reads the error from the report
        result = {"ok": False, "type": type(exc).__name__, "message": str(exc)}
    result["elapsed"] = time.monotonic() - start
    if world is not None:
        world.stop(timeout)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
