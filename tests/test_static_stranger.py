"""A process that comes to a *running static* world gets a clean error within its own
timeout, naming the address and the fix (issue 12's ask; before, gloo's raw
"connectFullMesh failed ... Connect timeout" after 40 s); also when its world_size is
not the running world's (issue 37)."""

from __future__ import annotations

import time

from machinlike import Process, SimpleQueue
from machinlike.distributed import World, launch


def _stranger(address: str, out: "SimpleQueue", rank: int = 1, size: int = 2) -> None:
    start = time.monotonic()
    try:
        World("c", rank, size, init_method=address, dist_timeout=2)
        out.put(("joined", 0.0))
    except (TimeoutError, ValueError) as err:
        out.put((str(err), time.monotonic() - start))


def _host(world: World, rank: int = 1, size: int = 2) -> object:
    if world.rank != 0:
        world.create_rpc_group("both", ["a", "b"]).barrier(timeout=60)
        return None
    results = SimpleQueue()
    child = Process(target=_stranger, args=(world.store_address, results, rank, size))
    child.start()
    answer = results.get(timeout=60)
    child.join(30)
    world.create_rpc_group("both", ["a", "b"]).barrier(timeout=60)
    return answer


def test_a_stranger_to_a_running_static_world_is_told_within_its_timeout():
    message, took = launch(_host, 2, names=["a", "b"], timeout=90)[0]
    assert "rank 1 of the static world at 127.0.0.1:" in message and "was taken already" in message, message
    assert "elastic=True" in message, message
    assert took < 2 + 3, took  # its own dist_timeout (2 s), not gloo's 40 s


def test_a_stranger_with_another_world_size_is_told_the_mismatch_within_its_timeout():
    # Rank 2 of 3 is the first World of rank 2 on this store: it lands in the running
    # world's namespace and finds ranks 0 and 1 there (before: gloo's 40 s timeout).
    message, took = launch(_host, 2, args=(2, 3), names=["a", "b"], timeout=90)[0]
    assert "started with world_size=3" in message and "ranks [0, 1]" in message, message
    assert "world_size=2" in message and "elastic=True" in message, message
    assert took < 2 + 3, took
