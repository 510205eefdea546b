"""Awaiting calls from a coroutine: ``await group.registered_async(...)`` against what an
asyncio program writes without it, ``loop.run_in_executor(None, fut.wait)``, in one run.

Run:  python benchmarks/awaiting.py [--quick]

Two local processes. Member "1" serves ``act``, which takes ``SERVICE_MS`` milliseconds
(an environment step, a policy on another device) and returns its argument; member "0"
runs one asyncio event loop that makes ``CONCURRENT`` calls at once and gathers them:

* awaited: each coroutine awaits its RpcFuture (a done-callback wakes the loop);
* executor: each coroutine hands ``fut.wait`` to the loop's default thread pool, as
  asyncio code does with a blocking call (at most ``min(32, cores + 4)`` waits at once).

Both send every call at once; they differ in how the loop learns of the answers. Prints
the median wall time of a gather (ms) per round, the ratio, and the lower bound
(``SERVICE_MS`` times the rounds the callee's threads need: ``CONCURRENT / rpc_threads``).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import os
import statistics
import time
from typing import Any, Dict, List

from machinlike import launch

SERVICE_MS = 10.0
CONCURRENT = 64
RPC_THREADS = 64


def act(x: Any) -> Any:
    time.sleep(SERVICE_MS / 1000)
    return x


def _body(world: Any, rounds: int) -> Dict[str, List[float]]:
    group = world.create_rpc_group("bench", world.get_members())
    if world.rank == 1:
        group.register("act", act)
    group.barrier()
    times: Dict[str, List[float]] = {"awaited": [], "executor": []}
    if world.rank == 0:
        async def awaited() -> None:
            await asyncio.gather(*(group.registered_async("act", args=(i,)) for i in range(CONCURRENT)))

        async def executor() -> None:
            loop = asyncio.get_running_loop()
            await asyncio.gather(*(loop.run_in_executor(None, group.registered_async("act", args=(i,)).wait)
                                   for i in range(CONCURRENT)))

        async def main() -> None:
            # The default executor's size, as asyncio makes it (explicit: the same on every box).
            size = min(32, (os.cpu_count() or 1) + 4)
            asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(size))
            for name, run in (("awaited", awaited), ("executor", executor)):
                await run()  # warm-up
            for _ in range(rounds):
                for name, run in (("awaited", awaited), ("executor", executor)):
                    start = time.perf_counter()
                    await run()
                    times[name].append(time.perf_counter() - start)

        asyncio.run(main())
    group.barrier()
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (a smoke run)")
    args = parser.parse_args()
    times = launch(_body, 2, args=(3 if args.quick else 10,), timeout=300, rpc_threads=RPC_THREADS)[0]
    awaited = statistics.median(times["awaited"]) * 1e3
    executor = statistics.median(times["executor"]) * 1e3
    bound = SERVICE_MS * -(-CONCURRENT // RPC_THREADS)
    print(f"{CONCURRENT} concurrent calls of a {SERVICE_MS:g} ms service, gathered in one event loop "
          f"(median of {len(times['awaited'])} rounds)")
    print(f"{'await fut':<34} {awaited:8.1f} ms")
    print(f"{'run_in_executor(None, fut.wait)':<34} {executor:8.1f} ms  (default executor: "
          f"{min(32, (os.cpu_count() or 1) + 4)} threads)")
    print(f"{'ratio (executor / await)':<34} {executor / awaited:8.2f}x")
    print(f"{'bound (service time x rounds)':<34} {bound:8.1f} ms")


if __name__ == "__main__":
    main()
