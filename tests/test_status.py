"""``python -m machinlike status``: a live elastic world's members before and after a SIGKILL,
read from its store without writing to it."""

from __future__ import annotations

import datetime
import io
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch.distributed as dist

from machinlike import launch
from machinlike._status_view import _SERVERS_TITLE, EXIT_WIDTH, BeatClock, as_json, main as status_main, render
from machinlike.distributed._launch.exits import RankExits
from machinlike.distributed._membership import record_exit
from machinlike.distributed._membership.server_notes import INTERVAL_ENV, ServerNotesPublisher, stats_interval
from machinlike.distributed._membership.status import (
    MemberStatus, ReadOnlyStore, WorldStatus, _read_exits, connect_read_only, read_status,
)
from machinlike.distributed._store import MAX_EXIT_CAUSE, ExitRecord, Keys, MemberRecord, ServerNote, ServerNotes
from machinlike.exception import ProcessExitedError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

MEMBER = """
import sys, threading, torch
from machinlike.distributed import World
from machinlike.server import OrderedServerSimpleImpl, PushPullGradServerImpl
world = World(sys.argv[1], elastic=True, init_method=sys.argv[2], liveness=1.0, dist_timeout=60)
group = world.create_rpc_group("obs")
group.register("svc/" + world.name, lambda: 1)
keys, reg = world.membership.keys, world.membership.registry
if world.name == "learner":  # the gradient server's primary and only secondary
    impl = PushPullGradServerImpl("grad", group, primary_reducer="learner", secondary_reducers=["learner"],
                                  reduce_batch_size=1, max_queue_size=4)
    model = torch.nn.Linear(2, 1)
    impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=0.1))
    impl.start()
    reg.set(keys.scratch("grad-ready"), "1")
else:  # hosts an ordered server, and pushes 3 gradients to the learner's server
    notes = OrderedServerSimpleImpl("notes", group)
    reg.wait_all(keys.scratch(""), ["grad-ready"], 30, "the learner's gradient server")
    server, client = group.get_paired("grad", timeout=30).to_here(), torch.nn.Linear(2, 1)
    for _ in range(3):
        client.weight.grad, client.bias.grad = torch.ones(1, 2), torch.ones(1)
        server.push(client)
print("ready", flush=True)
sys.stdin.read()  # until the test closes our stdin
world.stop()
print("notes threads", [t.name for t in threading.enumerate() if t.name == "machinlike-server-notes"], flush=True)
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
    """The member table's rows by member (the SERVERS section, after a blank line, left out)."""
    lines = text.splitlines()[3:]
    return {line.split()[0]: line.split() for line in lines[:lines.index("") if "" in lines else None]}


def _servers(text):
    """The SERVERS section's rows, by (server, member, role)."""
    lines = text.splitlines()
    cells = [line.split() for line in lines[lines.index(_SERVERS_TITLE) + 2:]]
    return {(c[0], c[2], c[3]): c for c in cells if c}


def _status_here(address):
    """``python -m machinlike status ADDRESS --once``, its ``main`` run in this process.

    A second interpreter would import torch again (seconds) to run the same function; the
    command line itself and its exit status reaching the shell are proven by
    ``test_status_of_an_address_where_nothing_listens_says_so``.
    """
    out = io.StringIO()
    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "250"  # (the view cuts its lines at the terminal's width: the checks read whole ones)
    try:
        assert status_main(["status", address, "--once"], out=out) == 0
    finally:
        if columns is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = columns
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


