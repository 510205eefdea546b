"""Store connections slowed by the host's name resolver: told once, with the fix that
works; and the liveness watch keeps reading while its own connection cannot be opened.

torch's store client looks up the name of the address it connects to on every connection;
a resolver that loses queries makes a connection wait for the resolver's timeout. Each
script runs in a mount namespace of its own whose /etc/resolv.conf names a local resolver
that loses the first try of a query and answers its retry (the real glibc resolver, the
real torch client).
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys

import pytest

_RESOLVER = r'''
import json, logging, os, socket, subprocess, sys, threading, time


def lossy_resolver(sock, lossy):
    """While ``lossy()``, loses the first try of each query; answers the others: no such
    name (so the lookup falls back to the address, as for an address nobody registered)."""
    seen = set()
    while True:
        query, peer = sock.recvfrom(512)
        if lossy() and query[:2] not in seen:
            seen.add(query[:2])
            continue
        # the query's id and question; flags: a response, recursion, no such name; no records
        sock.sendto(query[:2] + b"\x81\x83" + query[4:6] + bytes(6) + query[12:], peer)


def start_resolver(lossy=lambda: True):
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dns.bind((os.environ["TEST_RESOLVER"], 53))
    threading.Thread(target=lossy_resolver, args=(dns, lossy), daemon=True).start()
'''

_SLOW_CONNECTIONS = _RESOLVER + r'''
if __name__ == "__main__":
    start_resolver()
    from machinlike.distributed._store import client, connect_store, host_store

    client.SLOW_CONNECT_S = 0.5  # (a lost try costs 1 s: RES_OPTIONS)
    client.os.getloadavg = lambda: (0.0, 0.0, 0.0)  # (a loaded test machine is told apart: its own test)
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger(client.__name__).addHandler(handler)
    server = host_store("127.0.0.1", 1, 10)

    def connect():
        start = time.monotonic()
        connect_store("127.0.0.1", server.port, 10)
        return time.monotonic() - start

    slow = [connect(), connect()]
    subprocess.run(["mount", "--bind", sys.argv[1], "/etc/hosts"], check=True)
    fixed = [connect(), connect()]
    print(json.dumps({"slow": slow, "fixed": fixed, "said": said, "port": server.port}))
'''

_WATCH = _RESOLVER + r'''
FLAG = os.path.join(os.getcwd(), "lossy")


def body(world):
    group = world.create_rpc_group("g", ["a", "b"])
    group.barrier(timeout=30)
    watch = world.membership.monitor.watch
    out = {}
    if world.name == "a":
        deadline = time.monotonic() + 10
        while not watch.connected and time.monotonic() < deadline:
            time.sleep(0.02)  # (the monitor opens it at its start)
        open(FLAG, "w").close()  # from now on each new connection waits 1 s for its lookup
        before = watch.requests
        watch.disconnect()  # as after a network error: the next tick opens a new one
        time.sleep(3)  # 12 ticks
        out = {"reads": watch.requests - before, "failures": watch.connect_failures}
    group.barrier(timeout=30)
    return out


if __name__ == "__main__":
    start_resolver(lambda: os.path.exists(FLAG))
    from machinlike import launch

    print(json.dumps(launch(body, 2, names=["a", "b"], timeout=60, liveness=2.0)[0]))
'''


_STORE_WATCH = _RESOLVER + r'''
if __name__ == "__main__":
    lossy = threading.Event()
    start_resolver(lossy.is_set)
    from machinlike.distributed._membership.store_watch import watch_store
    from machinlike.distributed._store import Registry, connect_store, host_store

    server = host_store("127.0.0.1", 1, 30)
    store = connect_store("127.0.0.1", server.port, 30)
    lossy.set()  # from now on a new connection waits 6 s for its lookup (RES_OPTIONS)
    start = time.monotonic()
    try:
        leave = watch_store(store, Registry(store, "rank 0"), 1.0, time.monotonic, threading.Event())
    except Exception as err:
        print(json.dumps({"took": time.monotonic() - start, "error": f"{type(err).__name__}: {err}"[:300]}))
    else:
        took = time.monotonic() - start
        leave()
        print(json.dumps({"took": took, "error": None}))
'''


_RESOLVERS = itertools.cycle(range(2, 250))


def _run_in_namespace(tmp_path, script: str, *args: str,
                      res_options: str = "timeout:1 attempts:2") -> subprocess.CompletedProcess:
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a resolver of the test's own needs root and unshare(1)")
    # An address of this test's own (all of 127/8 is this host's): the tests of this file
    # run side by side under xdist, each with its resolver on port 53 of one network.
    resolver = f"127.{os.getpid() >> 8 & 255}.{os.getpid() & 255}.{next(_RESOLVERS)}"  # (one per pid below 65,536)
    (tmp_path / "resolv.conf").write_text(f"nameserver {resolver}\n")
    (tmp_path / "script.py").write_text(script)
    env = dict(os.environ, RES_OPTIONS=res_options, TEST_RESOLVER=resolver)
    command = (f"mount --bind {tmp_path / 'resolv.conf'} /etc/resolv.conf && "
               f"exec {sys.executable} {tmp_path / 'script.py'} {' '.join(args)}")
    try:
        done = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path, env=env)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the script hung: {err.stdout!r} {err.stderr!r}")
    if "mount:" in done.stderr and "permission denied" in done.stderr.lower():
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    return done


def test_a_slow_resolver_is_named_once_and_the_hosts_line_it_proposes_ends_it(tmp_path):
    with open("/etc/hosts") as hosts:
        (tmp_path / "hosts").write_text(hosts.read() + "\n::ffff:127.0.0.1 localhost\n")
    done = _run_in_namespace(tmp_path, _SLOW_CONNECTIONS, str(tmp_path / "hosts"))
    got = json.loads(done.stdout.splitlines()[-1])
    assert min(got["slow"]) >= 0.9, got  # each connection waited for a lost query
    assert max(got["fixed"]) < 0.5, got  # the proposed line answers the lookup
    assert len(got["said"]) == 1, got  # two slow connections, one warning
    message = got["said"][0]
    assert f"store at 127.0.0.1:{got['port']} took 1." in message, message
    assert "'::ffff:127.0.0.1 localhost' to /etc/hosts" in message, message
    assert "A World is slow to start" in message, message


def test_a_slow_connection_on_an_overloaded_machine_names_the_load_first():
    from machinlike.distributed._store.client import slow_connection

    busy = slow_connection("127.0.0.1", 29500, 5.0, load=6.4, cores=2)
    assert "machine is overloaded (load 6.4 on 2 cores)" in busy and "/etc/hosts" not in busy, busy
    calm = slow_connection("127.0.0.1", 29500, 5.0, load=1.0, cores=2)
    assert "'::ffff:127.0.0.1 localhost' to /etc/hosts" in calm, calm


def test_the_liveness_watch_reads_one_by_one_while_its_connection_cannot_be_opened(tmp_path):
    # Its connection has a timeout of two ticks (0.5 s here), shorter than the lookup: every
    # try fails. Before, each tick tried again, held the monitor for the lookup, raised
    # before reading anything and logged a traceback: 2 reads in 5 s.
    done = _run_in_namespace(tmp_path, _WATCH)
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["failures"] == 1, got  # one try in 3 s: the next after 16 ticks (4 s)
    assert got["reads"] >= 8, got  # the successor's heartbeat and the log, one by one, at every tick
    assert "liveness monitor of" not in done.stderr, done.stderr[-3000:]


def test_the_store_watch_opens_its_probe_when_a_lookup_outlasts_the_silence_bound(tmp_path):
    # Its bound is 5 s at least (SILENCE_MIN); the lookup, 6 s. Its connection had the
    # bound as its timeout, so World start failed: "The client socket has timed out after 5000ms".
    done = _run_in_namespace(tmp_path, _STORE_WATCH, res_options="timeout:6 attempts:2")
    got = json.loads(done.stdout.splitlines()[-1])
    assert got["error"] is None and 5.5 < got["took"] < 20, got
