"""Throughput of machinlike.queue against multiprocessing's queues, child -> parent.

A child process puts N items, the parent gets them; the clock runs from the first item
received to the last, so process start-up is not counted. Peers: ``SimpleQueue`` and
``Queue`` (with its feeder thread) of ``multiprocessing``, which pickle with
``ForkingPickler`` and therefore share tensors through torch's reducers, the way
``torch.multiprocessing`` does. All children start through machinlike's default (warm)
context. Ratios are machinlike's throughput / the peer's: above 1 means machinlike is
faster.

``mp.Queue`` pickles in a feeder thread: with a fresh tensor per item, the producer's
next allocation overlaps the previous item's move to shared memory, which pays where
page faults are slow. machinlike's queues pickle in the caller's thread (a pickling
error reaches the caller; nothing is dropped in a background thread).

Run: ``python benchmarks/bench_queue.py`` (``--quick`` for fewer items).
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Dict

import torch

from machinlike._warm import resolve_context
from machinlike.process import Process
from machinlike.queue import SimpleP2PQueue, SimpleQueue


def produce(queue: Any, kind: str, count: int, done: Any) -> None:
    if kind == "small tuple":
        for i in range(count):
            queue.put((i, 2.0, "abc"))
    else:
        for _ in range(count):
            queue.put(torch.ones(256 * 1024))  # 1 MB: a new tensor each time
    # torch's fd sharing (the multiprocessing peers) needs the sender alive until every
    # item is loaded; machinlike's named shared memory would not
    done.get(60)


def items_per_second(make_queue: Callable[[], Any], kind: str, count: int) -> float:
    queue, done = make_queue(), SimpleQueue()
    child = Process(target=produce, args=(queue, kind, count, done))
    child.start()
    queue.get()
    begin = time.perf_counter()
    for _ in range(count - 1):
        queue.get()
    elapsed = time.perf_counter() - begin
    done.put(None)
    child.join(60)
    child.watch()
    return (count - 1) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer items")
    options = parser.parse_args()
    ctx = resolve_context(None)
    contenders: Dict[str, Callable[[], Any]] = {
        "machinlike SimpleQueue": lambda: SimpleQueue(),
        "machinlike SimpleP2PQueue": lambda: SimpleP2PQueue(),
        "mp.SimpleQueue": ctx.SimpleQueue,
        "mp.Queue": ctx.Queue,
    }
    cases = {"small tuple": 20000, "1 MB tensor, shared": 500}
    print(f"{'case':<22}" + "".join(f"{name:>28}" for name in contenders))
    for kind, count in cases.items():
        if options.quick:
            count //= 10
        rates = {name: items_per_second(make, kind, count) for name, make in contenders.items()}
        print(f"{kind:<22}" + "".join(f"{rate:>22,.0f} it/s" for rate in rates.values()), flush=True)
        ours = rates["machinlike SimpleQueue"]
        ratios = "".join(f"{ours / rate:>27.2f}x" for rate in rates.values())
        print(f"{'  SimpleQueue / peer':<22}{ratios}", flush=True)


if __name__ == "__main__":
    main()
