"""Worlds beyond one machine: hosts are Linux network namespaces wired to one switch.

    namespace <tag>-sw   bridge br0 with ports p0, p1, p2        (the switch)
                                          │   │   │   veth pairs ("cables")
    namespace <tag>-h0   eth0 198.18.0.1/24 + lo                  (host 0: the master)
    namespace <tag>-h1   eth0 198.18.0.2/24 + lo
    namespace <tag>-h2   eth0 198.18.0.3/24 + lo

Every host has its own network stack: its loopback is its own, and the hostname resolves
to 127.0.0.1 there as everywhere on this machine, so a rank that advertised "the address
of the hostname" (TensorPipe's and gloo's default) would send its peers to their own
loopback. The addresses come from 198.18.0.0/15 (reserved for benchmarks, never routed),
and exist only inside these namespaces; nothing here touches the machine's own network.
Names carry this process's pid and a random token, so parallel runs never collide; each
test removes its namespaces (and every process in them) even when it fails, and a later
run removes those a killed run left behind.

The ranks are started the way a cluster job script starts them: ``ip netns exec <host>
python tests/_multihost_job.py`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import select
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import pytest

from machinlike.distributed import World
from machinlike.distributed._transport import netif as _netif

ROOT = Path(__file__).resolve().parent.parent
JOB = Path(__file__).resolve().parent / "_multihost_job.py"
EXAMPLES = ROOT / "examples"
NS_PREFIX = "mlktest"
SUBNET = "198.18.0"
LIBRARY_VARS = ("TP_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME", _netif.ENV_VAR)


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)} failed: {done.stderr.strip()}")


def _remove_stale_namespaces() -> None:
    """Delete namespaces of earlier runs whose process is gone (a run killed mid-test)."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=10).stdout
    for name in re.findall(rf"^({NS_PREFIX}-(\d+)-\w+-\w+)", listing, flags=re.M):
        ns, pid = name[0], int(name[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=10)
        except PermissionError:  # alive, someone else's
            pass


class Lan:
    """A few hosts (network namespaces) on one switch, and the rank processes run on them."""

    def __init__(self, hosts: int, workdir: Path) -> None:
        self.tag = f"{NS_PREFIX}-{os.getpid()}-{secrets.token_hex(3)}"
        self.switch = f"{self.tag}-sw"
        self.hosts = [f"{self.tag}-h{i}" for i in range(hosts)]
        self.addresses = [f"{SUBNET}.{i + 1}" for i in range(hosts)]
        self.workdir = workdir
        self.port: Optional[int] = None  # the master port of the last run_ranks
        self._created: List[str] = []
        self._procs: List[subprocess.Popen] = []

    # ----------------------------------------------------------------- the network
    def build(self) -> None:
        """Create the namespaces and cables; skip the test where that is impossible."""
        if sys.platform != "linux":
            pytest.skip("network namespaces are a Linux feature")
        if os.geteuid() != 0:
            pytest.skip("creating network namespaces needs root (run the netns tests as root)")
        if shutil.which("ip") is None:
            pytest.skip("the 'ip' command (iproute2) is not installed")
        _remove_stale_namespaces()
        try:
            self._add_namespace(self.switch)
        except RuntimeError as err:
            pytest.skip(f"cannot create a network namespace here: {err}")
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        for i, (host, address) in enumerate(zip(self.hosts, self.addresses)):
            self._add_namespace(host)
            _ip("-n", self.switch, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0", "netns", host)
            _ip("-n", self.switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", host, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", host, "link", "set", "eth0", "up")
            _ip("-n", host, "link", "set", "lo", "up")

    def name_hosts(self, names: List[str]) -> None:
        """Give the hosts names that resolve inside every namespace, as a cluster's DNS would.

        ``ip netns exec`` binds ``/etc/netns/<namespace>/hosts`` over ``/etc/hosts``, so the
        names exist only for the processes started on these hosts.
        """
        lines = "127.0.0.1 localhost\n" + "".join(f"{a} {n}\n" for a, n in zip(self.addresses, names))
        for host in self.hosts:
            folder = Path("/etc/netns") / host
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(lines)

    def _add_namespace(self, name: str) -> None:
        _ip("netns", "add", name)
        self._created.append(name)

    def unplug(self, host: int) -> None:
        """Take the host's switch port down: its frames are dropped, ARP goes unanswered."""
        _ip("-n", self.switch, "link", "set", f"p{host}", "down")

    def blackhole(self, host: int, address: str) -> None:
        """Give ``host`` a blackhole route to ``address``: connecting fails at once."""
        _ip("-n", self.hosts[host], "route", "add", "blackhole", f"{address}/32")

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)  # the rank and whatever it started
            proc.wait(10)
        for name in reversed(self._created):
            # Anything still inside was started by this test (e.g. torchrun's workers).
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=10).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=10)
            shutil.rmtree(Path("/etc/netns") / name, ignore_errors=True)
        self._created.clear()

    # ----------------------------------------------------------------- processes
    def free_port(self, host: int) -> int:
        """A free port on ``host``; nothing else runs in its namespace, so it stays free."""
        probe = "import socket,sys; s=socket.socket(); s.bind((sys.argv[1],0)); print(s.getsockname()[1])"
        done = subprocess.run(["ip", "netns", "exec", self.hosts[host], sys.executable, "-c", probe,
                               self.addresses[host]], capture_output=True, text=True, timeout=30)
        assert done.returncode == 0, done.stderr
        return int(done.stdout)

    def start(self, host: int, argv: List[str], env: Dict[str, str], label: str) -> subprocess.Popen:
        base = {k: v for k, v in os.environ.items()
                if k not in LIBRARY_VARS and not k.startswith(("TORCHELASTIC_", "MASTER_", "SLURM_"))}
        base.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                    OMP_NUM_THREADS="1", MLK_HOST_ADDR=self.addresses[host])
        base.update(env)
        out = open(self.workdir / f"{label}.out", "w")
        err = open(self.workdir / f"{label}.err", "w")
        with out, err:
            proc = subprocess.Popen(["ip", "netns", "exec", self.hosts[host], *argv], env=base,
                                    stdout=out, stderr=err, start_new_session=True, cwd=ROOT)
        self._procs.append(proc)
        return proc

    def wait(self, procs: List[subprocess.Popen], labels: List[str], timeout: float) -> List[str]:
        """Wait for all (one deadline); the stdout of each. Fails naming the late ones."""
        deadline = time.monotonic() + timeout
        late = []
        for proc, label in zip(procs, labels):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                late.append(label)
        if late:
            pytest.fail(f"{late} still running after {timeout} s\n" + self.logs(labels))
        return [(self.workdir / f"{label}.out").read_text() for label in labels]

    def logs(self, labels: List[str]) -> str:
        parts = []
        for label in labels:
            for kind in ("out", "err"):
                text = (self.workdir / f"{label}.{kind}").read_text()
                parts.append(f"--- {label} std{kind} (last 3000 chars)\n{text[-3000:]}")
        return "\n".join(parts)

    def run_ranks(self, scenario: str, timeout: float, extra_env: Optional[Dict[int, Dict[str, str]]] = None,
                  wait: float = 60.0, slurm: Optional[Dict[str, str]] = None) -> List[Dict[str, Any]]:
        """One rank per host, master on host 0; the ``RESULT`` report of each rank.

        ``slurm``: start the ranks as srun would, with these job-wide SLURM variables plus
        each task's SLURM_PROCID, instead of torchrun's RANK/WORLD_SIZE/MASTER_*.
        """
        port = self.port = self.free_port(0)
        labels = [f"{scenario}-rank{r}" for r in range(len(self.hosts))]
        procs = []
        for rank, label in enumerate(labels):
            if slurm is None:
                env = dict(RANK=str(rank), WORLD_SIZE=str(len(self.hosts)), MASTER_ADDR=self.addresses[0],
                           MASTER_PORT=str(port))
            else:
                env = dict(slurm, SLURM_PROCID=str(rank), SLURM_LOCALID="0", SLURM_NODEID=str(rank))
            env["MLK_TEST_TIMEOUT"] = str(timeout)
            env.update((extra_env or {}).get(rank, {}))
            procs.append(self.start(rank, [sys.executable, str(JOB), scenario], env, label))
        outputs = self.wait(procs, labels, wait)
        reports = []
        for label, text in zip(labels, outputs):
            lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
            assert lines, f"{label} wrote no report\n" + self.logs(labels)
            reports.append(json.loads(lines[-1][len("RESULT "):]))
        return reports


