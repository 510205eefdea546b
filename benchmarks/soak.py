"""Soak: what a long-lived member pays for peers that come, talk and die.

Run:  python benchmarks/soak.py [--cycles 2000] [--every 100] [--quick]
      python benchmarks/soak.py --remote --cycles 500 --every 50   (Linux, as root)

The learner (this process) hosts an elastic world's store. Each cycle one same-host actor
joins under a new name, calls the learner with a 1 MiB tensor, is called back with one,
and is SIGKILLed; the learner waits until the world has declared it lost. Every
``--every`` cycles the learner prints its RSS, its open descriptors, its memory maps,
the bytes under /dev/shm and the keys in the world's store. A long-lived "probe" member times a small call and a 64 MB echo
at the start and at the end, so that a slowdown from accumulated state shows too.

What a flat member looks like: after the warm-up, RSS grows by at most a few tens of MB
in all, and the descriptor and map counts stay where they were. What torch's TensorPipe
agent does on its own (it keeps the pipe to every worker it ever called, with its
shared-memory ring buffers) is about 8 MB, 24 maps and 24 descriptors per dead actor.

``--remote`` puts the actors on another host: two network namespaces joined by a veth
pair (198.18.0.1 for the learner and the probe, 198.18.0.2 for the actors; removed at the
end). A dead actor there is no longer seen through ``/proc``: the learner declares it
lost once its heartbeat stops for ``--liveness`` seconds (default 2 here).

``--departures-kept N`` deletes a gone actor's store records N departures later instead of
18,432 later (see machinlike/distributed/_membership/departures.py), so that the key count can level
off within a short run.

The last line reads ``soak: N cycles, rss +X MB, fds +F, maps +M, shm +S MB, store keys
+K after warm-up``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import queue
import resource
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from _netns import ADDRESSES, two_hosts
from machinlike.distributed import World
from machinlike.process import Process

MIB = 1 << 20


def _free_port(host: str = "127.0.0.1") -> int:
    # The store binds right after; a port reused in between fails loudly, not silently.
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def resources() -> Dict[str, float]:
    """This process's RSS (MB), open descriptors, memory maps, and /dev/shm bytes (MB)."""
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    shm = 0
    for entry in os.scandir("/dev/shm"):
        try:
            shm += entry.stat(follow_symlinks=False).st_size
        except FileNotFoundError:  # removed while we looked
            pass
    return {"rss": rss, "fds": len(os.listdir("/proc/self/fd")), "maps": maps, "shm": shm / MIB}


def _echo(x: torch.Tensor) -> torch.Tensor:
    return x


def _noop() -> None:
    return None


