"""A process that comes to a *running static* world gets a clean error within its own
timeout, naming the address and the fix (issue 12's ask; before, gloo's raw
"connectFullMesh failed ... Connect timeout" after 40 s)."""

from __future__ import annotations

import time

from machinlike import Process, SimpleQueue
from machinlike.distributed import World, launch


def _stranger(address: str, out: "SimpleQueue") -> None:
    start = time.monotonic()
    try:
        World("c", 1, 2, init_method=address, dist_timeout=2)
        out.put(("joined", 0.0))
    except TimeoutError as err:
        out.put((str(err), time.monotonic() - start))


def _host(world: World) -> object:
    if world.rank != 0:
        world.create_rpc_group("both", ["a", "b"]).barrier(timeout=60)
        return None
    results = SimpleQueue()
    child = Process(target=_stranger, args=(world.store_address, results))
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
