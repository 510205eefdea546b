"""One echo through ``registered_sync``, step by step across both processes (GPU; --device cpu too).

Run:  python benchmarks/gpu_timeline.py [--repeats 300] [--megabytes 1] [--device cuda]

Where ``gpu_breakdown.py`` times stages inside each process, this gives the gaps between
them, hand-offs between threads and processes included: each step of the path stamps
``time.perf_counter_ns()`` (CLOCK_MONOTONIC, one clock for the processes of a host) in the
process and thread that runs it, and the table gives, per step, the median time since the
step before it over ``--repeats`` echoes::

    caller main      call ─► walk + copy into slab ─► pickle ─► sent
    callee reader        ─► frame read ─► (runs it: nobody woken) unpickle = copy out
                         ─► echo ─► reply: walk + copy into slab ─► pickle ─► sent
    caller main          ─► frame read ─► unpickle = copy out ─► returned

The stamps cost about a microsecond each. Without CUDA, ``--device cuda`` says "no GPU"
and exits 0; ``--device cpu`` runs the same steps with CPU tensors (shared memory).

``--variant`` (repeatable) changes one thing in both processes, to see which step it moves
(experiments for this benchmark's one caller and one callee, not settings):
  inline-release  a receiver waits for its copies out and frees the lease itself (no
                  releaser thread woken per message; the wait is on the message's path)
  no-settle       the caller's stream is not ordered after the copies (``cuda_settle``)
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

_STAMPS: List[Tuple[int, str]] = []


def _stamp(label: str) -> None:
    _STAMPS.append((time.perf_counter_ns(), label))


def _around(label: str, fn: Callable[..., Any], thread: str = "") -> Callable[..., Any]:
    """``fn`` stamping ``label:start`` and ``label:end`` (only in threads named ``thread*``)."""
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        mine = threading.current_thread().name.startswith(thread)
        if mine:
            _stamp(f"{label}:start")
        try:
            return fn(*args, **kwargs)
        finally:
            if mine:
                _stamp(f"{label}:end")
    return wrapper


def echo(x: Any) -> Any:
    _stamp("echo")
    return x


VARIANTS = ("inline-release", "no-settle")


def _vary(variants: List[str]) -> None:
    """Apply ``--variant`` changes in this process (see the module doc)."""
    from machinlike.distributed._calls import cuda_ipc, cuda_ipc_area
    from machinlike.distributed._groups import caller

    if "inline-release" in variants:
        def put(done: Any, row: Any, lease: int, owner: int) -> None:
            done.synchronize()
            if int(row[0]) == lease:
                row[0] = cuda_ipc_area.FREE
        cuda_ipc._releaser.put = put  # type: ignore[method-assign]
    if "no-settle" in variants:
        caller.settled = lambda value: value


def _patch() -> None:
    from machinlike.distributed._calls import samehost, serve
    from machinlike.distributed._transport import lane, lane_conn, lane_server

    lane.request_bytes = _around("pickle request", lane.request_bytes)
    lane_conn.send_frame = _around("send request", lane_conn.send_frame, "MainThread")
    # (a sync call reads its own answer: the caller's thread, since session 45)
    reader = lane_conn.FrameReader
    reader.read = _around("read reply", reader.read, "MainThread")  # type: ignore[method-assign]
    lane_conn.load_body = _around("unpickle reply", lane_conn.load_body)
    reader.read = _around("read request", reader.read, "machinlike-lane-serve")  # type: ignore[method-assign]
    lane_server.load_body = _around("unpickle request", lane_server.load_body)
    lane_server.send_frame = _around("send reply", lane_server.send_frame, "machinlike-lane-")
    lane_server.reply_bytes = _around("pickle reply", lane_server.reply_bytes)
    samehost.outgoing = _around("encode request", samehost.outgoing)
    serve._reply = _around("encode reply", serve._reply)


# The path, in order: (stamp, what the gap before it is).
_STEPS = [
    ("call", "(start)"),
    ("encode request:start", "caller: into registered_sync"),
    ("encode request:end", "caller: walk, copy into slab, record"),
    ("pickle request:end", "caller: pickle the request"),
    ("send request:start", "caller: to the socket"),
    ("read request:end", "callee serve thread: frame sent and read (the wire and its wake-up)"),
    ("unpickle request:start", "callee: to the call (run by the thread that read it)"),
    ("unpickle request:end", "callee: unpickle = open, wait ready, copy out"),
    ("echo", "callee: into the service"),
    ("encode reply:start", "callee: out of the service"),
    ("encode reply:end", "callee: walk, copy into slab, record"),
    ("pickle reply:end", "callee: pickle the reply"),
    ("send reply:start", "callee: to the socket"),
    ("read reply:end", "caller: frame sent and read (the wire and its wake-up)"),
    ("unpickle reply:end", "caller: unpickle = open, wait ready, copy out"),
    ("returned", "caller: order its stream, return"),
]


def _take() -> List[Tuple[int, str]]:
    out = list(_STAMPS)
    _STAMPS.clear()
    return out


def _body(world: Any, repeats: int, megabytes: float, device: str, variants: List[str]) -> Any:
    if device == "cuda":
        torch.cuda.set_device(0)
        torch.cuda.init()
    _vary(variants)
    _patch()
    group = world.create_rpc_group("timeline", world.get_members())
    if world.rank == 1:
        group.register("echo", echo)
        group.register("take", _take)
    group.barrier()
    out: Any = None
    if world.rank == 0:
        x = torch.ones(int(megabytes * (1 << 18)), device=device)
        for _ in range(20):  # probe, slabs, openings
            group.registered_sync("echo", (x,))
        group.registered_sync("take")
        _take()
        walls = []
        for _ in range(repeats):
            start = time.perf_counter()
            _stamp("call")
            group.registered_sync("echo", (x,))
            _stamp("returned")
            walls.append(time.perf_counter() - start)
        mine = _take()
        out = (walls, mine, group.registered_sync("take"))
    group.barrier()
    group.destroy()
    return out


def _echoes(stamps: List[Tuple[int, str]]) -> List[Dict[str, int]]:
    """The merged stamps cut into echoes: each starts at "encode request:start" of a
    timed ``registered_sync("echo")`` (the "take" call's own stamps are dropped)."""
    echoes: List[Dict[str, int]] = []
    for t, label in sorted(stamps):
        if label == "call":
            echoes.append({})
        if echoes and label not in echoes[-1]:
            echoes[-1][label] = t
    return [e for e in echoes if all(step in e for step, _ in _STEPS)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    parser.add_argument("--megabytes", type=float, default=1.0)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--variant", choices=VARIANTS, action="append", default=[],
                        help="change one thing in both processes (repeatable; see the module doc)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no GPU: benchmarks/gpu_timeline.py has nothing to measure here (--device cpu runs it on the CPU)")
        return 0
    from machinlike import launch

    name = torch.cuda.get_device_name(0) if args.device == "cuda" else "CPU"
    print(f"device: {name}, torch {torch.__version__}, {args.megabytes:g} MB echo"
          + (f", variants {', '.join(args.variant)}" if args.variant else ""), flush=True)
    walls, mine, theirs = launch(_body, 2, args=(args.repeats, args.megabytes, args.device, args.variant),
                                 timeout=240, rpc_timeout=60)[0]
    echoes = _echoes(mine + theirs)
    print(f"echo round trip: median {statistics.median(walls) * 1e6:.0f} us over {len(walls)} "
          f"({len(echoes)} with every step stamped)")
    if not echoes:
        print("  no echo had every step stamped: nothing to break down")
        return 1
    previous = None
    total = 0.0
    for step, what in _STEPS:
        if previous is not None:
            gap = statistics.median(e[step] - e[previous] for e in echoes) / 1e3
            total += gap
            print(f"  {gap:8.1f} us  {what}")
        previous = step
    print(f"  {total:8.1f} us  sum of the medians")
    return 0


if __name__ == "__main__":
    sys.exit(main())