def test_status_lists_members_and_servers_before_and_after_a_kill_and_only_reads(world_store, tmp_path):
    address, host = world_store
    # (the servers' numbers every 0.5 s, not 5: the view below sees the pushes' without waiting)
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
               MACHINLIKE_SERVER_STATS_INTERVAL="0.5")
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
        # The servers' numbers, as each member published them: the actor's 3 pushes, each a step.
        servers = {(n["name"], m["name"], n["role"]): n for m in record["world"]["members"] for n in m["servers"]}
        primary, secondary = servers[("grad", "learner", "primary")], servers[("grad", "learner", "secondary")]
        assert primary["kind"] == "grad" and primary["group"] == "obs", record
        assert primary["version"] == 3 and primary["applied"] == 3 and primary["lag_max"] >= 0, record
        assert secondary["accepted"] == 3 and secondary["refused"] == 0 and secondary["queued"] == 0, record
        assert servers[("notes", "actor", "host")]["kind"] == "ordered", record  # (the grad's own is not listed)
        assert len(servers) == 3 and 0 <= members["learner"]["servers_age"] < 5, record
        table = _servers(text)
        assert table[("obs:grad", "learner", "primary")][4:7] == ["3", "3", "3"], text  # version, accepted, applied
        assert table[("obs:grad", "learner", "secondary")][5:8] == ["3", "-", "0"], text  # accepted, -, refused
        assert ("obs:notes", "actor", "host") in table, text

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
        # (no launcher here: what its declarer saw; a live member's EXIT is "-")
        assert rows["actor"][8:10] == ["process", "gone"] and rows["learner"][9] == "-", text
        assert "1 alive of 2; deaths 1" in text and "obs:svc/actor" not in text and "obs:svc/learner" in text
        assert {member for _, member, _ in _servers(text)} == {"learner"}, text  # (the lost one's numbers: gone)

        recording = _Recording(dist.TCPStore("127.0.0.1", int(address.rsplit(":", 1)[1]), is_master=False,
                                             timeout=datetime.timedelta(seconds=10), wait_for_workers=False))
        status = read_status(ReadOnlyStore(recording))
        assert status.alive() == ["learner"] and recording.calls <= {"check", "get"}, recording.calls
        out, _ = procs["learner"].communicate(timeout=30)  # (closes its stdin: it stops)
        # A clean stop ends the publisher's thread and deletes the member's key.
        assert "notes threads []" in out and not host.check([Keys(status.namespace).server_notes("learner")]), out
        err = (tmp_path / "learner.log").read_text()
        # The death line says which machine (under torchrun or srun: which node).
        # (the ranks of an elastic world go by who joined first)
        assert re.search(rf"member 'actor' \(incarnation 1, rank \d, host {re.escape(socket.gethostname())}\) is lost: "
                         r"process gone", err), err[-3000:]
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
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "machinlike", "status", f"127.0.0.1:{port}",
                           "--once", "--timeout", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1 and "no world's store answers at 127.0.0.1:" in proc.stderr
    # The tool's process imports the store reader, not the whole package (about a second less).
    imported = set(re.findall(r"\| +(machinlike[\w.]*)$", proc.stderr, re.M))
    assert "machinlike.distributed._membership.status" in imported, sorted(imported)
    assert not imported & {"machinlike.server", "machinlike.pool", "machinlike.distributed._world",
                           "machinlike.distributed._membership.membership"}, sorted(imported)
    # The usage error in this process: the exit status reaching the shell is proven above.
    assert status_main(["status", "nowhere", "--once"]) == 2
    assert "address must be 'host:port'" in capsys.readouterr().err
    # Cold trial 30: inf passed "> 0" and ended in an OverflowError's traceback.
    for flag in ("--timeout", "--interval", "--beat-window"):
        assert status_main(["status", "127.0.0.1:1", "--once", flag, "inf"]) == 2
        assert f"{flag} must be > 0 seconds and under a day, got inf" in capsys.readouterr().err
    # A port where something else listens (another program): the fix is the address, not a World's.
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(4)
        assert status_main(["status", f"127.0.0.1:{other.getsockname()[1]}", "--once", "--timeout", "0.5"]) == 1
    err = capsys.readouterr().err
    assert "did not answer as a world's store within 0.5 s: check the address" in err and "MASTER_PORT" not in err


