"""Open files a World costs, beside raw torch RPC, in one run; and the soft limit it starts under.

Run:  python benchmarks/descriptors.py [--sizes 4 12]

For each size N, N processes (spawned) form a static World whose rank 0 hosts the store,
every member registers a service, and rank 0 calls each member once (a learner that its
actors call, or that calls them: one RPC pipe to each either way). Then rank 0 and rank 1
count their descriptors by kind (``/proc/self/fd``). The peer: raw torch, N processes with
``init_process_group("gloo")`` and ``init_rpc`` (TensorPipe's default channels and
transports), rank 0 hosting the store and calling each rank once.

Printed: each process's count by kind, and the cost per member between the sizes (the
slope), which is what bounds a world under a limit of open files (``ulimit -n``). It also
prints the soft limit a World's process runs under (machinlike raises it to 65,536 or the
hard limit: ``machinlike/_descriptors.py``). Then the same slope for the process that
runs ``machinlike.launch`` (it hosts its ranks' store) and for a process pool's owner,
beside ``multiprocessing.Pool``'s.
"""

from __future__ import annotations

import argparse
import collections
import os
import resource
import socket
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch.multiprocessing as mp


def _kinds() -> Dict[str, int]:
    found: "collections.Counter[str]" = collections.Counter()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # (the listing's own descriptor, closed by now)
            continue
        found[target.split(":")[0].split("/")[1] if target.startswith("/") else target.split(":")[0]] += 1
    found["total"] = sum(found.values())
    return dict(found)


def _count() -> Tuple[Dict[str, int], int]:
    return _kinds(), resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def _rank(rank: int, n: int, mode: str, port: int, out: Any) -> None:
    if mode == "raw torch RPC":
        import torch.distributed as dist
        from torch.distributed import rpc
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=n)
        rpc.init_rpc(str(rank), rank=rank, world_size=n)
        dist.barrier()
        if rank == 0:
            others = [rpc.rpc_sync(str(r), _count) for r in range(1, n)]
            out.put((_count(), others[0]))
        dist.barrier()
        rpc.shutdown()
        return
    import machinlike
    with machinlike.World(name=str(rank), rank=rank, world_size=n, init_method=f"tcp://127.0.0.1:{port}") as world:
        group = world.create_rpc_group("fds", world.get_members())
        group.register(f"count/{rank}", _count)
        group.barrier()
        if rank == 0:
            others = [group.registered_sync(f"count/{r}") for r in range(1, n)]
            out.put((_count(), others[0]))
        group.barrier()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def measure(mode: str, n: int) -> Tuple[Tuple[Dict[str, int], int], Tuple[Dict[str, int], int]]:
    """(rank 0's, rank 1's) (descriptors by kind, soft limit) in a world of ``n``."""
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    procs = mp.start_processes(_rank, args=(n, mode, _free_port(), out), nprocs=n, start_method="spawn", join=False)
    first, second = out.get()
    while not procs.join(timeout=120):
        pass
    return first, second


def _launcher_count(world: Any, launcher: int) -> Optional[int]:
    group = world.create_rpc_group("fds", world.get_members())
    group.barrier()  # every rank has joined: the launcher holds what it holds for all of them
    count = len(os.listdir(f"/proc/{launcher}/fd")) if world.rank == 0 else None
    group.barrier()
    return count


def launcher(n: int) -> int:
    """Descriptors of the process running ``machinlike.launch`` of ``n`` ranks, mid-run."""
    import machinlike
    return machinlike.launch(_launcher_count, n, args=(os.getpid(),), timeout=300)[0]


def _square(x: int) -> int:
    return x * x


def pool_owner(kind: str, n: int) -> int:
    """Descriptors of a process holding a pool of ``n`` workers that ran a map."""
    if kind == "machinlike":
        from machinlike.pool import Pool
        with Pool(n) as pool:
            pool.map(_square, range(4 * n))
            return len(os.listdir("/proc/self/fd"))
    import multiprocessing
    with multiprocessing.get_context("forkserver").Pool(n) as pool:
        pool.map(_square, range(4 * n))
        return len(os.listdir("/proc/self/fd"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs=2, default=[4, 12], help="two world sizes (the slope between)")
    opts = parser.parse_args()
    small, large = opts.sizes
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    print(f"descriptors: this shell's limit of open files: soft {soft}, hard {hard}", flush=True)
    rows: List[Tuple[str, str, int, int, int, int]] = []
    for mode in ("machinlike", "raw torch RPC"):
        found = {n: measure(mode, n) for n in (small, large)}
        for index, role in ((0, "rank 0 (hosts the store, calls all)"), (1, "rank 1")):
            (a, limit), (b, _) = found[small][index], found[large][index]
            print(f"  {mode}, {role}: N={small} {a}; N={large} {b}; soft limit {limit}", flush=True)
            rows.append((mode, role, a["total"], b["total"], (b["total"] - a["total"]) // max(1, large - small), limit))
    print(f"descriptors per process (N={small} / N={large}, per member between them):")
    for mode, role, a, b, slope, limit in rows:
        print(f"  {mode:<14} {role:<36} {a:>5} / {b:>5}   {slope:>3} a member   (ran under a soft limit of {limit})")
    ours = next(r for r in rows if r[0] == "machinlike" and r[1].startswith("rank 0"))
    raw = next(r for r in rows if r[0] != "machinlike" and r[1].startswith("rank 0"))
    fit_ours = (1024 - ours[2]) // max(1, ours[4]) + small
    fit_raw = (1024 - raw[2]) // max(1, raw[4]) + small
    print(f"rank 0 per member: machinlike {ours[4]}, raw torch RPC {raw[4]} ({raw[4] / max(1, ours[4]):.1f}x); "
          f"members that fit a soft limit of 1,024 at rank 0: machinlike {fit_ours}, raw {fit_raw}")
    a, b = launcher(small), launcher(large)
    print(f"launch()'s own process (hosts the ranks' store): {a} / {b} at {small} / {large} ranks, "
          f"{(b - a) / max(1, large - small):.1f} a rank", flush=True)
    for kind in ("machinlike", "multiprocessing.Pool"):
        a, b = pool_owner(kind, small), pool_owner(kind, large * 2)
        print(f"{kind} owner: {a} / {b} at {small} / {large * 2} workers, "
              f"{(b - a) / max(1, large * 2 - small):.1f} a worker", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