@pytest.fixture
def lan(tmp_path):
    net = Lan(3, tmp_path)
    try:
        net.build()
        yield net
    finally:
        net.close()


# ------------------------------------------------------------------------ across hosts
EXPECTED_PARAMS = {  # make_model() after one SGD(lr=1) step on the mean of 3 ranks' gradients
    "weight": [[float(v - 2) for v in range(4)], [float(v - 2) for v in range(4, 8)]],
    "bias": [9.0, 19.0],
}


@pytest.mark.netns
def test_world_spans_hosts(lan):
    # Rank 2 names its interface by address through the one environment variable; ranks 0
    # and 1 set nothing, so the route to the master decides (the master's own route too).
    reports = lan.run_ranks("round", timeout=30, extra_env={2: {_netif.ENV_VAR: lan.addresses[2]}})
    for rank, report in enumerate(reports):
        assert report["ok"], f"rank {rank}: {report}\n" + lan.logs([f"round-rank{r}" for r in range(3)])
        assert report["interface"] == "eth0", report
        assert report["where"] == lan.addresses  # each member's service ran on its own host
        assert report["add"] == [float(rank + i) for i in range(3)]
        assert report["closure"] == [float(rank + 1)] * 2
        assert report["all_reduce"] == 6.0
        assert report["params"] == EXPECTED_PARAMS
    assert [r.get("pair_all_reduce") for r in reports] == [None, 3.0, 3.0]


