"""Where the time of a CUDA echo through ``registered_sync`` goes, stage by stage (GPU only).

Run:  python benchmarks/gpu_breakdown.py [--repeats 200] [--lane off]

Two members on cuda:0; the caller echoes a 1 MB and a 64 MB CUDA tensor through a
registered service. Every stage of the path (the caller's encoding, the copy into the
export slab, the lane's pickling, the receiver's copy-out, the callee's reply encoding)
is wrapped in a timer in both processes; the table gives each stage's mean in
microseconds per echo, beside the echo's own median and the device's own costs measured
in this process (a stream synchronisation, a copy, an allocation). Without CUDA it says
"no GPU" and exits 0.

It also times the sender's export of 1 MB on its own (one thread, no peer). The timers
cost a microsecond or two each (the line timers, Python 3.12's ``sys.monitoring``, more:
the echo runs slower here than in ``gpu.py``); stages nest (the caller's ``outgoing``
holds its ``_fill``), so rows do not add up to the echo. Before a run under NVIDIA's MPS,
start its daemon (``nvidia-cuda-mps-control -d``).
"""

from __future__ import annotations

import argparse
import functools
import linecache
import statistics
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

import torch

from gpu import _median_seconds, echo

_TIMES: Dict[str, List[float]] = {}


def _timed(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            _TIMES.setdefault(name, []).append(time.perf_counter() - start)
    return wrapper


_LINES: Dict[Tuple[str, int], List[float]] = {}  # (function, line) -> [seconds, hits]


def _line_timer(functions: List[Callable[..., Any]]) -> None:
    """Time each line of ``functions`` in every thread (``sys.monitoring``, Python 3.12+):
    the time from a line's start to the next line's start (or the return) goes to it."""
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is None:
        return
    tool = 5
    monitoring.use_tool_id(tool, "gpu_breakdown")
    last: Dict[int, Tuple[Any, int, float]] = {}
    codes = {fn.__code__: fn.__qualname__ for fn in functions}

    def close(now: float) -> None:
        prev = last.pop(threading.get_ident(), None)
        if prev is not None:
            row = _LINES.setdefault((codes[prev[0]], prev[1]), [0.0, 0])
            row[0] += now - prev[2]
            row[1] += 1

    def on_line(code: Any, line: int) -> None:
        now = time.perf_counter()
        prev = last.get(threading.get_ident())
        if prev is not None and prev[0] is not code:
            return  # a nested timed function's line: its caller's line goes on
        close(now)
        last[threading.get_ident()] = (code, line, time.perf_counter())

    def on_return(code: Any, offset: int, value: Any) -> None:
        prev = last.get(threading.get_ident())
        if prev is not None and prev[0] is code:
            close(time.perf_counter())

    monitoring.register_callback(tool, monitoring.events.LINE, on_line)
    monitoring.register_callback(tool, monitoring.events.PY_RETURN, on_return)
    for code in codes:
        monitoring.set_local_events(tool, code, monitoring.events.LINE | monitoring.events.PY_RETURN)


def _line_table(calls: int) -> List[str]:
    out = []
    for (name, line), (seconds, hits) in sorted(_LINES.items()):
        if seconds / calls >= 2e-6:
            out.append(f"    {name}:{line} {seconds / calls * 1e6:7.1f} us/echo x{hits / calls:.1f}  "
                       f"{linecache.getline(_FILES.get(name, ''), line).strip()[:90]}")
    _LINES.clear()
    return out


_FILES: Dict[str, str] = {}


_PATCHED = False


def _patch() -> None:
    """Timers around each stage of this process, once (module attributes: a pickled
    reference to ``_receive_group`` finds the wrapper, which keeps the function's name),
    and each line of the copy functions timed."""
    from machinlike.distributed._calls import cuda_ipc, cuda_ipc_area, cuda_ipc_open, cuda_stage, samehost, serve
    from machinlike.distributed._transport import lane, lane_server

    global _PATCHED
    if _PATCHED:
        return
    _PATCHED = True
    # (_encode: the walk both a reply (encode) and a call's arguments (outgoing) go through)
    timed_lines = [cuda_ipc._receive_group, cuda_ipc.Batch._fill, cuda_stage._encode]
    _FILES.update({fn.__qualname__: fn.__code__.co_filename for fn in timed_lines})
    _line_timer(timed_lines)
    samehost.outgoing = _timed("caller: outgoing (walk, copy into slab, record)", samehost.outgoing)
    cuda_stage._encode = _timed("either: cuda_stage._encode (walk, copies into slabs)", cuda_stage._encode)
    cuda_ipc.Batch._fill = _timed("either: Batch._fill (lease, copy into slab)", cuda_ipc.Batch._fill)
    cuda_ipc._receive_group = _timed("either: _receive_group (open, wait ready, copy out)", cuda_ipc._receive_group)
    cuda_ipc_open.OpenCache.open = _timed("either: OpenCache.open", cuda_ipc_open.OpenCache.open)
    cuda_ipc_open.OpenCache.control = _timed("either: OpenCache.control", cuda_ipc_open.OpenCache.control)
    cuda_ipc_area.ExportArea.lease = _timed("either: ExportArea.lease", cuda_ipc_area.ExportArea.lease)
    serve._reply = _timed("callee: samehost.reply", serve._reply)
    lane.request_bytes = _timed("caller: lane request_bytes", lane.request_bytes)
    lane.Lane.call_sync = _timed("caller: Lane.call_sync (send to woken)", lane.Lane.call_sync)
    lane_server.reply_bytes = _timed("callee: lane reply_bytes", lane_server.reply_bytes)
    lane_server.Server._run = _timed("callee: Server._run (loads, run, reply, send)", lane_server.Server._run)


def _take(calls: int = 1) -> Tuple[Dict[str, List[float]], List[str]]:
    out = {k: list(v) for k, v in _TIMES.items()}
    _TIMES.clear()
    return out, _line_table(calls)


def _body(world: Any, repeats: int) -> Any:
    torch.cuda.set_device(0)
    torch.cuda.init()
    _patch()
    group = world.create_rpc_group("breakdown", world.get_members())
    if world.rank == 1:
        group.register("echo", echo)
        group.register("take", _take)
    group.barrier()
    out: Dict[str, Any] = {}
    if world.rank == 0:
        from machinlike.distributed._calls import cuda_ipc
        from machinlike.distributed._transport import lane

        for megabytes in (1, 64):
            x = torch.ones(megabytes << 18, device="cuda")
            group.registered_sync("echo", (x,))  # probe, slabs, openings
            _take()
            group.registered_sync("take")
            median = _median_seconds(lambda: group.registered_sync("echo", (x,)), repeats)
            mine = _take(repeats + 5)
            theirs = group.registered_sync("take", (repeats + 5,))
            out[megabytes] = (median, repeats + 5, mine, theirs)
        out["stats"] = cuda_ipc.stats()
        current = lane.current()
        out["lane"] = current.stats() if current is not None else None
    group.barrier()
    group.destroy()
    return out


def _export_alone(repeats: int) -> Tuple[float, List[str]]:
    """The sender's part on its own (one thread, no peer): export a 1 MB tensor into a slab
    and release the lease; median seconds, and its lines."""
    import os

    from machinlike.distributed._calls import cuda_ipc, cuda_ipc_peers

    cuda_ipc.configure(256 << 20)
    x = torch.ones(1 << 18, device="cuda")
    target = (cuda_ipc.local_key(), os.getpid())
    area = cuda_ipc.export_area()

    def once() -> None:
        for lease in cuda_ipc_peers.export([x], target)[1]:
            area.release(lease)

    median = _median_seconds(once, repeats)
    lines = _line_table(repeats + 5)
    cuda_ipc.close()
    cuda_ipc.configure(0)
    return median, lines


def _device_costs() -> List[Tuple[str, float]]:
    torch.cuda.set_device(0)
    stream = torch.cuda.current_stream()
    a = torch.ones(16 << 20, device="cuda")
    b = torch.empty_like(a)
    small_a, small_b = a[: 1 << 18], b[: 1 << 18]

    def med(fn: Callable[[], Any], n: int = 200) -> float:
        for _ in range(10):
            fn()
        times = []
        for _ in range(n):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1e6

    rows = [("stream.synchronize(), idle stream", med(stream.synchronize)),
            ("torch.cuda.synchronize(), idle", med(torch.cuda.synchronize)),
            ("1 MB copy_ launch only", med(lambda: small_b.copy_(small_a))),
            ("1 MB copy_ + sync", med(lambda: (small_b.copy_(small_a), stream.synchronize()))),
            ("64 MB copy_ + sync", med(lambda: (b.copy_(a), stream.synchronize()))),
            ("torch.empty 1 MB (cached)", med(lambda: torch.empty(1 << 18, device="cuda"))),
            ("torch.empty 64 MB (cached)", med(lambda: torch.empty(16 << 20, device="cuda")))]
    event = torch.cuda.Event()
    rows.append(("event record + query", med(lambda: (event.record(), event.query()))))
    rows.append(("event record + synchronize", med(lambda: (event.record(), event.synchronize()))))
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--lane", choices=("on", "off"), default="on")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no GPU: benchmarks/gpu_breakdown.py has nothing to measure here")
        return 0
    from machinlike import launch

    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    for name, us in _device_costs():
        print(f"  {name:<40} {us:8.1f} us", flush=True)
    _patch()
    alone, lines = _export_alone(args.repeats)
    print(f"export of 1 MB alone (one thread, no peer): median {alone * 1e6:.1f} us", flush=True)
    print("\n".join(lines), flush=True)
    result = launch(_body, 2, args=(args.repeats,), timeout=240, rpc_timeout=60,
                    same_host_lane=args.lane == "on")[0]
    for megabytes in (1, 64):
        median, calls, mine, theirs = result[megabytes]
        print(f"{megabytes} MB echo (lane {args.lane}): median {median * 1e6:.0f} us over {args.repeats}", flush=True)
        for side, (table, lines) in (("caller", mine), ("callee", theirs)):
            for name, times in sorted(table.items(), key=lambda kv: -sum(kv[1])):
                print(f"  [{side}] {name:<52} {sum(times) / calls * 1e6:8.1f} us/echo "
                      f"({len(times) / calls:.1f}/echo, median {statistics.median(times) * 1e6:.1f} us)")
            print("\n".join(lines))
    print(f"ipc stats (caller): {result['stats']}")
    print(f"lane stats (caller): {result['lane']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
