"""What an idle member costs: raw torch RPC with TensorPipe's default transports against
``_transports=["uv"]``, side by side (issue 37).

Run:  python benchmarks/idle.py [--rounds 2] [--idle 5]

Two processes start raw torch RPC on this host; rank 0 times a small ``rpc_sync`` (a
no-op, median of 5 blocks of 200 calls), then sits idle for ``--idle`` seconds while its
CPU time is read from ``/proc/self/stat``. The default transports include shared memory,
whose reactor polls (a core's worth of spinning shared by the idle processes of a host);
``uv`` only (TCP over loopback) sleeps in epoll but each call takes a loopback round
trip. The configurations alternate, ``--rounds`` times each.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from typing import Any, Optional, Tuple

import torch.distributed.rpc as rpc
import torch.multiprocessing as mp


def noop() -> None:
    return None


def _cpu() -> float:
    with open("/proc/self/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as s:  # (a race with another binder is possible and harmless here: it fails loudly)
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, uv: bool, idle: float, out: Any) -> None:
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=4,
                                           rpc_timeout=60, _transports=["uv"] if uv else None)
    rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        for _ in range(200):
            rpc.rpc_sync("w1", noop)
        blocks = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(200):
                rpc.rpc_sync("w1", noop)
            blocks.append((time.perf_counter() - start) / 200)
        before = _cpu()
        time.sleep(idle)
        out.put((statistics.median(blocks) * 1e6, 100 * (_cpu() - before) / idle))
    rpc.shutdown(timeout=60)


def measure(uv: bool, idle: float) -> Optional[Tuple[float, float]]:
    """(small rpc_sync in us, idle CPU in % of a core) of rank 0; None if it did not answer in time."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, uv, idle, out)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        return out.get(timeout=120 + idle)
    except Exception:  # queue.Empty: a rank hung or died
        return None
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--idle", type=float, default=5.0, help="seconds idle while CPU is read")
    args = parser.parse_args()
    for _ in range(args.rounds):
        for uv in (False, True):
            got = measure(uv, args.idle)
            label = "uv only" if uv else "default (shm + uv)"
            print(f"transports {label:18s}: " + ("no answer" if got is None else
                                                 f"rpc_sync {got[0]:.0f} us, idle CPU {got[1]:.1f}% of a core"),
                  flush=True)


if __name__ == "__main__":
    main()