def test_status_of_a_port_that_answers_but_is_no_store_prints_one_line_not_torchs_frames():
    # Something else answers there (a web server): torch's client logged a page of C++
    # frames for each of its retries before the tool's one line (cold trial 30).
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen(8)
        other.settimeout(0.2)
        done = threading.Event()

        def answer() -> None:
            while not done.is_set():
                try:
                    conn, _ = other.accept()
                except OSError:
                    continue
                with conn:
                    conn.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n" * 4)

        server = threading.Thread(target=answer, daemon=True)
        server.start()
        env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("TORCH_CPP_LOG_LEVEL", None)
        try:
            proc = subprocess.run([sys.executable, "-m", "machinlike", "status", f"127.0.0.1:{other.getsockname()[1]}",
                                   "--once", "--timeout", "1.5"], cwd=ROOT, env=env, capture_output=True, text=True,
                                  timeout=60)
        finally:
            done.set()
            server.join(5)
    assert proc.returncode == 1 and "did not answer as a world's store" in proc.stderr, proc.stderr
    assert "frame #" not in proc.stderr and "TCPStore.cpp" not in proc.stderr, proc.stderr


def test_the_tool_says_at_once_on_a_terminal_which_store_it_reads_and_knows_its_own_command_line():
    from machinlike.__main__ import announce
    from machinlike._lean import status_tool

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    for argv, said in [(["status", "tcp://h:1", "--once"], True), (["status", "--json", "h:1"], True),
                       (["status", "--help"], False), (["status"], False)]:
        err = Terminal()
        announce(argv, err)
        assert ("reading the world's store at " in err.getvalue()) is said, (argv, err.getvalue())
    piped = io.StringIO()  # a script's stderr: nothing new
    announce(["status", "h:1", "--json"], piped)
    assert piped.getvalue() == ""
    python = sys.executable
    assert status_tool(["-m"], [python, "-X", "importtime", "-m", "machinlike", "status", "h:1"])
    assert status_tool(["-m"], [python, "-mmachinlike", "status", "h:1"])
    assert not status_tool(["-m"], [python, "-m", "machinlike.status_other", "status"])
    assert not status_tool(["-m"], [python, "-m", "pytest", "status"])
    assert not status_tool(["/x/machinlike/__main__.py", "status"], [python, "-m", "machinlike", "status"])
    assert not status_tool(["-c"], [python, "-c", "import machinlike", "-m", "machinlike", "status"])


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
        assert view.returncode == 0 and "the world's store stopped answering" in err, err  # (it showed the world)
        assert "frame #" not in err, err  # torch's client's C++ frames, printed when its server went
    finally:
        if host.poll() is None:
            host.kill()
        host.wait(10)



def _status_with_servers(published, servers=True):
    """A world of two: a learner whose gradient server refused 22% of the pushes, and a lost actor."""
    notes = [ServerNote("grad", "grad", "g", "primary", version=41, accepted=780, applied=780, dropped=0, queued=1,
                        lag_mean=0.25, lag_max=2, since=0.5),
             ServerNote("grad", "grad", "g", "secondary", accepted=780, refused=220, dropped=0, queued=3)]
    learner = MemberStatus("learner", "alive", 1, 1, 0, 11, "", 5, values=["g:grad"], servers=notes if servers else [],
                           servers_time=published)
    actor = MemberStatus("actor", "lost", 1, 1, 1, 12, "", 3)
    return WorldStatus("elastic", "mlk/0/e/", [learner, actor], deaths=1, rejoins=0, leaves=0, events=3)


