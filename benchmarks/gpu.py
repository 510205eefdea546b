"""CUDA paths of machinlike against raw torch, side by side in one run (one command on a GPU).

Run:  python benchmarks/gpu.py [--quick] [--only-echo] [--lane off]

On a machine without CUDA it prints "no GPU" and exits 0. With a GPU, every process on
cuda:0, it prints each figure of issue 36's targets as it is measured (and a table at the
end), beside raw torch RPC with a hand-written device map and beside ``torch.multiprocessing``
CUDA IPC where they have one:

1. Echo (there and back) of a 64 MB and of a 1 MB CUDA tensor through ``registered_sync``
   (CUDA IPC between the two processes, ``distributed._calls.cuda_ipc``); a call with no tensor.
   Targets: 64 MB >= 3x raw torch RPC with a map; 1 MB round trip <= 0.3 ms.
2. The model server on the same GPU: a 512 MB push (target <= 10 ms), then pulls of one
   version into 8 processes at once (target <= 30 ms from the first start to the last end).
3. Churn: pushes of a 64 MB model while pullers are SIGKILLed one by one (mid-transfer):
   the server's ``torch.cuda.memory_reserved()`` once every puller pulls, before the first
   SIGKILL, and at the end (target: flat, plus 10% at most; the pushes are paced over the
   kills), with the server's GPU memory as the driver reports it (``nvidia-smi``, where it
   lists the server's pid), and the survivor's slowest pull (nothing waits out a timeout).
4. The pool, ``share_method="cuda"``, 512 MB there and back, against copy mode.

On one GPU, the processes of a host take turns on it (time slicing): each direction of an
echo pays the GPU's switch between their contexts, about 150 us on an H100
(``benchmarks/gpu_breakdown.py`` shows where the time goes). NVIDIA's MPS daemon
(``nvidia-cuda-mps-control -d`` before the run) lets their work share the GPU without it.

Figures are medians over repetitions; every CUDA timing synchronises the device first.
Sizes are modest so that the run takes about three minutes on an H100.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn
from torch.distributed import rpc

ECHO_MB = 64
SMALL_MB = 1
MODEL_MB = 512
PULLERS = 8
CHURN_MB = 64
_FIRST_KILL_S = 1.0  # churn: seconds before the first puller is SIGKILLed (the baseline is taken before)


def say(text: str) -> None:
    print(text, flush=True)


# ---------------------------------------------------------------- shared helpers
def echo(x: Any) -> Any:
    return x


def nothing() -> None:
    return None


def touch(x: torch.Tensor) -> torch.Tensor:
    x.add_(1)
    return x


def _median_seconds(fn: Callable[[], Any], repeats: int, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _mb(megabytes: float) -> torch.Tensor:
    return torch.ones(int(megabytes * 1024 * 1024) // 4, device="cuda")


# ---------------------------------------------------------------- raw torch RPC with a map
def _raw_worker(rank: int, port: int, repeats: int, out: Any) -> None:
    torch.cuda.set_device(0)
    options = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{port}", num_worker_threads=16,
                                              rpc_timeout=120)
    if rank == 0:
        options.set_device_map("1", {0: 0})  # the hand-written map a user of raw torch writes
    rpc.init_rpc(str(rank), rank=rank, world_size=2, rpc_backend_options=options)
    if rank == 0:
        big, small = _mb(ECHO_MB), _mb(SMALL_MB)
        out.put({"echo": _median_seconds(lambda: rpc.rpc_sync("1", echo, args=(big,)), 5 * repeats),
                 "small": _median_seconds(lambda: rpc.rpc_sync("1", echo, args=(small,)), 20 * repeats),
                 "call": _median_seconds(lambda: rpc.rpc_sync("1", nothing), 20 * repeats)})
    rpc.shutdown()


def raw_rpc(repeats: int) -> Dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.SimpleQueue()
    port = _free_port()
    procs = [ctx.Process(target=_raw_worker, args=(rank, port, repeats, out)) for rank in range(2)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(300)
        if proc.is_alive():
            proc.kill()
            raise TimeoutError("the raw torch RPC echo did not finish in 300 s")
        if proc.exitcode != 0:
            raise RuntimeError(f"a raw torch RPC process exited with {proc.exitcode}")
    return out.get()


# ---------------------------------------------------------------- torch.multiprocessing CUDA IPC
def _mp_echo_worker(inbox: Any, outbox: Any) -> None:
    torch.cuda.set_device(0)
    while True:
        x = inbox.get()
        if x is None:
            return
        outbox.put(x.clone())  # the receiver owns a copy; sent back through IPC again
        del x


def mp_echo(repeats: int) -> Dict[str, float]:
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_mp_echo_worker, args=(inbox, outbox), daemon=True)
    proc.start()
    out = {}
    try:
        for label, megabytes, n in (("echo", ECHO_MB, 5 * repeats), ("small", SMALL_MB, 20 * repeats)):
            x = _mb(megabytes)

            def once() -> None:
                inbox.put(x)
                back = outbox.get(timeout=60)
                back.sum()  # use it, as a receiver would
                del back

            out[label] = _median_seconds(once, n)
    finally:
        inbox.put(None)
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    return out


# ---------------------------------------------------------------- machinlike: echoes, push
class _Big(nn.Module):
    def __init__(self, megabytes: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(_mb(megabytes))


def _stats_here() -> Dict[str, int]:
    from machinlike.distributed._calls import cuda_ipc as _cuda_ipc

    return _cuda_ipc.stats()


def _echo_body(world: Any, repeats: int) -> Dict[str, Any]:
    from machinlike.server import PushPullModelServerImpl

    torch.cuda.set_device(0)
    torch.cuda.init()
    group = world.create_rpc_group("gpu_echo", world.get_members())
    impl = None
    if world.rank == 1:
        group.register("echo", echo)
        group.register("nothing", nothing)
        impl = PushPullModelServerImpl("model", group)
    group.barrier()
    results: Dict[str, Any] = {}
    if world.rank == 0:
        big, small = _mb(ECHO_MB), _mb(SMALL_MB)
        try:
            back = group.registered_sync("echo", (big,))
            assert back.device.type == "cuda" and torch.equal(back, big)
            results["echo"] = _median_seconds(lambda: group.registered_sync("echo", (big,)), 5 * repeats)
            results["small"] = _median_seconds(lambda: group.registered_sync("echo", (small,)), 20 * repeats)
        except Exception as err:  # a CUDA path that fails: the row says why
            results["echo_error"] = f"{type(err).__name__}: {str(err).splitlines()[0][:110]}"
        results["call"] = _median_seconds(lambda: group.registered_sync("nothing"), 20 * repeats)
        say(f"  echo done: {results}")
        server = group.get_paired("model").to_here()
        pusher = _Big(MODEL_MB)
        results["push"] = _median_seconds(lambda: server.push(pusher), repeats, warmup=1)
        say(f"  push done: {results['push'] * 1e3:.2f} ms")
        results["stats_caller"] = _stats_here()
        results["stats_callee"] = group.rpc_sync("1", _stats_here)
    group.barrier()
    if impl is not None:
        impl.close()
    group.barrier()
    group.destroy()
    return results


# ---------------------------------------------------------------- machinlike: pulls into 8
def _pulls_body(world: Any, repeats: int) -> Any:
    from machinlike.server import PushPullModelServerImpl

    torch.cuda.set_device(0)
    torch.cuda.init()
    group = world.create_rpc_group("gpu_pulls", world.get_members())
    impl = PushPullModelServerImpl("model", group) if world.rank == 0 else None
    group.barrier()
    server = group.get_paired("model").to_here()
    model: Any = _Big(MODEL_MB) if world.rank >= 1 else None
    spans: List[Tuple[float, float]] = []
    for round_ in range(1 + repeats):  # the first round warms up (probes, slabs, openings)
        if world.rank == 1:
            model.weight.data.fill_(round_)
            assert server.push(model)
            torch.cuda.synchronize()
        group.barrier()
        if world.rank >= 2:
            start = time.time()
            assert server.pull(model)
            torch.cuda.synchronize()
            spans.append((start, time.time()))
            assert float(model.weight[0]) == round_
        group.barrier()
    if impl is not None:
        impl.close()
    group.barrier()
    group.destroy()
    return spans


# ---------------------------------------------------------------- machinlike: churn
def _reserved() -> Tuple[int, int]:
    """The server's reserved GPU memory, and the part its CUDA IPC export slabs hold."""
    from machinlike.distributed._calls import cuda_ipc as _cuda_ipc

    torch.cuda.synchronize()
    return torch.cuda.memory_reserved(), _cuda_ipc.stats().get("area_held_bytes", 0)