def _actor(address: str, name: str, liveness: Optional[float] = None) -> None:
    with World(name, elastic=True, init_method=address, dist_timeout=30, rpc_timeout=30,
               **({} if liveness is None else {"liveness": liveness})) as world:
        group = world.create_rpc_group("soak")
        group.register(f"echo/{name}", _echo)
        group.registered_sync("hello", args=(name, torch.ones(MIB // 4)), timeout=30)
        threading.Event().wait(120)  # killed long before: the learner SIGKILLs us


def _probe(address: str) -> None:
    leave = threading.Event()
    with World("probe", elastic=True, init_method=address, dist_timeout=30, rpc_timeout=30) as world:
        group = world.create_rpc_group("soak")
        group.register("probe/noop", _noop)
        group.register("probe/echo", _echo)
        group.register("probe/leave", leave.set)
        # Leaves when asked; a learner that dies instead is noticed at the next check,
        # and so is a store that died with it (this member is cut off then, and learns
        # no more events) or a parent that is gone: an orphaned probe must not stay (its
        # TensorPipe reactor spins on the dead peer).
        parent = os.getppid()
        while not leave.wait(1.0) and world.membership.gone("learner") is None:
            if world.membership.roster.cut_off is not None or os.getppid() != parent:
                break


def _control(address: str) -> None:
    """A fresh member that times the same calls to the probe and reports them: the
    learner's own times divided by a fresh process's, taken at the same moment, cancel
    the machine's drift over a long run."""
    with World("control", elastic=True, init_method=address, dist_timeout=30, rpc_timeout=30) as world:
        group = world.create_rpc_group("soak")
        while not group.is_registered("probe/echo"):
            time.sleep(0.01)
        group.registered_sync("control/result", args=call_times(group), timeout=30)


def compared_times(group, address: str, results: "queue.Queue[Tuple[float, float]]") -> Tuple[float, float]:
    """The learner's small call and echo divided by a fresh control member's (blocks: the
    learner, the control, the learner again; the learner's two averaged)."""
    first = call_times(group)
    control = Process(target=_control, args=(address,), name="control")
    control.start()
    fresh = results.get(timeout=120)
    control.join(60)
    second = call_times(group)
    return (first[0] + second[0]) / 2 / fresh[0], (first[1] + second[1]) / 2 / fresh[1]


def call_times(group, calls: int = 300) -> Tuple[float, float]:
    """Median small-call latency (µs) and median 64 MB echo time (ms) to the probe."""
    for _ in range(50):
        group.registered_sync("probe/noop", timeout=30)
    blocks = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls // 5):
            group.registered_sync("probe/noop", timeout=30)
        blocks.append((time.perf_counter() - start) / (calls // 5) * 1e6)
    big = torch.ones(16 * MIB)  # 64 MB of float32
    group.registered_sync("probe/echo", args=(big,), timeout=60)  # a fresh process's first pays set-up
    echoes = []
    for _ in range(5):
        start = time.perf_counter()
        group.registered_sync("probe/echo", args=(big,), timeout=60)
        echoes.append((time.perf_counter() - start) * 1e3)
    return statistics.median(blocks), statistics.median(echoes)


class _RemoteActor:
    """An actor started on the other namespace (``ip netns exec``: the same pid)."""

    def __init__(self, namespace: str, address: str, name: str, liveness: float) -> None:
        argv = [sys.executable, str(Path(__file__).resolve()), "--actor", address, name, "--liveness", str(liveness)]
        self._proc = subprocess.Popen(["ip", "netns", "exec", namespace, *argv], start_new_session=True)
        self.pid = self._proc.pid

    def join(self, timeout: float) -> None:
        self._proc.wait(timeout)


def _local_actor(address: str, name: str) -> Process:
    actor = Process(target=_actor, args=(address, name), name=name)
    actor.start()
    return actor


def soak(cycles: int, every: int, warmup: int, host: str = "127.0.0.1",
         start_actor: Optional[Callable[[str, str], object]] = None, liveness: Optional[float] = None,
         compare: bool = False) -> Dict[str, float]:
    """The soak (see the module doc); ``start_actor(address, name)`` starts one actor
    (None: a child process here), ``host`` is the address the store listens on; ``compare``:
    the calls at the start and the end are also timed against a fresh member's."""
    address = f"tcp://{host}:{_free_port(host)}"
    start_actor = start_actor or _local_actor
    hello = threading.Condition()
    arrived: Dict[str, torch.Tensor] = {}

    def on_hello(name: str, x: torch.Tensor) -> int:
        with hello:
            arrived[name] = x
            hello.notify_all()
        return x.numel()

    with World("learner", rank=0, elastic=True, init_method=address, dist_timeout=30, rpc_timeout=30,
               **({} if liveness is None else {"liveness": liveness})) as world:
        group = world.create_rpc_group("soak")
        group.register("hello", on_hello)
        probe = Process(target=_probe, args=(address,), name="probe")
        probe.start()
        world.wait_for_members(["probe"], timeout=60)
        while not group.is_registered("probe/echo"):
            time.sleep(0.01)  # registered right after it joined
        controls: "queue.Queue[Tuple[float, float]]" = queue.Queue()
        group.register("control/result", lambda small, echo: controls.put((small, echo)))
        start_calls = call_times(group)
        print(f"start: small call {start_calls[0]:.1f} us, 64 MB echo {start_calls[1]:.1f} ms", flush=True)
        start_vs = compared_times(group, address, controls) if compare else None
        # A client of the world's store, as any user could make: its key count is part of
        # what must stay flat (event log, per-worker entries, addresses, tokens, ids).
        store = dist.TCPStore(host, int(address.rpartition(":")[2]), is_master=False,
                              timeout=datetime.timedelta(seconds=30))

        def measure() -> Dict[str, float]:
            return {**resources(), "keys": store.num_keys()}

        base: Dict[str, float] = {}
        began = time.monotonic()
        try:
            for cycle in range(1, cycles + 1):
                name = f"actor-{cycle}"
                actor = start_actor(address, name)
                with hello:
                    if not hello.wait_for(lambda: name in arrived, timeout=60):
                        raise TimeoutError(f"{name} did not call the learner within 60 s")
                    arrived.pop(name)
                back = group.registered_sync(f"echo/{name}", args=(torch.ones(MIB // 4),), timeout=30)
                assert back.numel() == MIB // 4
                os.kill(actor.pid, signal.SIGKILL)
                actor.join(30)
                world.membership.wait_until(lambda live: world.membership.gone(name) is not None, 30)
                if cycle == warmup:
                    base = measure()
                if cycle % every == 0 or cycle == cycles:
                    now = measure()
                    grow = {k: now[k] - base.get(k, now[k]) for k in now}
                    print(f"cycle {cycle:5d}  rss {now['rss']:8.1f} MB ({grow['rss']:+7.1f})  "
                          f"fds {now['fds']:5.0f} ({grow['fds']:+5.0f})  maps {now['maps']:6.0f} "
                          f"({grow['maps']:+6.0f})  /dev/shm {now['shm']:7.1f} MB ({grow['shm']:+6.1f})  "
                          f"store keys {now['keys']:5.0f} ({grow['keys']:+4.0f})  "
                          f"{(time.monotonic() - began) / cycle:.2f} s/cycle", flush=True)
        finally:
            end_calls = call_times(group)
            print(f"end:   small call {end_calls[0]:.1f} us ({end_calls[0] / start_calls[0]:.2f}x), "
                  f"64 MB echo {end_calls[1]:.1f} ms ({end_calls[1] / start_calls[1]:.2f}x)", flush=True)
            if start_vs is not None:
                end_vs = compared_times(group, address, controls)
                print(f"against a fresh member timed at the same moment: small call {start_vs[0]:.2f}x at the "
                      f"start, {end_vs[0]:.2f}x at the end ({end_vs[0] / start_vs[0]:.2f}x); 64 MB echo "
                      f"{start_vs[1]:.2f}x, {end_vs[1]:.2f}x ({end_vs[1] / start_vs[1]:.2f}x)", flush=True)
            # Not awaited: the probe leaves as soon as it is asked, before its reply is sent.
            group.registered_async("probe/leave", timeout=30)
            probe.join(30)
        endpoint = world.membership.endpoint
        print(f"the learner answers as {endpoint.worker!r} after {endpoint.recycles} recyclings of its RPC agent",
              flush=True)
        now = measure()
        return {k: now[k] - base.get(k, now[k]) for k in now}


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cycles", type=int, default=2000)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20, help="cycles before the baseline is taken")
    parser.add_argument("--quick", action="store_true", help="200 cycles, a line every 20")
    parser.add_argument("--recycle-after", type=int, default=8,
                        help="recycle an agent once it holds pipes to this many gone workers (0: never)")
    parser.add_argument("--departures-kept", type=int, default=None,
                        help="departures whose store records are kept (MACHINLIKE_DEPARTURES_KEPT; default "
                             "18,432): a small number reaps them within the run")
    parser.add_argument("--compare", action="store_true",
                        help="at the start and the end, time the calls against a fresh member's too")
    parser.add_argument("--remote", action="store_true",
                        help="actors on another host (network namespaces; Linux, as root)")
    parser.add_argument("--liveness", type=float, default=None,
                        help="World(liveness=) of the learner and the actors, s (default: 2 with --remote, "
                             "else the World's default)")
    parser.add_argument("--actor", nargs=2, metavar=("ADDRESS", "NAME"), help=argparse.SUPPRESS)
    parser.add_argument("--actors-in", help=argparse.SUPPRESS)  # the learner's side of --remote
    args = parser.parse_args(argv)
    os.environ["MACHINLIKE_RECYCLE_AFTER"] = str(args.recycle_after)  # read when the World starts
    if args.departures_kept is not None:
        os.environ["MACHINLIKE_DEPARTURES_KEPT"] = str(args.departures_kept)
    if args.actor:
        _actor(*args.actor, liveness=args.liveness)
        return
    if args.quick:
        args.cycles, args.every = 200, 20
    if args.remote:
        _run_remote(argv, args.liveness or 2.0)
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    where = f", actors on another host ({args.actors_in})" if args.actors_in else ""
    print(f"soak: {args.cycles} cycles, open-files limit {soft}, recycle after {args.recycle_after}{where}",
          flush=True)
    if args.actors_in:
        namespace, liveness = args.actors_in, args.liveness or 2.0
        grow = soak(args.cycles, args.every, min(args.warmup, args.cycles), host=ADDRESSES[0], liveness=liveness,
                    start_actor=lambda address, name: _RemoteActor(namespace, address, name, liveness))
    else:
        grow = soak(args.cycles, args.every, min(args.warmup, args.cycles), liveness=args.liveness,
                    compare=args.compare)
    print(f"soak: {args.cycles} cycles, rss {grow['rss']:+.1f} MB, fds {grow['fds']:+.0f}, "
          f"maps {grow['maps']:+.0f}, shm {grow['shm']:+.1f} MB, store keys {grow['keys']:+.0f} after warm-up",
          flush=True)


def _run_remote(argv: List[str], liveness: float) -> None:
    """Make the two hosts, run the learner on the first (it starts the actors on the second),
    remove them."""
    if sys.platform != "linux" or os.geteuid() != 0:
        sys.exit("--remote creates network namespaces: run it as root on Linux")
    with two_hosts("mlksoak") as hosts:
        rest = [a for a in argv if a != "--remote"]
        learner = subprocess.Popen(["ip", "netns", "exec", hosts[0], sys.executable, str(Path(__file__).resolve()),
                                    *rest, "--actors-in", hosts[1], "--liveness", str(liveness)])
        try:
            code = learner.wait()
        finally:
            if learner.poll() is None:  # (interrupted: two_hosts ends it with its namespace)
                learner.kill()
        if code:
            sys.exit(f"the learner failed: exit code {code}")


if __name__ == "__main__":
    main(sys.argv[1:])