def test_the_servers_section_and_json_show_each_servers_numbers_and_their_age():
    status = _status_with_servers(time.time() - 3.0)
    text = render("tcp://h:1", status, BeatClock(), time.monotonic(), 200)
    table = _servers(text)
    assert set(table) == {("g:grad", "learner", "primary"), ("g:grad", "learner", "secondary")}, text
    primary, secondary = table[("g:grad", "learner", "primary")], table[("g:grad", "learner", "secondary")]
    assert primary[4:8] == ["41", "780", "780", "-"] and primary[10] == "0.25/2", text
    assert secondary[5:9] == ["780", "-", "220", "(22%)"], text  # the share refused: the operator's first question
    # Since its newest version (0.5 s when published, 3 s ago: as published), and the numbers' age.
    since, age = (float(cell.removesuffix("s")) for cell in primary[11:13])
    assert 3.0 <= age < 5.0 and since == 0.5, text
    assert _rows(text)["actor"][1] == "lost", text  # (the member table above it, as before)
    quiet = render("tcp://h:1", _status_with_servers(None, servers=False), BeatClock(), time.monotonic(), 200)
    assert "\nSERVERS (" not in quiet and "" not in quiet.splitlines()  # none published: no section

    record = json.loads(as_json("tcp://h:1", status, BeatClock(), time.monotonic()))
    learner, actor = record["world"]["members"]
    assert learner["servers"][1] == {"kind": "grad", "name": "grad", "group": "g", "role": "secondary",
                                     "accepted": 780, "refused": 220, "dropped": 0, "queued": 3}, learner
    assert 3.0 <= learner["servers_age"] < 4.0 and learner["servers_published"] == status.members[0].servers_time
    assert actor["servers"] == [] and actor["servers_age"] is None


def test_server_notes_round_trip_and_a_bad_interval_is_named(monkeypatch):
    notes = ServerNotes(2, 1718000000.1234, tuple(_status_with_servers(0.0).members[0].servers))
    text = notes.encode()
    assert len(text) < 400 and '"refused":220' in text and "null" not in text  # compact: what applies only
    assert ServerNotes.decode(text) == notes._replace(time=1718000000.123)
    assert ServerNotes.decode("") is None and ServerNotes.decode('{"inc": 1}') is None
    monkeypatch.delenv(INTERVAL_ENV, raising=False)
    assert stats_interval() == 5.0
    monkeypatch.setenv(INTERVAL_ENV, "0")
    assert stats_interval() == 0.0  # (off)
    for bad in ("0.01", "-1", "nan", "soon"):
        monkeypatch.setenv(INTERVAL_ENV, bad)
        with pytest.raises(ValueError, match=f"{INTERVAL_ENV}='{bad}' must be a number of seconds of at least 0.1"):
            stats_interval()


class _Server:
    """A server's side of the publisher: its notes, counted as they are asked for."""

    def __init__(self, name):
        self.name, self.asked = name, 0

    def notes(self):
        self.asked += 1
        return [ServerNote("ordered", self.name, "g", "host", accepted=self.asked)]


def _notes_threads():
    return [t for t in threading.enumerate() if t.name == "machinlike-server-notes"]


def test_the_publisher_keeps_one_key_per_member_and_ends_with_its_last_server_or_its_close(world_store):
    _, host = world_store
    keys = Keys("mlk/0/e/")
    key = keys.server_notes("learner")
    # (60 s: every wait below that ends sooner is a wake-up, not the interval)
    publisher = ServerNotesPublisher(host, keys, "learner", lambda: 2, 60.0)
    assert _notes_threads() == []  # nothing before a server
    a, b = _Server("a"), _Server("b")
    withdraw_a = publisher.add(a.notes)
    withdraw_b = publisher.add(b.notes)
    deadline = time.monotonic() + 10
    while not host.check([key]) and time.monotonic() < deadline:
        time.sleep(0.01)  # (the first write comes at once)
    notes = ServerNotes.decode(host.get(key).decode())
    assert notes.incarnation == 2 and {n.name for n in notes.servers} <= {"a", "b"} and len(_notes_threads()) == 1
    withdraw_a()
    withdraw_a()  # (twice: nothing)
    time.sleep(0.2)
    assert host.check([key]) and a.asked <= 1  # b still serves; no write before the interval
    started = time.monotonic()
    withdraw_b()  # the last one: the key goes and the thread ends, at once
    for thread in _notes_threads():
        thread.join(5)
    assert not host.check([key]) and _notes_threads() == [] and time.monotonic() - started < 5

    # A server dropped without close(): held weakly, its notes go with it (at the next look).
    quick, c = ServerNotesPublisher(host, keys, "actor", lambda: 1, 0.2), _Server("c")
    quick.add(c.notes)
    while not host.check([keys.server_notes("actor")]) and time.monotonic() < deadline:
        time.sleep(0.01)
    del c
    for thread in _notes_threads():
        thread.join(5)
    assert not host.check([keys.server_notes("actor")]) and _notes_threads() == []

    d = _Server("d")
    publisher.add(d.notes)
    while not host.check([key]) and time.monotonic() < deadline:
        time.sleep(0.01)
    started = time.monotonic()
    publisher.close(5.0)  # the World's stop: no interval waited out
    assert time.monotonic() - started < 2 and not host.check([key]) and _notes_threads() == []
    publisher.add(d.notes)  # (after close: nothing)
    assert _notes_threads() == []


