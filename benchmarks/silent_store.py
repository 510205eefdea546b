"""A world's store that stops answering (its host SIGSTOPped): how long a request to it
waits with raw torch (a ``TCPStore`` client with a short timeout) and with machinlike (an
RpcGroup ``register``, a store request with no timeout of its own), side by side; and how
many requests machinlike's watch of the store sends while its liveness thread hears it.

Run:  python benchmarks/silent_store.py [--liveness 3] [--give-up 30]

A child process hosts a ``TCPStore`` and is SIGSTOPped once the clients are connected.
Raw torch: ``compare_set`` on a client whose timeout is 2 s, given up after ``--give-up``
seconds. machinlike: an elastic World on that store (``liveness`` as given; the store's
bound is the same, 5 s at least), then ``register``. The wait ends with the
``PeerLostError`` that names the store, or at ``--give-up``.
"""

from __future__ import annotations

import argparse
import datetime
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Tuple

import torch.distributed as dist

HOST = """
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", 0, None, True, datetime.timedelta(seconds=60), wait_for_workers=False)
print(store.port, flush=True)
sys.stdin.read()
"""


def _stopped_host() -> Tuple[subprocess.Popen, int]:
    host = subprocess.Popen([sys.executable, "-c", HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return host, int(host.stdout.readline())  # type: ignore[union-attr]


def _stop(host: subprocess.Popen) -> None:
    host.send_signal(signal.SIGSTOP)
    # Reported once every thread of the child has stopped (SIGSTOP itself is only queued);
    # WNOWAIT leaves the report for Popen.
    os.waitid(os.P_PID, host.pid, os.WSTOPPED | os.WNOWAIT)


def _end(host: subprocess.Popen) -> None:
    host.send_signal(signal.SIGCONT)
    host.stdin.close()  # type: ignore[union-attr]
    host.wait(30)


def _timed(request: Callable[[], object], give_up: float) -> Tuple[float, str]:
    """Seconds until ``request`` returned or raised, on a thread of its own (it may never end)."""
    outcome = []

    def run() -> None:
        try:
            request()
            outcome.append("returned")
        except Exception as err:
            outcome.append(f"{type(err).__name__}: {str(err)[:140]}")

    start = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(give_up)
    return time.monotonic() - start, (outcome[0] if outcome else f"still waiting after {give_up:g} s")


def raw(give_up: float) -> Tuple[float, str]:
    host, port = _stopped_host()
    try:
        client = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=2))
        client.set("k", "1")
        _stop(host)
        return _timed(lambda: client.compare_set("k", "1", "2"), give_up)
    finally:
        _end(host)


def machinlike(liveness: float, give_up: float) -> Tuple[float, str, int]:
    from machinlike.distributed import World
    from machinlike.distributed._membership import store_watch

    host, port = _stopped_host()
    world = World("a", elastic=True, init_method=f"tcp://127.0.0.1:{port}", liveness=liveness, dist_timeout=30)
    try:
        group = world.create_rpc_group("g")
        group.register("first", os.getpid)
        time.sleep(3 * max(liveness, store_watch.SILENCE_MIN) / 4)  # three looks of the watch's probe
        probes = store_watch._watches[("127.0.0.1", port)].probes
        _stop(host)
        seconds, outcome = _timed(lambda: group.register("second", os.getpid), give_up)
        return seconds, outcome, probes
    finally:
        host.send_signal(signal.SIGCONT)
        world.stop(timeout=10)
        _end(host)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--liveness", type=float, default=3.0, help="the World's liveness bound (s)")
    parser.add_argument("--give-up", type=float, default=30.0, help="seconds to wait for a request at most")
    args = parser.parse_args()
    raw_s, raw_out = raw(args.give_up)
    ours_s, ours_out, probes = machinlike(args.liveness, args.give_up)
    print(f"raw torch: compare_set, client timeout 2 s   {raw_s:6.2f} s   {raw_out}")
    print(f"machinlike: register, liveness {args.liveness:g} s        {ours_s:6.2f} s   {ours_out}")
    print(f"machinlike's probes while its liveness thread heard the store: {probes}")
    print(f"ratio (raw / machinlike, a lower bound while raw still waits): {raw_s / ours_s:.1f}x")


if __name__ == "__main__":
    main()