@pytest.mark.netns
def test_elastic_members_join_leave_and_are_lost_across_hosts(lan):
    # The store's host joins first; a member on another host joins the running world,
    # is called and leaves; a third joins and its host is then unplugged (no FIN, no
    # RST: only its silent heartbeats tell), which the others see within the bound.
    port = lan.free_port(0)
    to_test, from_test = lan.workdir / "to-test", lan.workdir / "from-test"
    os.mkfifo(to_test)
    os.mkfifo(from_test)
    env = dict(MLK_MASTER=lan.addresses[0], MLK_PORT=str(port), MLK_TEST_TIMEOUT="30",
               MLK_TO_TEST=str(to_test), MLK_FROM_TEST=str(from_test))
    roles = ["host", "remote", "victim"]
    procs = [lan.start(i, [sys.executable, str(JOB), "elastic"], dict(env, MLK_ROLE=role), role)
             for i, role in enumerate(roles)]
    fd = os.open(to_test, os.O_RDONLY | os.O_NONBLOCK)
    try:
        ready, _, _ = select.select([fd], [], [], 60)
        assert ready, "the host never asked for the unplug\n" + lan.logs(roles)
        assert os.read(fd, 100).decode().strip() == "unplug"
    finally:
        os.close(fd)
    lan.unplug(2)
    with open(from_test, "w") as fifo:
        fifo.write("unplugged\n")
    outputs = lan.wait(procs[:2], roles[:2], 60)
    reports = [json.loads([l for l in out.splitlines() if l.startswith("RESULT ")][-1][7:]) for out in outputs]
    host, remote = reports
    assert host["ok"] and remote["ok"], lan.logs(roles)
    assert remote["host_is_at"] == lan.addresses[0]
    assert (host["remote_is_at"], host["victim_is_at"]) == (lan.addresses[1], lan.addresses[2])
    assert "not found on Group" in host["after_leave"]
    assert host["detected_after"] < 3.0, f"{host}\n{lan.logs(roles)}"  # liveness 2 s; the lease is 1.5 s of silence
    assert host["call_after_loss"].startswith("PeerLostError"), host
    # A call that was in flight fails as soon as the loss is known, not at its 30 s timeout.
    assert host["pending_call"].startswith("PeerLostError"), host
    assert host["pending_failed_after"] < 3.5, host
    assert host["pending_async"].startswith("PeerLostError") and "was lost while" in host["pending_async"], host
    assert host["pending_async_after"] < 3.5, host  # (it waited its 30 s before, a TimeoutError)
    events = [e for e in host["events"] if e[1] != "host"]
    assert sorted(events[:2]) == [["join", "remote"], ["join", "victim"]], events
    assert events[2:] == [["leave", "remote"], ["lost", "victim"]], events