def _wait_key(store, key, held, deadline):
    while store.check([key]) != held and time.monotonic() < deadline:
        time.sleep(0.01)
    return store.check([key]) == held


def test_a_member_declared_lost_never_writes_over_its_successor_nor_brings_back_its_reaped_key(world_store):
    # A member paused past the loss bound resumes: its publisher's next write finds the key
    # reaped (or its successor's), writes nothing, and ends, keeping no one's numbers hidden.
    _, host = world_store
    keys = Keys("mlk/0/e/")
    key = keys.server_notes("learner")
    deadline = time.monotonic() + 20
    # An earlier incarnation's leftover is replaced by the next incarnation's first write.
    host.set(key, ServerNotes(1, 0.0, ()).encode())
    old_server, new_server = _Server("old"), _Server("new")
    old = ServerNotesPublisher(host, keys, "learner", lambda: 2, 0.1)
    old.add(old_server.notes)
    while ServerNotes.decode(host.get(key).decode()).incarnation != 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ServerNotes.decode(host.get(key).decode()).incarnation == 2
    # Declared lost: the others reap its key; its next write does not bring the key back.
    host.delete_key(key)
    asked = old_server.asked
    while _notes_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert old.superseded and _notes_threads() == [] and old_server.asked > asked and not host.check([key])
    # Its successor publishes; a stale publisher of incarnation 2 that resumes now leaves it alone.
    new = ServerNotesPublisher(host, keys, "learner", lambda: 3, 0.1)
    withdraw = new.add(new_server.notes)
    assert _wait_key(host, key, True, deadline)
    stale = ServerNotesPublisher(host, keys, "learner", lambda: 2, 0.1)
    stale._mine = ServerNotes(2, 1.0, ()).encode()  # (what it wrote before its pause)
    stale_server = _Server("stale")
    stale.add(stale_server.notes)
    while not stale.superseded and time.monotonic() < deadline:
        time.sleep(0.01)
    notes = ServerNotes.decode(host.get(key).decode())
    assert stale.superseded and notes.incarnation == 3 and [n.name for n in notes.servers] == ["new"]
    withdraw()  # the successor's own end deletes its key
    assert _wait_key(host, key, False, deadline)
    new.close(5.0)
    stale.close(5.0)


# ------------------------------------------------------------------ exit causes
_MONITOR_LOG = "machinlike.distributed._membership.monitor"


