"""Awaiting calls from a coroutine: ``await group.registered_async(...)`` against what an
asyncio program writes for a blocking API, ``loop.run_in_executor(None, registered_sync)``,
and against ``run_in_executor(None, fut.wait)``, in one run.

Run:  python benchmarks/awaiting.py [--quick]

Two local processes. Member "1" serves ``act``, which takes ``SERVICE_MS`` milliseconds
(an environment step, a policy on another device) and returns its argument; member "0"
runs one asyncio event loop with ``CONCURRENT`` coroutines (actors), each making ``STEPS``
calls one after the other (each step needs the last one's answer), gathered:

* awaited: each coroutine awaits its RpcFuture (a done-callback wakes the loop);
* executor: each coroutine hands the blocking ``registered_sync`` to the loop's default
  thread pool, as asyncio code does with a blocking call (at most ``min(32, cores + 4)``
  calls at once: the other actors' calls wait for a thread);
* executor, future: each coroutine sends with ``registered_async`` and hands only
  ``fut.wait`` to the pool (every call is out at once; the waits queue for threads).

Prints the median wall time of a gather (ms) per round, the ratio, and the lower bound
(``STEPS`` service times: every actor's chain at once).

Then the callee's side, with the default 16 RPC threads: ``CONCURRENT`` calls at once of a
service that waits ``SERVICE_MS`` (for a batch, another member's answer) written as an
``async def`` service (``await asyncio.sleep``: it holds no RPC thread while it waits)
against a plain one (``time.sleep``: each call holds a thread, 16 at a time).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import functools
import os
import statistics
import time
from typing import Any, Dict, List

from machinlike import launch

SERVICE_MS = 10.0
CONCURRENT = 64
STEPS = 5
RPC_THREADS = 64


def act(x: Any) -> Any:
    time.sleep(SERVICE_MS / 1000)
    return x


async def wait_async(x: Any) -> Any:
    await asyncio.sleep(SERVICE_MS / 1000)
    return x


def _callee_body(world: Any, rounds: int) -> Dict[str, List[float]]:
    group = world.create_rpc_group("callee", world.get_members())
    if world.rank == 1:
        group.register("plain", act)
        group.register("coroutine", wait_async)
    group.barrier()
    times: Dict[str, List[float]] = {"plain": [], "coroutine": []}
    if world.rank == 0:
        for name in ("plain", "coroutine"):  # warm-up
            [f.wait() for f in [group.registered_async(name, args=(i,)) for i in range(CONCURRENT)]]
        for _ in range(rounds):
            for name in ("plain", "coroutine"):
                start = time.perf_counter()
                futures = [group.registered_async(name, args=(i,)) for i in range(CONCURRENT)]
                assert [f.wait() for f in futures] == list(range(CONCURRENT))
                times[name].append(time.perf_counter() - start)
    group.barrier()
    return times


def _body(world: Any, rounds: int) -> Dict[str, List[float]]:
    group = world.create_rpc_group("bench", world.get_members())
    if world.rank == 1:
        group.register("act", act)
    group.barrier()
    times: Dict[str, List[float]] = {"awaited": [], "executor": [], "executor_future": []}
    if world.rank == 0:
        async def actor_awaiting(i: int) -> None:
            for step in range(STEPS):
                assert await group.registered_async("act", args=(i,)) == i

        async def actor_in_executor(i: int) -> None:
            loop = asyncio.get_running_loop()
            for step in range(STEPS):
                assert await loop.run_in_executor(None, functools.partial(group.registered_sync, "act", (i,))) == i

        async def actor_waiting_in_executor(i: int) -> None:
            loop = asyncio.get_running_loop()
            for step in range(STEPS):
                assert await loop.run_in_executor(None, group.registered_async("act", args=(i,)).wait) == i

        async def awaited() -> None:
            await asyncio.gather(*(actor_awaiting(i) for i in range(CONCURRENT)))

        async def executor() -> None:
            await asyncio.gather(*(actor_in_executor(i) for i in range(CONCURRENT)))

        async def executor_future() -> None:
            await asyncio.gather(*(actor_waiting_in_executor(i) for i in range(CONCURRENT)))

        async def main() -> None:
            # The default executor's size, as asyncio makes it (explicit: the same on every box).
            size = min(32, (os.cpu_count() or 1) + 4)
            asyncio.get_running_loop().set_default_executor(concurrent.futures.ThreadPoolExecutor(size))
            contenders = (("awaited", awaited), ("executor", executor), ("executor_future", executor_future))
            for name, run in contenders:
                await run()  # warm-up
            for _ in range(rounds):
                for name, run in contenders:
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
    executor_future = statistics.median(times["executor_future"]) * 1e3
    bound = SERVICE_MS * STEPS * -(-CONCURRENT // RPC_THREADS)
    print(f"{CONCURRENT} actors of one event loop, {STEPS} calls of a {SERVICE_MS:g} ms service each, one after the "
          f"other (median of {len(times['awaited'])} rounds)")
    threads = min(32, (os.cpu_count() or 1) + 4)
    print(f"{'await registered_async(...)':<38} {awaited:8.1f} ms")
    print(f"{'run_in_executor(None, registered_sync)':<38} {executor:8.1f} ms  ({executor / awaited:.2f}x the "
          f"await's time; default executor: {threads} threads)")
    print(f"{'run_in_executor(None, fut.wait)':<38} {executor_future:8.1f} ms  ({executor_future / awaited:.2f}x)")
    print(f"{'bound (steps x service time)':<38} {bound:8.1f} ms")
    callee = launch(_callee_body, 2, args=(3 if args.quick else 10,), timeout=300)[0]
    plain = statistics.median(callee["plain"]) * 1e3
    coroutine = statistics.median(callee["coroutine"]) * 1e3
    print(f"\n{CONCURRENT} calls at once of a service that waits {SERVICE_MS:g} ms, 16 RPC threads (the default)")
    print(f"{'async def service (await)':<38} {coroutine:8.1f} ms")
    print(f"{'plain service (time.sleep)':<38} {plain:8.1f} ms  ({plain / coroutine:.2f}x the async one's time)")
    print(f"{'bound (one service time)':<38} {SERVICE_MS:8.1f} ms")


if __name__ == "__main__":
    main()
