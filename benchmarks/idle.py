"""What an idle member costs, and what a small call between two processes of one host
takes: raw torch RPC with TensorPipe's default transports, raw torch RPC with
``_transports=["uv"]``, and machinlike RpcGroup calls with the same-host lane (the
default) and without it (``same_host_lane=False``), side by side (issue 37).

Run:  python benchmarks/idle.py [--rounds 2] [--idle 5]

Two processes start RPC on this host; rank 0 times a small call (a no-op: ``rpc_sync``,
or ``registered_sync`` of a service of rank 1; median of 5 blocks of 200 calls), then sits
idle for ``--idle`` seconds while its CPU time is read from ``/proc/self/stat``. The
default transports include shared memory, whose reactor polls (a core's worth of
spinning shared by the idle processes of a host); ``uv`` only (TCP over loopback) sleeps
in epoll but each call takes a loopback round trip through more threads. machinlike's
lane is a Unix socket whose threads sleep in ``recv``; with it, TensorPipe runs on ``uv``
only. The configurations alternate, ``--rounds`` times each.
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


def _rank(rank: int, port: int, how: str, idle: float, out: Any) -> None:
    if how.startswith("raw"):
        opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=16,
                                               rpc_timeout=60, _transports=["uv"] if how == "raw uv" else None)
        rpc.init_rpc(f"w{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
        call = lambda: rpc.rpc_sync("w1", noop)  # noqa: E731
        stop = lambda: rpc.shutdown(timeout=60)  # noqa: E731
        barrier = None
    else:
        from machinlike.distributed import World

        world = World(str(rank), rank, 2, init_method=f"tcp://127.0.0.1:{port}", collective=False,
                      same_host_lane=how == "machinlike lane")
        group = world.create_rpc_group("g", ["0", "1"])
        if rank == 1:
            group.register("noop", noop)
        group.barrier()
        call = lambda: group.registered_sync("noop")  # noqa: E731
        stop = world.stop
        barrier = group.barrier
    if rank == 0:
        for _ in range(200):
            call()
        blocks = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(200):
                call()
            blocks.append((time.perf_counter() - start) / 200)
        before = _cpu()
        time.sleep(idle)
        out.put((statistics.median(blocks) * 1e6, 100 * (_cpu() - before) / idle))
    if barrier is not None:
        barrier(timeout=120 + idle)  # rank 1 stays until rank 0 measured
    stop()


HOWS = ("raw default", "raw uv", "machinlike lane", "machinlike no lane")


def measure(how: str, idle: float) -> Optional[Tuple[float, float]]:
    """(small call in us, idle CPU in % of a core) of rank 0; None if it did not answer in time."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, how, idle, out)) for r in range(2)]
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
    labels = {"raw default": "raw torch rpc_sync, default transports (shm + uv)",
              "raw uv": "raw torch rpc_sync, transports uv only",
              "machinlike lane": "machinlike registered_sync, same-host lane (default)",
              "machinlike no lane": "machinlike registered_sync, same_host_lane=False"}
    got: dict = {how: [] for how in HOWS}
    for _ in range(args.rounds):
        for how in HOWS:
            res = measure(how, args.idle)
            print(f"{labels[how]:52s}: " + ("no answer" if res is None else
                                             f"call {res[0]:.0f} us, idle CPU {res[1]:.1f}% of a core"), flush=True)
            if res is not None:
                got[how].append(res)
    if all(got.values()):
        med = {how: (statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs)) for how, rs in got.items()}
        lane, raw = med["machinlike lane"], med["raw default"]
        print(f"idle: lane {lane[1]:.1f}% of a core vs torch's default {raw[1]:.1f}%; small call: lane "
              f"{lane[0]:.0f} us vs torch's default {raw[0]:.0f} us (ratio {lane[0] / raw[0]:.2f}) and uv only "
              f"{med['raw uv'][0]:.0f} us")


if __name__ == "__main__":
    main()