def _ends_badly(world, logs):
    """Rank 0 watches; once it is ready, rank 1 raises and rank 2 is SIGKILLed, in each of
    their incarnations; rank 0 returns the status view of the end (``--once --json``).
    Each process's monitor lines go to a file of its own in ``logs`` (whoever watches a
    member declares it)."""
    m = world.membership
    armed = m.keys.scratch("exit/armed")
    lines = logging.FileHandler(os.path.join(logs, f"{world.name}.{world.incarnation}.log"))
    logging.getLogger(_MONITOR_LOG).addHandler(lines)
    if world.rank != 0:
        m.registry.wait_all(m.keys.scratch("exit/"), ["armed"], 30, "rank 0")
        if world.rank == 1:
            if world.incarnation == 2:
                with world:  # (its record comes from World.__exit__ then, not from launch's rank body)
                    raise ValueError("bad thing")
            raise ValueError("bad thing")
        os.kill(os.getpid(), signal.SIGKILL)
    last = 2 if world.elastic else 1  # (elastic: each is restarted once, and ends so again)
    ended = {}
    done = threading.Event()

    def seen(event):
        if event.kind != "join" and event.incarnation == last:
            ended[event.member] = event.kind
            if len(ended) == 2:
                done.set()

    world.on_member_change(seen)
    m.registry.set(armed, "1")
    assert done.wait(30), ended
    store = connect_read_only(world.store_address, 10)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # the launcher writes as it hears of rank 2's end, as the monitor does
        status = read_status(store)
        by = {mem.name: mem.exit_by for mem in status.members}
        if by.get("1") == "member" and by.get("2") == "launcher":
            break
        time.sleep(0.05)
    out = io.StringIO()
    assert status_main(["status", world.store_address, "--once", "--json", "--beat-window", "0.1"], out=out) == 0
    return out.getvalue(), ended


@pytest.mark.parametrize("elastic", [False, True], ids=["static", "elastic"])
def test_the_view_and_the_loss_line_say_how_each_member_ended(elastic, tmp_path):
    options = dict(max_restarts=1, essential=[0]) if elastic else dict(collective=False)
    results = launch(_ends_badly, 3, args=(str(tmp_path),), return_exceptions=True, timeout=90, stop_timeout=1.0,
                     liveness=1.0, **options)
    assert isinstance(results[1], ValueError) and isinstance(results[2], ProcessExitedError), results
    assert not isinstance(results[0], BaseException), results[0]
    view, ended = results[0]
    lines = [line for log in tmp_path.glob("*.log") for line in log.read_text().splitlines()]
    members = {m["name"]: m for m in json.loads(view)["world"]["members"]}
    last = 2 if elastic else 1
    # The member's own account of its exception; the launcher's of the signal (what the
    # watcher saw, "process gone", gives way to both).
    assert (members["1"]["exit"], members["1"]["exit_by"]) == ("raised ValueError: bad thing", "member"), view
    assert (members["2"]["exit"], members["2"]["exit_by"]) == ("killed by signal SIGKILL (9)", "launcher"), view
    assert [members[n]["incarnation"] for n in "12"] == [last, last], view
    assert members["0"]["exit"] is None and members["0"]["state"] == "alive", view
    assert members["2"]["state"] == "lost" and ended == {"1": "leave" if elastic else "lost", "2": "lost"}, view
    # The survivors' line names the cause known when it is written: rank 1's own was
    # recorded before its process ended (a static rank is declared lost; an elastic one leaves).
    if not elastic:
        assert any(re.search(r"member '1' \(incarnation 1, rank 1, host [^)]*\) is lost: raised ValueError: bad thing",
                             line) for line in lines), lines
    assert any(re.search(r"member '2' \(incarnation %d, rank 2, host [^)]*\) is lost: "
                         r"(killed by signal SIGKILL \(9\)|process gone)" % last, line) for line in lines), lines


def test_an_exit_record_is_one_bounded_line_that_says_which_incarnation():
    cause = "raised RuntimeError: " + "x|y\n" * 100
    record = ExitRecord(3, 4242, "member", cause)
    text = record.encode()
    assert "\n" not in text and len(text) <= len("3|4242|member|") + MAX_EXIT_CAUSE and text.endswith("...")
    back = ExitRecord.decode(text)
    assert back[:3] == (3, 4242, "member") and back.cause.startswith("raised RuntimeError: x|y x|y")
    for other in ("", "lost", "1|2|nobody|x", "a|2|member|x", "1|member|x"):
        assert ExitRecord.decode(other) is None, other
    # A better source of the same incarnation, or any newer incarnation, replaces a record.
    watcher, launcher, member = (ExitRecord(2, 9, by, "") for by in ("watcher", "launcher", "member"))
    assert member.outranks(launcher) and launcher.outranks(watcher) and not watcher.outranks(member)
    assert not member.outranks(member) and watcher._replace(incarnation=3).outranks(member)
    assert not member._replace(incarnation=1).outranks(watcher)


