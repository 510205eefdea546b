"""A process that comes to a *running static* world gets a clean error within its own
timeout, naming the address and the fix (issue 12's ask; before, gloo's raw
"connectFullMesh failed ... Connect timeout" after 40 s); also when its world_size is
not the running world's (issue 37). When its rank is held by a live process of this host
(two jobs given one port), it is told at once, and its marks on the store are undone."""

from __future__ import annotations

import time

import datetime

import torch.distributed as dist

from machinlike import Process, SimpleQueue
from machinlike.distributed import World, launch
from machinlike.distributed._store import Keys


def _stranger(address: str, out: "SimpleQueue", rank: int = 1, size: int = 2, timeout: float = 2) -> None:
    start = time.monotonic()
    try:
        World("c", rank, size, init_method=address, dist_timeout=timeout)
        out.put(("joined", 0.0))
    except (TimeoutError, ValueError, RuntimeError) as err:
        out.put((str(err), time.monotonic() - start))


def _host(world: World, rank: int = 1, size: int = 2, timeout: float = 2) -> object:
    if world.rank != 0:
        world.create_rpc_group("both", ["a", "b"]).barrier(timeout=60)
        return None
    results = SimpleQueue()
    child = Process(target=_stranger, args=(world.store_address, results, rank, size, timeout))
    child.start()
    answer = results.get(timeout=60)
    child.join(30)
    host, _, port = world.store_address[len("tcp://"):].rpartition(":")
    store = dist.TCPStore(host, int(port), None, False, datetime.timedelta(seconds=30))
    worlds = store.add(Keys.static_counter("0", rank), 0)  # rank's worlds on this store, the stranger's undone
    world.create_rpc_group("both", ["a", "b"]).barrier(timeout=60)
    return answer + (worlds,)


def test_a_stranger_to_a_running_static_world_is_told_at_once_and_leaves_no_mark():
    message, took, worlds = launch(_host, 2, args=(1, 2, 30), names=["a", "b"], timeout=90)[0]
    assert "rank 1 of the static world at 127.0.0.1:" in message and "is held by process" in message, message
    assert "elastic=True" in message and "a port of its own" in message, message
    assert took < 15, took  # at once, not after its dist_timeout (30 s), nor gloo's 40 s
    assert worlds == 1, worlds  # the running world's rank 1 only: that job's next World meets as before


def test_a_stranger_with_another_world_size_is_told_the_mismatch_within_its_timeout():
    # Rank 2 of 3 is the first World of rank 2 on this store: it lands in the running
    # world's namespace and finds ranks 0 and 1 there (before: gloo's 40 s timeout).
    message, took, _ = launch(_host, 2, args=(2, 3), names=["a", "b"], timeout=90)[0]
    assert "started with world_size=3" in message and "ranks [0, 1]" in message, message
    assert "world_size=2" in message and "elastic=True" in message, message
    assert took < 2 + 3, took
