"""The floor of a CUDA round trip between two processes on one GPU, with no framework (GPU only).

Run:  python benchmarks/gpu_floor.py [--repeats 300]

What an echo through ``registered_sync`` cannot beat: two processes on cuda:0 share two
buffers and two interprocess events once (``torch.multiprocessing``), then ping-pong over
a pipe. Each hop does what the IPC path does: the sender copies its tensor into the shared
buffer and records the buffer's event; the receiver polls that event from the CPU, clones
the tensor out into memory of its own and records an event after the clone. Variants:

  pipe          the pipe's round trip alone (one byte each way, no GPU work)
  hop           the copies and events above, 1 MB and 64 MB
  hop+thread    the same, and each process hands its clone's event to a thread that
                waits for it (``synchronize``), as ``cuda_ipc_release`` does
  hop+sync      the receiver waits for its clone on the CPU before it answers

Each row: the median round trip, and the median CPU time of the receiver's clone call
alone (what ``gpu_breakdown.py`` sees as 60 us inside an echo). Without CUDA it says
"no GPU" and exits 0. Under NVIDIA's MPS, start its daemon first.
"""

from __future__ import annotations

import argparse
import queue
import statistics
import sys
import threading
import time
from typing import Any, Dict, List, Tuple

import torch
import torch.multiprocessing as mp

_VARIANTS = ("pipe", "hop", "hop+thread", "hop+sync")


class _Waiter:
    """A thread that waits for each event handed to it (``cuda_ipc_release``'s shape)."""

    def __init__(self) -> None:
        self.items: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            event = self.items.get()
            if event is None:
                return
            event.synchronize()


def _hop(mine: torch.Tensor, shared: torch.Tensor, ready: Any) -> None:
    """Send: copy ``mine`` into the shared buffer and record its event (no wait)."""
    shared.copy_(mine)
    ready.record()


def _take(shared: torch.Tensor, ready: Any, variant: str, waiter: Any, clones: List[float]) -> torch.Tensor:
    """Receive: poll the sender's event, clone out, record an event after the clone."""
    while not ready.query():
        pass
    start = time.perf_counter()
    own = shared.clone()
    clones.append(time.perf_counter() - start)
    done = torch.cuda.Event(blocking=True)
    done.record()
    if variant == "hop+thread":
        waiter.items.put(done)
    elif variant == "hop+sync":
        done.synchronize()
    return own


def _callee(conn: Any, bufs: Dict[str, Any], out: Any) -> None:
    torch.cuda.set_device(0)
    waiter = _Waiter()
    clones: List[float] = []
    while True:
        message = conn.recv()
        if message is None:
            break
        variant, size = message
        if variant == "pipe":
            conn.send(1)
            continue
        ask, ask_ready, answer, answer_ready = bufs[size]
        own = _take(ask, ask_ready, variant, waiter, clones)
        _hop(own, answer, answer_ready)
        conn.send(1)
    waiter.items.put(None)
    out.put(statistics.median(clones) if clones else 0.0)


def _buffers(megabytes: int) -> Tuple[Any, ...]:
    n = megabytes << 20
    return (torch.zeros(n, dtype=torch.uint8, device="cuda"), torch.cuda.Event(interprocess=True),
            torch.zeros(n, dtype=torch.uint8, device="cuda"), torch.cuda.Event(interprocess=True))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: benchmarks/gpu_floor.py has nothing to measure here")
        return 0
    torch.cuda.set_device(0)
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    ctx = mp.get_context("spawn")
    bufs = {mb: _buffers(mb) for mb in (1, 64)}
    for _, ready, _, other in bufs.values():
        ready.record()  # (an event must be recorded once before a peer may open it)
        other.record()
    mine, theirs = ctx.Pipe()
    out = ctx.Queue()
    child = ctx.Process(target=_callee, args=(theirs, bufs, out), daemon=True)
    child.start()
    waiter = _Waiter()
    try:
        for variant in _VARIANTS:
            for mb in ((0,) if variant == "pipe" else (1, 64)):
                x = torch.ones(max(mb, 1) << 20, dtype=torch.uint8, device="cuda")
                times: List[float] = []
                clones: List[float] = []
                for i in range(args.repeats + 10):
                    start = time.perf_counter()
                    if variant == "pipe":
                        mine.send((variant, mb))
                        mine.recv()
                    else:
                        ask, ask_ready, answer, answer_ready = bufs[mb]
                        _hop(x, ask, ask_ready)
                        mine.send((variant, mb))
                        mine.recv()
                        x = _take(answer, answer_ready, variant, waiter, clones)
                    if i >= 10:
                        times.append(time.perf_counter() - start)
                torch.cuda.synchronize()
                median = statistics.median(times)
                rate = f"{2 * (mb << 20) / median / 1e9:7.1f} GB/s" if mb else " " * 12
                clone = f"caller's clone call {statistics.median(clones) * 1e6:5.1f} us" if clones else ""
                print(f"  {variant:<11} {mb:>3} MB  round trip {median * 1e6:7.1f} us {rate}  {clone}", flush=True)
        mine.send(None)
        print(f"  callee's clone call, median of all: {out.get(timeout=60) * 1e6:.1f} us", flush=True)
    finally:
        waiter.items.put(None)
        child.join(30)
        if child.is_alive():
            child.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