def _compare_set(store):
    return lambda key, old, new: store.compare_set(key, old, new).decode()


def test_the_most_precise_account_stays_whoever_writes_first(world_store):
    _, store = world_store
    keys = Keys.elastic_world("0")
    cas = _compare_set(store)
    watcher = ExitRecord(1, 7, "watcher", "process gone")
    launcher = ExitRecord(1, 7, "launcher", "killed by signal SIGKILL (9)")
    assert record_exit(cas, keys, "a", watcher) == watcher
    assert record_exit(cas, keys, "a", launcher) == launcher  # better: replaces
    assert record_exit(cas, keys, "a", watcher) == launcher  # worse, later: kept out
    later = ExitRecord(2, 8, "watcher", "heartbeat silent for 7.6 s")
    assert record_exit(cas, keys, "a", later) == later  # the next incarnation's overwrites
    assert record_exit(cas, keys, "a", launcher) == later  # and an older one's never comes back
    store.set(keys.exit_cause("b"), "left by something else")
    assert record_exit(cas, keys, "b", watcher) == watcher  # text of another form is replaced
    assert ExitRecord.decode(store.get(keys.exit_cause("a")).decode()) == later


def _member(name, state, incarnation, pid, exit=None, by=None):
    return MemberStatus(name=name, state=state, incarnation=incarnation, started=incarnation, rank=0, pid=pid,
                        host="", beats=None, exit=exit, exit_by=by)


def test_the_exit_column_and_json_say_how_the_ones_not_alive_ended():
    long = "raised ValueError: " + "very " * 30 + "bad"
    status = WorldStatus(kind="elastic", namespace="mlk/0/e/", deaths=2, rejoins=0, leaves=1, events=6, members=[
        _member("learner", "alive", 1, 10), _member("w1", "lost", 2, 11, "killed by signal SIGKILL (9)", "launcher"),
        _member("w2", "left", 1, 12, long, "member"), _member("w3", "lost", 1, 13)])
    clock = BeatClock()
    text = render("127.0.0.1:1", status, clock, 0.0, 240)
    header, *rows = text.splitlines()[2:]
    at = header.index("EXIT")
    assert header.index("LAST BEAT") < at < header.index("SERVICES")
    cells = {row.split()[0]: row[at:].split("  ")[0] for row in rows}
    assert cells == {"learner": "-", "w1": "killed by signal SIGKILL (9)", "w2": long[:EXIT_WIDTH - 3] + "...",
                     "w3": "-"}, text
    members = {m["name"]: m for m in json.loads(as_json("127.0.0.1:1", status, clock, 0.0))["world"]["members"]}
    assert [(members[n]["exit"], members[n]["exit_by"]) for n in ("learner", "w1", "w2", "w3")] == [
        (None, None), ("killed by signal SIGKILL (9)", "launcher"), (long, "member"), (None, None)]


