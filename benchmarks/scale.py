"""Real member processes at scale: join, calls between members, and deaths, on one box.

Run:  python benchmarks/scale.py [--members 64] [--kills 4] [--liveness 2] [--timeout 540]

The driver hosts the world's store (a plain TCPStore: no member is special) and starts
``--members`` processes, each an elastic :class:`World` that joins one open RpcGroup,
registers a service of its own and, once it sees every member, calls the services of the
4 members after it in name order (``registered_sync``: no barrier, none needed). Then the
driver SIGKILLs ``--kills`` members, one at a time, and every survivor says when its
"lost" event came. Reported: join (start of the first process to the last member seeing
all), call latency (p50/p99 over every call), detection (kill to each survivor's event,
p50/p99), deaths never named and live members declared lost. Times are wall clock
across processes (one host, one clock). With ``SCALE_DEBUG_DIR`` set, a survivor that
never named a death writes there what it knows: its place in the event log, its view of
the victims, the log itself and every thread's stack (how issue 37's missed deaths were
found).

Why real processes: ``liveness_scale.py`` simulates a thousand members in threads; this
runs the whole stack (RPC agents, transports, the event log) as users do, as many as
the box can start. Everything waits with a deadline: the run ends by ``--timeout``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import signal
import sys
import time
from typing import Any, Dict, List

import torch.distributed as dist

from machinlike._warm import resolve_context

__all__ = ["run", "main"]

CALLS = 4  # services each member calls (the ones after it in name order)


def _echo(x: int) -> int:
    return x + 1


def _phase(store: dist.Store, name: str, timeout: float) -> bool:
    """Wait for the driver's phase key ``name``; False after ``timeout`` seconds.

    Why the store and not multiprocessing Events: ``Event.set`` waits for every waiter to
    wake, and a SIGKILLed waiter never does (the driver hung there).
    """
    try:
        store.wait([f"x/{name}"], datetime.timedelta(seconds=timeout))
        return True
    except dist.DistStoreError:
        return False


def _member(address: str, name: str, names: List[str], liveness: float, out: Any, timeout: float) -> None:
    """One member: join, serve, call 4 others, record deaths, report (each wait bounded)."""
    from machinlike.distributed import World

    deadline = time.monotonic() + timeout
    left = lambda: max(0.1, deadline - time.monotonic())  # noqa: E731
    lost: Dict[str, float] = {}
    host, port = address[len("tcp://"):].rsplit(":", 1)
    phases = dist.TCPStore(host, int(port), is_master=False, timeout=datetime.timedelta(seconds=timeout))
    with World(name, elastic=True, init_method=address, dist_timeout=min(60.0, left()), liveness=liveness,
               rpc_threads=4) as world:
        world.on_member_change(lambda e: lost.setdefault(e.member, time.time()) if e.kind == "lost" else None)
        group = world.create_rpc_group("all")  # open: whoever is in the world
        group.register(f"echo/{name}", _echo)
        world.wait_for_members(names, timeout=left())
        out.put(("joined", name, time.time(), os.getpid()))
        if not _phase(phases, "call", left()):
            return
        at = names.index(name)
        latencies: List[float] = []
        for j in range(1, CALLS + 1):
            target = names[(at + j) % len(names)]
            while True:  # its service may be registered a moment after its join
                began = time.perf_counter()
                try:
                    assert group.registered_sync(f"echo/{target}", args=(1,), timeout=min(10.0, left())) == 2
                    latencies.append(time.perf_counter() - began)
                    break
                except KeyError:
                    if deadline - time.monotonic() < 1:
                        raise
                    time.sleep(0.05)
        out.put(("called", name, latencies, 0))
        if _phase(phases, "report", left()):
            # A death named late (a starved box) still counts, with its time: wait for
            # the names the driver killed, a bounded while, before reporting.
            victims = phases.get("x/report").decode().split(",")
            until = time.monotonic() + min(left(), 10.0)
            while not all(v in lost for v in victims) and time.monotonic() < until:
                time.sleep(0.05)
            cut = world.membership.roster.cut_off  # declared lost itself while it lived?
            if not all(v in lost for v in victims) and os.environ.get("SCALE_DEBUG_DIR"):
                _dump(world, name, victims, os.environ["SCALE_DEBUG_DIR"])
            # Through the store, not the queue: a victim SIGKILLed while its queue's feeder
            # thread still held the queue's one writer lock (just after its "called") left
            # every later put waiting for good, and the driver waited out its limit.
            phases.set(f"x/lost/{name}", json.dumps([dict(lost), str(cut) if cut is not None else ""]))
        _phase(phases, "stop", left())


def _dump(world: Any, name: str, victims: List[str], where: str) -> None:
    """What a member that never named a death knows (SCALE_DEBUG_DIR): its place in the
    event log, its view of the victims, and every thread's stack."""
    import faulthandler

    m = world.membership
    with open(os.path.join(where, f"{name}.txt"), "w") as f:
        total = m.registry.add(m.keys.log_count(), 0)
        f.write(f"log position {m.events._seq} of {total}; claimed {m.events._claimed}; hole {m.events._hole}\n")
        for v in victims:
            f.write(f"{v}: incarnation {m.roster.incarnation_of(v)}, gone {m.roster.gone(v)}\n")
        for seq in range(total):
            f.write(f"  {seq}: {m.registry.get_or_empty(m.keys.log_entry(seq))[:120]}\n")
        f.flush()
        faulthandler.dump_traceback(f, all_threads=True)


