"""Replies through torch RPC: what their claim costs, and what late ones used to leave lent.

Run:  python benchmarks/reply_leases.py [--quick]

Two local processes, ``same_host_lane=False`` (torch RPC carries every call, as it does for
a peer without a lane or a call inside a distributed autograd context). Prints:

* a CPU tensor echoed through ``registered_sync`` (256 KiB, 1 MiB, 16 MiB), its reply
  taken under the claim (a ``flock`` of the segment, ``_shm._segments``) against the same
  reply taken plainly (the claim turned off in the callee), blocks alternated so that noise
  hits both: the ratio is the claim's cost;
* ``--late`` replies of 4 MiB made just before their caller's deadline that leave after it
  (their carrier pickles them slowly), so torch RPC drops each unread: the segments the
  callee holds lent then, and once ``ABANDON_AFTER_S`` (1 s here) passed. Before the
  claim, every one stayed lent while the caller lived;
* what the same claim costs a CUDA IPC reply's receiver (``cuda_ipc_claim.take``: an OFD
  lock on the slab's row of the sender's control page, taken through a descriptor of its
  own) against taking the row plainly, in this process: no GPU needed, the page is a memfd.
  The whole of such a reply, a 1 MB echo on an H100, is a 0.3 ms target.
"""

from __future__ import annotations

import argparse
import time

import torch

from machinlike import _shm
from machinlike._shm import _segments
from machinlike.distributed import get_world
from machinlike.distributed._calls import cuda_ipc_area, cuda_ipc_claim
from machinlike.testing import run_world

SIZES = (256 << 10, 1 << 20, 16 << 20)


def _echo(x):
    return x


def _claims(on: bool) -> None:
    # The callee's replies lend with the claim (the default) or without it (as before).
    _shm.give_up_time = _GIVE_UP if on else (lambda terms: 0.0)


_GIVE_UP = _shm.give_up_time


class _SlowToPickle:
    """Pickled for ``pause`` s, after the reply's tensors were lent: the reply leaves late."""

    def __init__(self, pause: float) -> None:
        self.pause = pause

    def __reduce__(self):
        time.sleep(self.pause)
        return (_SlowToPickle, (0.0,))


def _late():
    return torch.ones(1 << 20), _SlowToPickle(0.6)


def _lent():
    shm = get_world().transport_stats()["shm"]
    return shm["lent"], shm["abandoned"]


def _body(world, calls: int, blocks: int, late: int):
    g = world.create_rpc_group("g", world.get_members())
    if world.rank == 1:
        _segments.ABANDON_AFTER_S = 1.0
        for name, fn in (("echo", _echo), ("claims", _claims), ("late", _late), ("lent", _lent)):
            g.register(name, fn)
    g.barrier()
    out = {}
    if world.rank == 0:
        for size in SIZES:
            x = torch.rand(size // 4)
            best = {True: float("inf"), False: float("inf")}
            for _ in range(blocks):
                for on in (True, False):
                    g.registered_sync("claims", args=(on,))
                    for _ in range(calls // 5):  # (warm)
                        g.registered_sync("echo", args=(x,))
                    start = time.perf_counter()
                    for _ in range(calls):
                        g.registered_sync("echo", args=(x,))
                    best[on] = min(best[on], (time.perf_counter() - start) / calls)
            out[size] = best
        g.registered_sync("claims", args=(True,))
        futures = [g.registered_async("late", timeout=0.3) for _ in range(late)]
        for fut in futures:
            try:
                fut.wait()
            except TimeoutError:
                pass
        time.sleep(0.5)  # (the replies leave 0.6 s after their calls, 0.9 s before they are abandoned)
        out["late_lent"] = g.registered_sync("lent")
        deadline = time.monotonic() + 10
        while g.registered_sync("lent")[0] and time.monotonic() < deadline:
            time.sleep(0.1)
        out["after"] = g.registered_sync("lent")
    g.barrier()
    return out


def _row_claim(rounds: int):
    """Microseconds per ``take`` of a CUDA slab's row, under the claim and plainly (best of
    5 blocks, alternated)."""
    import os

    area = cuda_ipc_area.ExportArea(0)  # (its control page only: no slab is made)
    best = {True: float("inf"), False: float("inf")}
    try:
        for _ in range(5):
            for claimed in (True, False):
                give_up = time.monotonic() + 3600 if claimed else 0.0
                started = time.perf_counter()
                for i in range(rounds):
                    area.words[0] = (i + 1, os.getpid(), 7, 0)  # lease i + 1 of slab 7, lent to this process
                    cuda_ipc_claim.take(os.getpid(), area.fd, area.inode, area.words, 0, 0, 7, i + 1, give_up)
                best[claimed] = min(best[claimed], (time.perf_counter() - started) / rounds * 1e6)
    finally:
        area.close()
    return best[True], best[False]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    parser.add_argument("--late", type=int, default=10, help="late replies to make at once (default 10; the "
                        "callee's torch RPC threads must run them all at once)")
    args = parser.parse_args()
    calls, blocks = (50, 2) if args.quick else (200, 5)
    out = run_world(_body, 2, args=(calls, blocks, args.late), timeout=900, same_host_lane=False)[0]
    print("echo through torch RPC (best of blocks, us per call): claim / plain = ratio")
    for size in SIZES:
        claim, plain = out[size][True] * 1e6, out[size][False] * 1e6
        print(f"  {size >> 10:>6} KiB   {claim:8.0f} / {plain:8.0f} = {claim / plain:.2f}")
    lent, abandoned = out["late_lent"]
    print(f"{args.late} late replies dropped unread by torch RPC: {lent} segments lent once sent "
          f"(each stayed lent while the caller lived, before); after ABANDON_AFTER_S: {out['after'][0]} lent, "
          f"{out['after'][1]} abandoned")
    claimed, plain = _row_claim(2000 if args.quick else 20000)
    print(f"CUDA IPC reply, its receiver taking the slab's row: {claimed:.1f} us under the claim, {plain:.1f} us "
          f"plainly; the claim is {(claimed - plain) / 300 * 100:.1f}% of the 0.3 ms target of a 1 MB echo")


if __name__ == "__main__":
    main()
