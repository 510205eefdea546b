"""machinlike.pool against the pools a PyTorch user would otherwise pick, in one run.

Peers: ``multiprocessing.Pool`` (spawn), a ``torch.multiprocessing`` spawn pool, and
where installed ``multiprocess.Pool`` (dill; spawn like the others, because its default,
fork, can deadlock in a process that already runs torch's threads) and loky's reusable
executor (cloudpickle). Two workers each.

Figures:

* start-up to first result, each peer in a fresh interpreter that imported torch first
  ("first"), and a second pool in the same interpreter ("next");
* chunksize-1 throughput: N ``apply_async`` calls of a trivial task (loky: ``submit``),
  then every result;
* chunked ``map`` of 20,000 trivial tasks (default chunk size: about 4 chunks per worker);
* round trip of a 256 MB float32 CPU tensor whose worker returns its sum: copy mode with a
  fresh tensor (GB/s), share mode with a fresh tensor (GB/s), and share mode with an
  already-shared tensor (milliseconds beyond the worker's own compute time, measured in
  the worker). ``import torch`` registers torch's reducers with ``multiprocessing``, so
  the stdlib and torch.mp pools *share* tensors (torch's fd path) in every row;
  multiprocess and loky copy them through their pipes.

Ratios are machinlike's figure against the peer's, oriented so that above 1 means
machinlike is better (peer time / our time, our rate / peer rate). Every figure is the
median of its repetitions.

Run: ``python benchmarks/pool.py`` (``--quick``: fewer repetitions and smaller N;
``--skip-startup``; ``--skip-tensor``).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import multiprocessing
import os
import statistics
import subprocess
import sys
import textwrap
import time
from typing import Any, Callable, Dict, List, Optional

import torch

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH_DIR)
sys.path[:0] = [BENCH_DIR, ROOT]  # the tasks module, and this checkout's machinlike

from _pool_tasks import square, timed_sum  # noqa: E402

from machinlike.pool import P2PPool, Pool  # noqa: E402

WORKERS = 2
IMAP_CHUNK = 64  # imap of small tasks, chunked as a user of many small items would
TENSOR_NUMEL = 64 * 1024 * 1024  # float32: 256 MiB
HAVE_MULTIPROCESS = importlib.util.find_spec("multiprocess") is not None
HAVE_LOKY = importlib.util.find_spec("loky") is not None


# ----------------------------------------------------------------------------- peers


class Peer:
    """A pool under a common interface: apply_async-like submit, map, close."""

    def __init__(self, name: str) -> None:
        self.name = name

    def submit(self, func: Callable[..., Any], *args: Any) -> Any:
        raise NotImplementedError

    def get(self, handle: Any) -> Any:
        return handle.get()

    def map(self, func: Callable[..., Any], items: List[Any]) -> List[Any]:
        return self.pool.map(func, items)

    def imap(self, func: Callable[..., Any], items: List[Any]) -> List[Any]:
        """One item a task, results in order as they come (lazy input)."""
        return list(self.pool.imap(func, items, chunksize=1))

    def imap_chunked(self, func: Callable[..., Any], items: List[Any]) -> List[Any]:
        """Small tasks 64 to a chunk, results read one by one as they come."""
        return list(self.pool.imap(func, items, chunksize=IMAP_CHUNK))

    def close(self) -> None:
        self.pool.terminate()


class StdPool(Peer):
    def __init__(self, name: str, pool: Any) -> None:
        super().__init__(name)
        self.pool = pool

    def submit(self, func: Callable[..., Any], *args: Any) -> Any:
        return self.pool.apply_async(func, args)


class LokyPeer(Peer):
    def __init__(self) -> None:
        super().__init__("loky")
        from loky import get_reusable_executor

        self.pool = get_reusable_executor(max_workers=WORKERS, timeout=None)

    def submit(self, func: Callable[..., Any], *args: Any) -> Any:
        return self.pool.submit(func, *args)

    def get(self, handle: Any) -> Any:
        return handle.result()

    def map(self, func: Callable[..., Any], items: List[Any]) -> List[Any]:
        chunksize = math.ceil(len(items) / (WORKERS * 4))
        return list(self.pool.map(func, items, chunksize=chunksize))

    def imap(self, func: Callable[..., Any], items: List[Any]) -> List[Any]:
        return list(self.pool.map(func, items, chunksize=1))  # (an executor's map is its imap)

    def imap_chunked(self, func: Callable[..., Any], items: List[Any]) -> List[Any]:
        return list(self.pool.map(func, items, chunksize=IMAP_CHUNK))

    def close(self) -> None:
        self.pool.shutdown(wait=True, kill_workers=True)


def make_peers(include_p2p: bool = True) -> List[Peer]:
    peers: List[Peer] = [StdPool("machinlike Pool", Pool(WORKERS))]
    if include_p2p:
        peers.append(StdPool("machinlike P2PPool", P2PPool(WORKERS)))
    peers.append(StdPool("stdlib spawn Pool", multiprocessing.get_context("spawn").Pool(WORKERS)))
    import torch.multiprocessing as torch_mp

    peers.append(StdPool("torch.mp spawn Pool", torch_mp.get_context("spawn").Pool(WORKERS)))
    if HAVE_MULTIPROCESS:
        import multiprocess

        peers.append(StdPool("multiprocess Pool", multiprocess.get_context("spawn").Pool(WORKERS)))
    if HAVE_LOKY:
        peers.append(LokyPeer())
    return peers


# ----------------------------------------------------------------------------- start-up

_STARTUP = {
    "machinlike Pool": ("from machinlike.pool import Pool", "Pool(2)", "p.apply(square, (1,))", "p.terminate()"),
    "stdlib spawn Pool": (
        "import multiprocessing as mp", "mp.get_context('spawn').Pool(2)", "p.apply(square, (1,))", "p.terminate()"
    ),
    "torch.mp spawn Pool": (
        "import torch.multiprocessing as tmp", "tmp.get_context('spawn').Pool(2)", "p.apply(square, (1,))",
        "p.terminate()",
    ),
    "multiprocess Pool": ("import multiprocess", "multiprocess.get_context('spawn').Pool(2)", "p.apply(square, (1,))", "p.terminate()"),
    "loky": (
        "from loky import get_reusable_executor",
        "get_reusable_executor(max_workers=2, timeout=None)",
        "p.submit(square, 1).result()",
        "p.shutdown(wait=True, kill_workers=True)",
    ),
}


def startup(name: str) -> Dict[str, float]:
    imports, make, first, stop = _STARTUP[name]
    script = textwrap.dedent(
        f"""
        import json, sys, time
        import torch
        sys.path.insert(0, {BENCH_DIR!r})
        from _pool_tasks import square
        {imports}
        times = []
        for _ in range(2):
            begin = time.perf_counter()
            p = {make}
            {first}
            times.append(time.perf_counter() - begin)
            {stop}
        print(json.dumps({{"first": times[0], "next": times[1]}}))
        """
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"start-up script for {name} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- figures


def median_of(reps: int, measure: Callable[[], float]) -> float:
    return statistics.median(measure() for _ in range(reps))


def apply_rate(peer: Peer, count: int) -> float:
    begin = time.perf_counter()
    handles = [peer.submit(square, i) for i in range(count)]
    for handle in handles:
        peer.get(handle)
    return count / (time.perf_counter() - begin)


def items_rate(run: Callable[[Callable[..., Any], List[Any]], List[Any]], count: int) -> float:
    """Items per second of ``run(square, items)`` (a peer's map or imap) over ``count`` items."""
    items = list(range(count))
    begin = time.perf_counter()
    result = run(square, items)
    elapsed = time.perf_counter() - begin
    assert result[-1] == (count - 1) ** 2
    return count / elapsed


def round_trip(peer: Peer, tensor: torch.Tensor) -> tuple:
    begin = time.perf_counter()
    total, compute = peer.get(peer.submit(timed_sum, tensor))
    return time.perf_counter() - begin, compute


# ----------------------------------------------------------------------------- output


def ratio(ours: float, theirs: float, higher_is_better: bool) -> str:
    if not ours or not theirs:
        return "-"
    return f"{(ours / theirs) if higher_is_better else (theirs / ours):.2f}x"


def table(title: str, columns: List[str], rows: List[tuple], unit_width: int = 14) -> None:
    print(f"\n{title}")
    width = max(len(r[0]) for r in rows) + 2
    print(" " * width + "".join(f"{c:>{unit_width}}" for c in columns))
    for label, *cells in rows:
        print(f"{label:<{width}}" + "".join(f"{c:>{unit_width}}" for c in cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, smaller N")
    parser.add_argument("--skip-startup", action="store_true")
    parser.add_argument("--skip-tensor", action="store_true")
    options = parser.parse_args()
    reps = 2 if options.quick else 3
    apply_count = 4000 if options.quick else 20000
    map_count = 20000
    print(f"machinlike.pool benchmark: {WORKERS} workers, torch {torch.__version__}, "
          f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}", flush=True)

    if not options.skip_startup:
        names = [n for n in _STARTUP if (n != "multiprocess Pool" or HAVE_MULTIPROCESS) and (n != "loky" or HAVE_LOKY)]
        results = {name: startup(name) for name in names}
        ours = results["machinlike Pool"]
        rows = [(name, f"{r['first']:.3f}", f"{r['next']:.3f}",
                 ratio(ours["first"], r["first"], False), ratio(ours["next"], r["next"], False))
                for name, r in results.items()]
        table("Start-up to first result, s (fresh interpreter that imported torch; ratio: peer / machinlike)",
              ["first pool", "next pool", "first ratio", "next ratio"], rows)

    peers = make_peers()
    try:
        for peer in peers:  # warm up: workers up, code paths and caches primed
            peer.get(peer.submit(square, 1))
            peer.map(square, list(range(1000)))
        rates: Dict[str, Dict[str, float]] = {}
        for peer in peers:
            rates[peer.name] = {
                "apply": median_of(reps, lambda: apply_rate(peer, apply_count)),
                "map": median_of(reps, lambda: items_rate(peer.map, map_count)),
                "imap": median_of(reps, lambda: items_rate(peer.imap, apply_count)),
                "imap64": median_of(reps, lambda: items_rate(peer.imap_chunked, map_count * 5)),
            }
            print(f"  measured {peer.name}", flush=True)
        ours = rates["machinlike Pool"]
        p2p = rates["machinlike P2PPool"]
        rows = []
        for name, r in rates.items():
            rows.append((name, f"{r['apply']:,.0f}", f"{r['map']:,.0f}", f"{r['imap']:,.0f}",
                         f"{r['imap64']:,.0f}",
                         ratio(ours["apply"], r["apply"], True), ratio(ours["map"], r["map"], True),
                         ratio(ours["imap64"], r["imap64"], True),
                         ratio(p2p["apply"], r["apply"], True), ratio(p2p["imap"], r["imap"], True)))
        table(f"Throughput, tasks/s (chunksize 1: {apply_count} apply_async; chunked: map of {map_count}; "
              f"imap of {apply_count} at chunksize 1; imap of {map_count * 5} at chunksize {IMAP_CHUNK}); "
              "ratio: machinlike / peer",
              ["chunksize 1", "chunked map", "imap c1", f"imap c{IMAP_CHUNK}", "Pool c1", "Pool map",
               f"Pool imap{IMAP_CHUNK}", "P2P c1", "P2P imap"], rows, unit_width=12)
    finally:
        for peer in peers:
            peer.close()

    if not options.skip_tensor:
        tensor_rows(reps)
    print(f"\nload average at the end: {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")


def tensor_rows(reps: int) -> None:
    nbytes = TENSOR_NUMEL * 4
    gb = nbytes / 1e9
    import torch.multiprocessing as torch_mp

    contenders: List[tuple] = [
        ("machinlike Pool (copy)", lambda: StdPool("x", Pool(WORKERS)), "copy"),
        ("machinlike Pool (share cpu)",
         lambda: StdPool("x", Pool(WORKERS, is_copy_tensor=False, share_method="cpu")), "share"),
        ("torch.mp spawn Pool (shares)", lambda: StdPool("x", torch_mp.get_context("spawn").Pool(WORKERS)), "share"),
        ("stdlib spawn Pool (shares)",
         lambda: StdPool("x", multiprocessing.get_context("spawn").Pool(WORKERS)), "share"),
    ]
    if HAVE_MULTIPROCESS:
        import multiprocess

        contenders.append(("multiprocess Pool (copies)", lambda: StdPool("x", multiprocess.get_context("spawn").Pool(WORKERS)), "copy"))
    if HAVE_LOKY:
        contenders.append(("loky (copies)", LokyPeer, "copy"))
    rows = []
    figures: Dict[str, Dict[str, Optional[float]]] = {}
    for label, make, mode in contenders:
        peer = make()
        try:
            peer.get(peer.submit(timed_sum, torch.ones(1024)))
            peer.get(peer.submit(timed_sum, torch.rand(TENSOR_NUMEL)))  # warm-up: shared-memory manager etc.
            fresh = []
            for _ in range(reps):
                tensor = torch.rand(TENSOR_NUMEL)
                fresh.append(round_trip(peer, tensor)[0])
                del tensor
            fresh_rate = gb / statistics.median(fresh)
            overhead: Optional[float] = None
            if mode == "share":
                tensor = torch.rand(TENSOR_NUMEL)
                if label.startswith(("torch", "stdlib")):
                    tensor.share_memory_()  # torch's own way to share a tensor
                else:
                    round_trip(peer, tensor)  # machinlike: the first trip moves it to shared memory
                extra = []
                for _ in range(max(reps, 5)):
                    total, compute = round_trip(peer, tensor)
                    extra.append(total - compute)
                overhead = statistics.median(extra) * 1e3
                del tensor
        finally:
            peer.close()
        figures[label] = {"fresh": fresh_rate, "overhead": overhead}
        rows.append((label, f"{fresh_rate:.2f}", "-" if overhead is None else f"{overhead:.2f}"))
        print(f"  measured {label}", flush=True)
    copy = figures["machinlike Pool (copy)"]["fresh"]
    share = figures["machinlike Pool (share cpu)"]
    rows = [row + (ratio(copy, figures[row[0]]["fresh"], True), ratio(share["fresh"], figures[row[0]]["fresh"], True),
                   "-" if figures[row[0]]["overhead"] is None else ratio(share["overhead"], figures[row[0]]["overhead"], False))
            for row in rows]
    table("256 MB CPU tensor round trip, worker returns its sum (fresh: GB/s; already shared: ms beyond the "
          "worker's compute); ratio: machinlike / peer",
          ["fresh GB/s", "shared +ms", "copy vs", "share vs", "shared vs"], rows, unit_width=13)


if __name__ == "__main__":
    main()