def _wait_for_line(lan: Lan, label: str, line: str, timeout: float, labels: List[str]) -> None:
    path = lan.workdir / f"{label}.out"
    deadline = time.monotonic() + timeout
    while line not in path.read_text().splitlines():
        assert time.monotonic() < deadline, f"{label} never printed {line!r}\n" + lan.logs(labels)
        time.sleep(0.05)


@pytest.mark.netns
def test_a_member_declared_lost_while_it_lives_is_told_on_its_calls(lan):
    # A live member silent for longer than the lease (here SIGSTOPped: what a long GIL hold
    # or a starved CPU looks like from outside) is declared lost by the others, who free its
    # keys. When it runs again, its calls must say so, not fail later on freed keys.
    port = lan.free_port(0)
    env = dict(MLK_MASTER=lan.addresses[0], MLK_PORT=str(port), MLK_TEST_TIMEOUT="30",
               MLK_DONE_FILE=str(lan.workdir / "sleeper-done"))
    roles = ["host", "sleeper"]
    procs = [lan.start(i, [sys.executable, str(JOB), "stall"], dict(env, MLK_ROLE=role), role)
             for i, role in enumerate(roles)]
    _wait_for_line(lan, "sleeper", "READY", 60, roles)
    procs[1].send_signal(signal.SIGSTOP)
    try:
        _wait_for_line(lan, "host", "LOST", 20, roles)  # liveness 1 s: declared after 0.75 s of silence
    finally:
        procs[1].send_signal(signal.SIGCONT)
    outputs = lan.wait(procs, roles, 60)
    host, sleeper = [json.loads([l for l in out.splitlines() if l.startswith("RESULT ")][-1][7:]) for out in outputs]
    assert host["ok"] and host["sleeper_reported"], lan.logs(roles)
    assert sleeper["ok"], lan.logs(roles)
    assert sleeper["outcome"].startswith("PeerLostError"), sleeper
    assert "declared lost by the others" in sleeper["outcome"] and "liveness" in sleeper["outcome"], sleeper
    # Its register in the open group names why it is no member any more.
    assert sleeper["register"].startswith("PeerLostError") and "declared lost" in sleeper["register"], sleeper
    # A call it had pending on the host (whose answer would come only after the sleeper's
    # report, and can never reach a member cut off) ended with it, not at its timeout.
    assert sleeper["pending_call"].startswith("PeerLostError"), sleeper
    assert "cut off" in sleeper["pending_call"] and "declared lost" in sleeper["pending_call"], sleeper
    assert sleeper["pending_ended_after"] < 2.0, sleeper


