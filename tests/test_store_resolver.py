"""A store connection slowed by the host's name resolver is told, once, with the fix that works.

torch's store client looks up the name of the address it connects to on every connection;
a resolver that loses queries makes a connection wait for the resolver's timeout. The
script runs in a mount namespace of its own whose /etc/resolv.conf names a local resolver
that loses the first try of every query and answers the second (the real glibc resolver,
the real torch client), then with the /etc/hosts line the warning proposes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

_SCRIPT = r'''
import json, logging, socket, subprocess, sys, threading, time


def lossy_resolver(sock):
    """Loses the first try of each query, answers its retry: no such name (so the name
    lookup falls back to the address, as for a loopback address nobody registered)."""
    seen = set()
    while True:
        query, peer = sock.recvfrom(512)
        if query[:2] not in seen:
            seen.add(query[:2])
            continue
        # the query's id and question; flags: a response, recursion, no such name; no records
        sock.sendto(query[:2] + b"\x81\x83" + query[4:6] + bytes(6) + query[12:], peer)


if __name__ == "__main__":
    dns = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    dns.bind(("127.0.0.77", 53))
    threading.Thread(target=lossy_resolver, args=(dns,), daemon=True).start()
    from machinlike.distributed._store import client, connect_store, host_store

    client.SLOW_CONNECT_S = 0.5  # (a lost try costs 1 s: RES_OPTIONS below)
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


def test_a_slow_resolver_is_named_once_and_the_hosts_line_it_proposes_ends_it(tmp_path):
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("a resolver of the test's own needs root and unshare(1)")
    (tmp_path / "resolv.conf").write_text("nameserver 127.0.0.77\n")
    with open("/etc/hosts") as hosts:
        (tmp_path / "hosts").write_text(hosts.read() + "\n::ffff:127.0.0.1 localhost\n")
    (tmp_path / "script.py").write_text(_SCRIPT)
    env = dict(os.environ, RES_OPTIONS="timeout:1 attempts:2")
    command = (f"mount --bind {tmp_path / 'resolv.conf'} /etc/resolv.conf && "
               f"exec {sys.executable} {tmp_path / 'script.py'} {tmp_path / 'hosts'}")
    try:
        done = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path, env=env)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the script hung: {err.stdout!r} {err.stderr!r}")
    if "mount:" in done.stderr and "permission denied" in done.stderr.lower():
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout.splitlines()[-1])
    assert min(got["slow"]) >= 0.9, got  # each connection waited for a lost query
    assert max(got["fixed"]) < 0.5, got  # the proposed line answers the lookup
    assert len(got["said"]) == 1, got  # two slow connections, one warning
    message = got["said"][0]
    assert f"store at 127.0.0.1:{got['port']} took 1." in message, message
    assert "'::ffff:127.0.0.1 localhost' to /etc/hosts" in message, message
    assert "A World is slow to start" in message, message