def driver_mib(pid: Optional[int] = None) -> Optional[int]:
    """GPU memory of process ``pid`` (default: this one) as the driver reports it, in MiB
    (``nvidia-smi``'s per-process figure: the process's own allocations and context);
    None where it lists no such pid (no ``nvidia-smi``, or a container's pid namespace)."""
    wanted = str(os.getpid() if pid is None else pid)
    try:
        listed = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                                capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in listed.splitlines():
        found, _, used = (part.strip() for part in line.partition(","))
        if found == wanted and used.isdigit():
            return int(used)
    return None


def _area_stats() -> Dict[str, int]:
    """The server's export area counters: slabs made, waits for a taker's last slab, reclaims."""
    from machinlike.distributed._calls import cuda_ipc as _cuda_ipc

    return {k: v for k, v in _cuda_ipc.stats().items() if k.startswith("area_")}


def _churn_body(world: Any, pushes: int, victims: int) -> Any:
    from machinlike.server import PushPullModelServerImpl

    torch.cuda.set_device(0)
    torch.cuda.init()
    name = world.name
    if name.startswith("victim") and world.incarnation > 1:
        return None  # a killed puller's replacement: nothing more to do
    group = world.create_rpc_group("gpu_churn", ["server", "pusher", "survivor"] + [f"victim{i}" for i in range(victims)])
    finished = threading.Semaphore(0)
    impl: Any = None
    if name == "server":
        impl = PushPullModelServerImpl("model", group)
        group.register("reserved", _reserved)
        group.register("area", _area_stats)
        group.register("driver", driver_mib)
        group.register("finished", finished.release)
    group.barrier(timeout=120)
    if name == "server":  # until the pusher and the survivor are through (no barrier: victims die)
        ok = finished.acquire(timeout=240) and finished.acquire(timeout=240)
        impl.close()
        return ok
    server = group.get_paired("model").to_here()
    model = _Big(CHURN_MB)
    out: Any = None
    if name == "pusher":
        first = first_driver = None
        samples = []  # (push, reserved MiB, export slabs MiB): growth per death would show as a climb
        # Paced over the victims' whole kill window: pushes that all ran before the last
        # victim died would end the server under live pullers, and no SIGKILL would land.
        window = _FIRST_KILL_S + victims * 0.25 + 0.6
        began = time.monotonic()
        for i in range(pushes):
            late = began + window * i / pushes - time.monotonic()
            if late > 0:
                time.sleep(late)
            # The baseline: every puller pulling (their slabs made), none killed yet.
            if first is None and time.monotonic() - began >= _FIRST_KILL_S - 0.2:
                first = group.registered_sync("reserved")
                first_driver = group.registered_sync("driver")
            model.weight.data.fill_(i)
            assert server.push(model)
            if i % max(1, pushes // 4) == 0:
                reserved, slabs = group.registered_sync("reserved")
                samples.append((i, reserved >> 20, slabs >> 20))
        out = {"first": first, "last": group.registered_sync("reserved"), "samples": samples,
               "area": group.registered_sync("area"), "driver": (first_driver, group.registered_sync("driver"))}
    elif name == "survivor":
        slowest = 0.0
        while True:
            start = time.perf_counter()
            server.pull(model)
            slowest = max(slowest, time.perf_counter() - start)
            if getattr(model, "pp_version", 0) >= pushes:
                break
        from machinlike.distributed._calls import cuda_ipc as _cuda_ipc

        counts = _cuda_ipc.stats()  # (its leases of the server's slabs ended before each next pull)
        out = {"slowest_pull": slowest, "flush": {k: counts.get(k, 0) for k in ("flush_waits", "flush_late")}}
    else:
        index = int(name[len("victim"):])
        # one by one, while pulls are in flight: a thread kills the process mid-transfer
        delay = _FIRST_KILL_S + index * 0.25 + random.random() * 0.1
        threading.Timer(delay, os.kill, (os.getpid(), signal.SIGKILL)).start()
        while True:
            server.pull(model)
    group.registered_sync("finished")
    return out


def churn(pushes: int, victims: int) -> Dict[str, Any]:
    from machinlike import launch

    names = ["server", "pusher", "survivor"] + [f"victim{i}" for i in range(victims)]
    start = time.monotonic()
    result = launch(_churn_body, len(names), args=(pushes, victims), names=names, max_restarts=victims,
                    essential=["server", "pusher", "survivor"], timeout=300, rpc_timeout=60,
                    return_exceptions=True)
    return {"pusher": result[1], "survivor": result[2], "restarts": len(result.restarts),
            "seconds": time.monotonic() - start}


# ---------------------------------------------------------------- the pool
def pool_round_trips(repeats: int) -> Dict[str, float]:
    from machinlike.pool import Pool

    tensor = torch.zeros(MODEL_MB * 1024 * 1024 // 4, device="cuda")
    out: Dict[str, float] = {}
    configs: List[Tuple[str, Dict[str, Any]]] = [("share", {"is_copy_tensor": False, "share_method": "cuda"}),
                                                 ("copy", {})]
    for label, kwargs in configs:
        with Pool(1, **kwargs) as pool:
            out[label] = _median_seconds(lambda: pool.apply(touch, (tensor,)), repeats)
    return out


# ---------------------------------------------------------------- driver
def _rate(megabytes: float, seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{megabytes / 1024 / seconds:.2f} GB/s"


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f} ms"


def _section(name: str, fn: Callable[[], Any]) -> Any:
    """``fn()``, or None with the error printed: one failing section leaves the others' figures."""
    start = time.monotonic()
    try:
        out = fn()
    except BaseException as err:  # (a TimeoutError of launch included)
        say(f"{name}: FAILED after {time.monotonic() - start:.0f} s: {type(err).__name__}: {str(err)[:300]}")
        return None
    say(f"{name}: done in {time.monotonic() - start:.0f} s")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and a shorter churn (a smoke run)")
    parser.add_argument("--only-echo", action="store_true",
                        help="only the echoes and the push, beside raw torch RPC and torch.multiprocessing")
    parser.add_argument("--only-churn", action="store_true", help="only the churn (pullers SIGKILLed)")
    parser.add_argument("--lane", choices=("on", "off"), default="on",
                        help="calls between the members through the same-host lane (default) or torch RPC only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        say("no GPU: benchmarks/gpu.py measures CUDA paths and has nothing to measure here")
        return 0
    from machinlike import launch

    repeats = 3 if args.quick else 10
    pushes, victims = (200, 4) if args.quick else (2000, 20)
    say(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}, {os.cpu_count()} CPUs, "
        f"same-host lane {args.lane}")
    rows: List[Tuple[str, str, str, str, str]] = []
    moved = 2 * ECHO_MB  # there and back

    if not args.only_churn:
        raw = _section("raw torch RPC with a map", lambda: raw_rpc(repeats)) or {}
        say(f"  64 MB echo {_rate(moved, raw.get('echo'))}, 1 MB echo {_ms(raw.get('small'))}, "
            f"empty call {_ms(raw.get('call'))}")
        mp = _section("torch.multiprocessing CUDA IPC", lambda: mp_echo(repeats)) or {}
        say(f"  64 MB echo {_rate(moved, mp.get('echo'))}, 1 MB echo {_ms(mp.get('small'))}")
        lane = args.lane == "on"
        ours = _section("machinlike echoes and push", lambda: launch(_echo_body, 2, args=(repeats,), timeout=300,
                                                                     rpc_timeout=120, same_host_lane=lane)[0]) or {}
        say(f"  stats: caller {ours.get('stats_caller')}, callee {ours.get('stats_callee')}")
        if "echo" in ours:
            ratio = f"{raw['echo'] / ours['echo']:.2f}x raw (>= 3)" if "echo" in raw else "(no raw figure)"
            rows.append((f"{ECHO_MB} MB CUDA echo, registered_sync", _rate(moved, ours["echo"]),
                         _rate(moved, raw.get("echo")), _rate(moved, mp.get("echo")), ratio))
            rows.append((f"{SMALL_MB} MB CUDA echo round trip", _ms(ours["small"]), _ms(raw.get("small")),
                         _ms(mp.get("small")), "<= 0.3 ms"))
        else:
            rows.append((f"{ECHO_MB} MB CUDA echo, registered_sync", "fails", _rate(moved, raw.get("echo")),
                         _rate(moved, mp.get("echo")), str(ours.get("echo_error", "see above"))))
        if "call" in ours:
            ratio = f"{ours['call'] / raw['call']:.2f}x raw" if "call" in raw else ""
            rows.append(("call with no tensor", _ms(ours["call"]), _ms(raw.get("call")), "-",
                         ratio + " (the CPU box's figure: benchmarks/rpc.py --quick)"))
        if "push" in ours:
            rows.append((f"model push, {MODEL_MB} MB, same GPU", _ms(ours["push"]), "-", "-", "<= 10 ms"))
            say("  " + rows[-1][0] + ": " + rows[-1][1])

    if not args.only_echo and not args.only_churn:
        spans = _section(f"pulls into {PULLERS}", lambda: launch(_pulls_body, 2 + PULLERS, args=(max(2, repeats // 3),),
                                                                 timeout=300, rpc_timeout=120,
                                                                 same_host_lane=lane)[2:])
        if spans:
            rounds = [max(s[r][1] for s in spans) - min(s[r][0] for s in spans) for r in range(1, len(spans[0]))]
            rows.append((f"pulls of one {MODEL_MB} MB version into {PULLERS} processes, in all",
                         _ms(statistics.median(rounds)), "-", "-", "<= 30 ms"))
            say("  " + rows[-1][0] + ": " + rows[-1][1])

        pool = _section("pool", lambda: pool_round_trips(repeats))
        if pool:
            rows.append((f"pool apply, {MODEL_MB} MB CUDA tensor there and back", _rate(2 * MODEL_MB, pool["share"]), "-",
                         _rate(2 * MODEL_MB, pool["copy"]), "share_method='cuda'; right: copy mode"))

    if not args.only_echo:
        done = _section("churn", lambda: churn(pushes, victims))
        if done:
            pusher, survivor = done["pusher"], done["survivor"]
            if isinstance(pusher, dict) and isinstance(survivor, dict):
                (first, _), (last, slabs) = pusher["first"], pusher["last"]
                rows.append((f"{pushes} pushes of {CHURN_MB} MB, {done['restarts']} of {victims} pullers SIGKILLed",
                             f"reserved {first / 2**20:.0f} -> {last / 2**20:.0f} MiB", "-", "-",
                             f"flat: {last / first:.2f}x (<= 1.10; from every puller pulling, before the first "
                             f"SIGKILL, to the end), of which export slabs {slabs / 2**20:.0f} MiB; "
                             f"survivor's slowest pull {survivor['slowest_pull'] * 1e3:.1f} ms; {done['seconds']:.0f} s"))
            else:
                rows.append((f"{pushes} pushes of {CHURN_MB} MB with pullers SIGKILLed", "fails", "-", "-",
                             f"{pusher!r}"[:100] + f" / {survivor!r}"[:100]))
            say("  " + rows[-1][0] + ": " + rows[-1][1] + "  " + rows[-1][4])
            if isinstance(pusher, dict) and pusher.get("samples"):
                say("  server's reserved / export slabs (MiB) by push: " +
                    ", ".join(f"{i}: {r} / {sl}" for i, r, sl in pusher["samples"]))
            if isinstance(pusher, dict) and isinstance(survivor, dict):
                say(f"  server's export area (area_pinned, area_shared: versions read in place): {pusher.get('area')}; "
                    f"survivor's flushes before a pull: {survivor.get('flush')}")
                before, after = pusher.get("driver") or (None, None)
                say("  server's GPU memory as the driver reports it (nvidia-smi), before the first SIGKILL and at the end: " +
                    (f"{before} -> {after} MiB" if before is not None and after is not None else "not listed (no nvidia-smi, or another pid namespace)"))

    head = ("what", "machinlike", "raw torch RPC, hand map", "torch.multiprocessing IPC", "against the target")
    widths = [max(len(r[i]) for r in rows + [head]) for i in range(5)]
    for row in [head] + rows:
        say("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