def test_the_launcher_names_the_incarnation_its_rank_was(world_store):
    _, store = world_store
    keys = Keys.elastic_world("0")
    exits = RankExits(store, ["a", "b"], elastic=True)
    # Its claim still names its pid: that claim's incarnation.
    store.set(keys.incarnations("a"), "3")
    store.set(keys.live("a"), MemberRecord("a", 2, "w", 0, "host@boot/ns/4242").encode())
    exits.chaos(4242)
    exits.record(0, 4242, ProcessExitedError("rank 0 ('a')", 4242, -signal.SIGKILL))
    assert store.get(keys.exit_cause("a")).decode() == "2|4242|launcher|killed by signal SIGKILL (9) (chaos)"
    # Its claim is cleared already (its watcher declared it): the newest incarnation counted.
    store.set(keys.live("a"), "")
    exits.record(0, 4343, ValueError("bad thing"))  # (a reported exception, not an exit of its own)
    assert store.get(keys.exit_cause("a")).decode() == "3|4343|launcher|raised ValueError: bad thing"
    exits.record(1, 77, ProcessExitedError("rank 1 ('b')", 77, 3))  # never counted in: nothing to say
    assert not store.check([keys.exit_cause("b")])
    static = RankExits(store, ["s0"], elastic=False)
    static.record(0, 55, ProcessExitedError("rank 0 ('s0')", 55, 3))  # its World never got a namespace
    store.set(Keys.static_counter("0", 0), "1")
    static.record(0, 55, ProcessExitedError("rank 0 ('s0')", 55, 3))
    assert store.get(Keys.static_world("0", 1).exit_cause("s0")).decode() == "1|55|launcher|exited with code 3"
    assert not store.check([Keys.static_world("0", 0).exit_cause("s0")])


def test_the_view_shows_a_cause_only_for_the_incarnation_and_process_it_is_about(world_store):
    _, store = world_store
    keys = Keys.elastic_world("0")
    members = [_member("a", "lost", 2, 11), _member("b", "lost", 2, 12), _member("c", "left", 1, None),
               _member("d", "alive", 1, 14)]
    for name, record in (("a", "1|11|member|raised ValueError: the first one"),  # an older incarnation's
                         ("b", "2|99|launcher|killed by signal SIGKILL (9)"),  # another process's
                         ("c", "1|13|member|raised KeyError: 'k'"),  # (no pid shown: the incarnation decides)
                         ("d", "1|14|launcher|exited with code 1")):  # alive: nothing to say
        store.set(keys.exit_cause(name), record)
    _read_exits(ReadOnlyStore(store), keys, members)
    assert [(m.exit, m.exit_by) for m in members] == [(None, None), (None, None), ("raised KeyError: 'k'", "member"),
                                                     (None, None)]


_STORE_HOST = """
import datetime, socket, sys
import torch.distributed as dist
sock = socket.socket()
sock.bind(("127.0.0.1", 0))
sock.listen(16)
port = sock.getsockname()[1]
store = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=10), wait_for_workers=False,
                      master_listen_fd=sock.detach())
print(port, flush=True)
sys.stdin.read()
"""


def test_a_publisher_whose_store_was_sigkilled_says_so_once_and_still_ends_at_once(caplog):
    # The store's host died (SIGKILL): the servers never hear of it from the publisher,
    # its warning comes once, and the World's stop does not wait out a store timeout.
    from machinlike.distributed._store import new_client

    host = subprocess.Popen([sys.executable, "-c", _STORE_HOST], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        port = int(host.stdout.readline())
        client = new_client("127.0.0.1", port, datetime.timedelta(seconds=10))
        keys = Keys("mlk/0/e/")
        publisher = ServerNotesPublisher(client, keys, "learner", lambda: 1, 0.1)
        server = _Server("a")
        publisher.add(server.notes)
        deadline = time.monotonic() + 10
        while not client.check([keys.server_notes("learner")]) and time.monotonic() < deadline:
            time.sleep(0.01)
        host.kill()
        host.wait(10)
        asked = server.asked
        with caplog.at_level("WARNING", logger="machinlike.distributed._membership.server_notes"):
            while server.asked < asked + 5 and time.monotonic() < deadline:
                time.sleep(0.05)  # (it goes on asking its servers, and tries every interval)
        said = [r.getMessage() for r in caplog.records if "could not publish its servers' numbers" in r.getMessage()]
        assert server.asked >= asked + 5 and len(said) == 1, (server.asked, said)
        started = time.monotonic()
        publisher.close(5.0)
        assert time.monotonic() - started < 1.0 and _notes_threads() == []
    finally:
        host.kill()
