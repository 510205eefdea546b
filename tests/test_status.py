"""``python -m machinlike status``: a live elastic world's members before and after a SIGKILL,
read from its store without writing to it."""

from __future__ import annotations

import datetime
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from machinlike._status_view import main as status_main
from machinlike.distributed._membership.status import ReadOnlyStore, read_status

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MEMBER = """
import sys
from machinlike.distributed import World
world = World(sys.argv[1], elastic=True, init_method=sys.argv[2], liveness=1.0, dist_timeout=60)
group = world.create_rpc_group("obs")
group.register("svc/" + world.name, lambda: 1)
print("ready", flush=True)
sys.stdin.read()  # until the test closes our stdin
world.stop()
"""


class _Recording:
    """A store that records every method called on it (the reader must only read)."""

    def __init__(self, store):
        self._store = store
        self.calls = set()

    def __getattr__(self, name):
        self.calls.add(name)
        return getattr(self._store, name)


def _rows(text):
    return {line.split()[0]: line.split() for line in text.splitlines()[3:] if line.strip()}


def _status_here(address):
    """``python -m machinlike status ADDRESS --once``, its ``main`` run in this process.

    A second interpreter would import torch again (seconds) to run the same function; the
    command line itself and its exit status reaching the shell are proven by
    ``test_status_of_an_address_where_nothing_listens_says_so``.
    """
    out = io.StringIO()
    assert status_main(["status", address, "--once"], out=out) == 0
    return _rows(out.getvalue()), out.getvalue()


def _quiet_key_count(store, quiet=1.0, timeout=20.0):
    """The store's key count once it held still for ``quiet`` seconds (the members' start-up
    is over), so that a key created next is the reader's."""
    deadline = time.monotonic() + timeout
    count = store.num_keys()
    while time.monotonic() < deadline:
        time.sleep(quiet)
        now = store.num_keys()
        if now == count:
            return count
        count = now
    raise AssertionError(f"the world kept creating keys for {timeout:g} s")


@pytest.fixture
def world_store():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    port = sock.getsockname()[1]
    host = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=60), wait_for_workers=False,
                         master_listen_fd=sock.detach())
    yield f"tcp://127.0.0.1:{port}", host


def test_status_lists_members_before_and_after_a_kill_and_only_reads(world_store, tmp_path):
    address, host = world_store
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = {}
    # The learner's log into a file: a pipe nobody reads until the end could fill and stop it.
    learner_log = open(tmp_path / "learner.log", "w")
    try:
        for name in ("learner", "actor"):
            procs[name] = subprocess.Popen([sys.executable, "-c", MEMBER, name, address], env=env, cwd=ROOT,
                                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                           stderr=learner_log if name == "learner" else None)
        for name, proc in procs.items():
            assert proc.stdout.readline().strip() == "ready", name
        keys_before = _quiet_key_count(host)
        rows, text = _status_here(address)
        assert host.num_keys() == keys_before, "the status view created keys"
        assert {n: rows[n][1] for n in procs} == {n: "alive" for n in procs}, text
        assert rows["actor"][5] == str(procs["actor"].pid) and "obs:svc/actor" in text
        assert rows["actor"][6] == socket.gethostname(), text  # (the operator's question: which machine?)
        assert rows["learner"][7].startswith("<"), text  # its heartbeat moved between the two reads
        out = io.StringIO()
        assert status_main(["status", address, "--once", "--json"], out=out) == 0
        record = json.loads(out.getvalue())  # one line, by name: for scripts and logs
        members = {m["name"]: m for m in record["world"]["members"]}
        assert record["world"]["alive"] == 2 and members["actor"]["pid"] == procs["actor"].pid, record
        assert members["actor"]["host"] == socket.gethostname(), record
        assert members["actor"]["state"] == "alive" and "obs:svc/actor" in members["actor"]["services"], record

        procs["actor"].send_signal(signal.SIGKILL)
        procs["actor"].wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            status = read_status(ReadOnlyStore(host))
            if status.deaths:
                break
            time.sleep(0.2)
        rows, text = _status_here(address)
        assert rows["actor"][1] == "lost" and rows["learner"][1] == "alive", text
        assert "1 alive of 2; deaths 1" in text and "obs:svc/actor" not in text and "obs:svc/learner" in text

        recording = _Recording(dist.TCPStore("127.0.0.1", int(address.rsplit(":", 1)[1]), is_master=False,
                                             timeout=datetime.timedelta(seconds=10), wait_for_workers=False))
        status = read_status(ReadOnlyStore(recording))
        assert status.alive() == ["learner"] and recording.calls <= {"check", "get"}, recording.calls
        procs["learner"].communicate(timeout=30)  # (closes its stdin: it stops)
        err = (tmp_path / "learner.log").read_text()
        # The death line says which machine (under torchrun or srun: which node).
        # (the ranks of an elastic world go by who joined first)
        assert re.search(rf"member 'actor' \(incarnation 1, rank \d, host {re.escape(socket.gethostname())}\) is lost",
                         err), err[-3000:]
    finally:
        learner_log.close()
        for proc in procs.values():
            if proc.poll() is None:
                proc.stdin.close()
        for proc in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)


def test_status_of_an_address_where_nothing_listens_says_so(capsys):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "machinlike", "status", f"127.0.0.1:{port}", "--once",
                           "--timeout", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "no world's store answers at 127.0.0.1:" in proc.stderr
    # The usage error in this process: the exit status reaching the shell is proven above.
    assert status_main(["status", "nowhere", "--once"]) == 2
    assert "address must be 'host:port'" in capsys.readouterr().err


HOST = """
import datetime, socket, sys
import torch.distributed as dist
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen(64)
store = dist.TCPStore("127.0.0.1", sock.getsockname()[1], None, True, datetime.timedelta(seconds=60),
                      wait_for_workers=False, master_listen_fd=sock.detach())
print(store.port, flush=True)
sys.stdin.read()
"""


def test_the_live_view_ends_with_one_line_when_the_store_goes():
    host = subprocess.Popen([sys.executable, "-c", HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    try:
        port = int(host.stdout.readline())
        view = subprocess.Popen([sys.executable, "-m", "machinlike", "status", f"127.0.0.1:{port}", "--interval",
                                 "3"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(20):  # its first view written: it reads the store
            line = view.stdout.readline()
            assert "\x1b" not in line  # (a pipe: each view after the last, no terminal codes)
            if "no machinlike world in this store" in line:
                break
        # The world's end, as the view sees it: between two reads (the screen is drawn after
        # a read, then it waits 3 s), as a store most often ends; one that ends inside a
        # read gets torch's C++ warning, which nothing here can silence once torch is loaded.
        host.kill()
        _, err = view.communicate(timeout=30)
        assert view.returncode == 1 and "the world's store stopped answering" in err, err
        assert "frame #" not in err, err  # torch's client's C++ frames, printed when its server went
    finally:
        if host.poll() is None:
            host.kill()
        host.wait(10)