@pytest.mark.netns
def test_srun_environment_spans_hosts(lan):
    # What srun gives three tasks on three nodes: no RANK or MASTER_* at all. The master is
    # the first node of the compressed node list (named only in these hosts' own hosts
    # files), on the port derived from the job id. The world is checked as "round" does,
    # but for the gradient-server round (test_world_spans_hosts runs that).
    lan.name_hosts(["cn07", "cn08", "gpu1"])
    job_id = 424242
    reports = lan.run_ranks("meet", timeout=30, slurm=dict(
        SLURM_JOB_ID=str(job_id), SLURM_NTASKS="3", SLURM_STEP_NUM_TASKS="3", SLURM_STEP_ID="0",
        SLURM_JOB_NODELIST="cn[07-08],gpu1", SLURM_STEP_NODELIST="cn[07-08],gpu1", SLURM_NNODES="3"))
    for rank, report in enumerate(reports):
        assert report["ok"], f"rank {rank}: {report}\n" + lan.logs([f"meet-rank{r}" for r in range(3)])
        assert report["interface"] == "eth0", report
        assert report["where"] == lan.addresses
        assert report["all_reduce"] == 6.0
        assert report["master"] == ["cn07", 20000 + job_id % 10000]


@pytest.mark.netns
def test_unreachable_master_is_named_within_the_timeout(lan):
    # Host 1 loses the master silently (its cable is pulled: no ARP answer), host 2 has no
    # route to it at all (connect fails at once and is retried): both must give up on time.
    lan.unplug(0)
    lan.blackhole(2, lan.addresses[0])
    # Shorter than an ARP timeout (about 3 s), so an overrun by one cannot hide in the slack.
    timeout = 2.0
    reports = lan.run_ranks("unreachable", timeout=timeout, wait=40)
    master = f"{lan.addresses[0]}:{lan.port}"
    for rank in (1, 2):
        report = reports[rank]
        assert not report["ok"] and report["type"] == "TimeoutError", report
        assert f"could not reach the world's store (the master) at {master} within 2 s" in report["message"]
        # On time: torch's own connect loop overran by a whole ARP timeout (about 3 s) here.
        assert timeout * 0.9 <= report["elapsed"] < timeout + 1.5, report
    assert reports[0]["type"] == "TimeoutError", reports[0]
    assert "World start-up: ranks: '1', '2' did not arrive within" in reports[0]["message"]


@pytest.mark.netns
def test_torchrun_across_hosts_runs_an_example(lan, tmp_path):
    # The documented multi-node launch, one agent per host, rendezvous through the c10d
    # backend on host 0. The hostname resolves to 127.0.0.1 on every "host" here, so each
    # agent is told its address (--local-addr), and host 0 that it hosts the rendezvous
    # (is_host: torch recognises the endpoint as its own only by hostname or its addresses).
    port = lan.free_port(0)
    labels = ["torchrun-node0", "torchrun-node1"]
    procs = []
    for node, label in enumerate(labels):
        argv = [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(tmp_path / "torchrun-logs"),
                "--nnodes", "2", "--nproc-per-node", "1",
                "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{lan.addresses[0]}:{port}",
                "--rdzv-id", lan.tag, "--local-addr", lan.addresses[node]]
        argv += ["--rdzv-conf", "is_host=1"] if node == 0 else []
        argv += [str(EXAMPLES / "rpc_group.py"), "--steps", "5"]
        procs.append(lan.start(node, argv, {}, label))
    out0, out1 = lan.wait(procs, labels, 90)
    assert [p.returncode for p in procs] == [0, 0], lan.logs(labels)
    assert "[0] members ['0', '1'], services registered" in out0 and "member 0: 5 calls" in out0, lan.logs(labels)
    assert "[1] saw the stop flag" in out1 and "remote result [0.0, 10.0, 20.0]" in out1, lan.logs(labels)