def _take(out: Any, procs: Dict[str, Any], left: Any, waiting_for: str) -> Any:
    """The next report of ``out``; a member that ended first is named at once (``RuntimeError``)
    instead of being waited for until the run's limit (CI once waited 147 s for one)."""
    while True:
        try:
            return out.get(timeout=min(1.0, left()))
        except queue.Empty:
            if left() <= 0.1:
                raise
        _ended(procs, waiting_for)


def _ended(procs: Dict[str, Any], waiting_for: str) -> None:
    ended = {name: p.exitcode for name, p in procs.items() if p.exitcode is not None}
    if ended:
        raise RuntimeError(f"members ended (exit codes {ended}) while the driver waited for {waiting_for}; "
                           f"their stderr says why")


def _pct(values: List[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def _say(text: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {text}", file=sys.stderr, flush=True)


def run(members: int, kills: int, liveness: float, timeout: float, start: str = "warm") -> Dict[str, Any]:
    """One run (see the module doc); every wait ends by ``timeout`` seconds from now.

    ``start``: ``"warm"`` (machinlike's warm forkserver, as launch() starts its ranks),
    ``"spawn"`` (each member a new interpreter that imports torch itself), or another
    start method name (see ``machinlike._warm.resolve_context``).
    """
    # By default members start from machinlike's warm forkserver (torch imported once), as
    # launch()'s ranks do: spawned, each imports torch again (about 3.5 s of CPU here), and
    # the join figure mostly measures this box starting interpreters.
    ctx = resolve_context(start, "start")
    deadline = time.monotonic() + timeout
    left = lambda: max(0.1, deadline - time.monotonic())  # noqa: E731
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60), use_libuv=True)
    address = f"tcp://127.0.0.1:{store.port}"
    out = ctx.Queue()
    names = [f"m{i:03d}" for i in range(members)]
    procs: Dict[str, Any] = {}
    started = time.time()
    for name in names:
        p = ctx.Process(target=_member, args=(address, name, names, liveness, out, left()),
                        daemon=True)
        p.start()
        procs[name] = p
    pids: Dict[str, int] = {}
    result: Dict[str, Any] = dict(members=members, liveness=liveness)
    try:
        joined: Dict[str, float] = {}
        while len(joined) < members:
            _, name, at, pid = _take(out, procs, left, "every member to join")
            joined[name], pids[name] = at, pid
        result["join_s"] = max(joined.values()) - started
        _say(f"{members} members joined and saw all in {result['join_s']:.1f} s")
        store.set("x/call", "1")
        latencies: List[float] = []
        for _ in range(members):
            kind, name, values, _ = _take(out, procs, left, "every member's calls")
            latencies += values
        result["call_p50_ms"] = 1e3 * _pct(latencies, 0.5)
        result["call_p99_ms"] = 1e3 * _pct(latencies, 0.99)
        _say(f"{len(latencies)} calls: p50 {result['call_p50_ms']:.2f} ms, p99 {result['call_p99_ms']:.2f} ms")
        victims = names[::max(1, members // kills)][:kills]
        killed: Dict[str, float] = {}
        for v in victims:
            killed[v] = time.time()
            os.kill(pids[v], signal.SIGKILL)
            time.sleep(min(left(), 1.5 * liveness))  # one death at a time (each is named within liveness)
        store.set("x/report", ",".join(victims))
        delays: List[float] = []
        false_losses: set = set()
        cut_off: Dict[str, str] = {}
        reports = [f"x/lost/{name}" for name in names if name not in victims]
        while True:
            try:
                store.wait(reports, datetime.timedelta(seconds=min(1.0, left())))
                break
            except dist.DistStoreError:
                silent = [k.rsplit("/", 1)[1] for k in reports if not store.check([k])]
                if left() <= 0.1:
                    result["error"] = f"over the {timeout:g} s limit: no report from {silent}"
                    return result
                _ended({n: procs[n] for n in silent}, "the survivors' reports")
        for key in reports:
            name = key.rsplit("/", 1)[1]
            lost, cut = json.loads(store.get(key).decode())
            delays += [lost[v] - killed[v] if v in lost else float("inf") for v in victims]
            false_losses |= set(lost) - set(victims)
            missed = [v for v in victims if v not in lost]
            if missed:
                _say(f"{name} never named {missed}{' (it was cut off: ' + cut + ')' if cut else ''}")
            if cut:
                cut_off[name] = cut
        result["false_losses"] = sorted(false_losses)
        result["cut_off"] = sorted(cut_off)
        result["detect_p50_s"] = _pct(delays, 0.5)
        result["detect_p99_s"] = _pct(delays, 0.99)
        result["detect_missed"] = sum(1 for d in delays if d == float("inf"))
        return result
    except queue.Empty:
        result["error"] = f"over the {timeout:g} s limit"
        return result
    except RuntimeError as err:  # (a member ended early: _ended)
        result["error"] = str(err)
        return result
    finally:
        store.set("x/stop", "1")
        for p in procs.values():
            p.join(max(0.1, min(5.0, deadline + 15 - time.monotonic())))
            if p.is_alive():
                p.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--members", type=int, default=64)
    parser.add_argument("--kills", type=int, default=4)
    parser.add_argument("--liveness", type=float, default=2.0)
    parser.add_argument("--timeout", type=float, default=540.0, help="hard limit of the run, seconds")
    parser.add_argument("--start", choices=("warm", "spawn"), default="warm",
                        help="how members start: machinlike's warm forkserver, or spawned interpreters")
    args = parser.parse_args()
    r = run(args.members, args.kills, args.liveness, args.timeout, args.start)
    if "error" in r:
        print(f"scale: N={args.members} {r['error']}: {r}")
        sys.exit(1)
    print(f"scale: N={r['members']} join {r['join_s']:.1f} s, calls p50 {r['call_p50_ms']:.2f} ms p99 "
          f"{r['call_p99_ms']:.2f} ms, detection p50 {r['detect_p50_s']:.2f} s p99 {r['detect_p99_s']:.2f} s "
          f"(liveness {r['liveness']:g} s, {r['detect_missed']} missed, {len(r['false_losses'])} live members "
          f"declared lost)")


if __name__ == "__main__":
    main()