# -------------------------------------------------------------------- interface choice
def test_interface_order_argument_variable_library_route(monkeypatch):
    for var in LIBRARY_VARS:
        monkeypatch.delenv(var, raising=False)
    both_lo = {"TP_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    assert _netif.plan_interface(None, "127.0.0.1", 29500) == ("lo", both_lo)  # the route
    assert _netif.plan_interface(None, "localhost", 29500)[0] == "lo"
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "user-gloo")  # the user's own setting is kept
    assert _netif.plan_interface(None, "127.0.0.1", 1)[1] == {"TP_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "user-gloo"}
    assert _netif.configured_interface(None) is None
    monkeypatch.setenv(_netif.ENV_VAR, "127.0.0.1")  # one variable for both, by address
    assert _netif.configured_interface(None) == "lo"
    assert _netif.plan_interface("lo", "192.0.2.1", 1) == ("lo", both_lo)
    monkeypatch.setenv(_netif.ENV_VAR, "no-such-if0")
    assert _netif.configured_interface("lo") == "lo"  # the argument wins


@pytest.mark.parametrize(
    "interface, env, error, match",
    [
        ("no-such-if0", None, ValueError, r"interface='no-such-if0' is not a network interface of this host; pick one of .*lo \(127\.0\.0\.1"),
        ("203.0.113.77", None, ValueError, r"interface='203.0.113.77' is not an address of this host"),
        (3, None, TypeError, "interface must be a str"),
        (None, "no-such-if0", ValueError, r"environment variable MACHINLIKE_SOCKET_IFNAME='no-such-if0' is not a network interface"),
    ],
)
def test_bad_interface_is_named(monkeypatch, interface, env, error, match):
    if env is not None:
        monkeypatch.setenv(_netif.ENV_VAR, env)
    with pytest.raises(error, match=match):
        World(rank=0, world_size=1, init_method="tcp://127.0.0.1:0", interface=interface)


def test_world_sets_the_interface_for_its_life_only(monkeypatch):
    for var in LIBRARY_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "lo")
    with World(rank=0, world_size=1, init_method="tcp://127.0.0.1:0") as world:
        assert world.interface == "lo"
        assert os.environ["TP_SOCKET_IFNAME"] == "lo"
    assert "TP_SOCKET_IFNAME" not in os.environ  # restored: the next World may have another master
    assert os.environ["GLOO_SOCKET_IFNAME"] == "lo"


def test_route_source_asks_the_routing_table():
    assert _netif.route_source("127.0.0.1", 9) == "127.0.0.1"
    assert _netif.route_source("no-such-host.invalid", 9) is None
    table = _netif.interface_addresses()
    assert "127.0.0.1" in table["lo"]


def test_loopback_interface_is_refused_when_the_master_is_another_host():
    with pytest.raises(ValueError, match=r"TP_SOCKET_IFNAME='lo' is a loopback interface, but the master "
                                         r"203\.0\.113\.9 is another host.*This host has: .*lo \(127\.0\.0\.1"):
        _netif.refuse_loopback_for_remote_master({"TP_SOCKET_IFNAME": "lo"}, "203.0.113.9")
    _netif.refuse_loopback_for_remote_master({"TP_SOCKET_IFNAME": "lo"}, "127.0.0.1")  # master here: fine
    _netif.refuse_loopback_for_remote_master({"TP_SOCKET_IFNAME": "lo"}, "no-such-host.invalid")  # cannot tell


def test_start_up_errors_of_torch_name_the_interface():
    with World(rank=0, world_size=1, init_method="tcp://127.0.0.1:0", interface="lo") as world:
        with pytest.raises(RuntimeError, match="connection refused") as info:
            with world._network_hint():
                raise RuntimeError("connection refused")
    (note,) = info.value.__notes__
    assert note.startswith("machinlike: this process offers interface lo (127.0.0.1")
    assert note.endswith("to its peers for RPC and collectives; if they cannot connect to it, choose the "
                         "interface with World(interface=...) or MACHINLIKE_SOCKET_IFNAME")
