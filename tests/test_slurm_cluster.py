"""A real single-node SLURM (slurmctld + slurmd on this machine) runs the examples.

The fixture writes a private configuration (its own ports, state and spool folders, no
munge: ``auth/none``), starts both daemons and stops them after the module; it skips
where SLURM is not installed (Debian: ``apt-get install slurm-wlm``) or not root. The
node is this machine under its hostname, which resolves to 127.0.0.1 here, so every
connection stays on loopback.

``MinJobAge=0`` (finished jobs' records are kept for the cluster's short life) is there
for time: ``sbatch --wait`` polls every 2 s, but quadruples that pause (2, 8, 32 s) while
it is under half of MinJobAge (300 s by default), so a 12 s job kept it waiting 42 s.
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from machinlike.distributed._store.rendezvous import slurm_master_port
from proc_util import free_port

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "examples"


def _port_is_free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class Slurm:
    """slurmctld and slurmd with a configuration of their own."""

    def __init__(self, workdir: Path) -> None:
        self.dir = workdir
        self.conf = workdir / "slurm.conf"
        self.procs: list = []
        # A first job id whose master port (derived from the job id) is free right now.
        self.first_job = next(j for j in range(1000 + os.getpid() % 5000, 10**6) if _port_is_free(slurm_master_port(j)))

    def env(self) -> dict:
        clean = {k: v for k, v in os.environ.items()
                 if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_")) and k not in ("RANK", "WORLD_SIZE")}
        return dict(clean, SLURM_CONF=str(self.conf), OMP_NUM_THREADS="1",
                    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))

    def start(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir()
        d = self.dir
        ctld_port, slurmd_port, srun_base = free_port(), free_port(), free_port()
        self.conf.write_text(f"""\
ClusterName=mlktest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SrunPortRange={srun_base}-{srun_base + 20}
AuthType=auth/none
CredType=cred/none
MpiDefault=none
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SwitchType=switch/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.log
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
FirstJobId={self.first_job}
MinJobAge=0
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName={socket.gethostname()} NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes={socket.gethostname()} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
""")
        for argv, name in ((["slurmctld", "-D", "-i"], "slurmctld"), (["slurmd", "-D"], "slurmd")):
            out = open(d / "log" / f"{name}.out", "w")
            with out:
                self.procs.append(subprocess.Popen(argv, env=self.env(), stdout=out, stderr=subprocess.STDOUT,
                                                   start_new_session=True))
        deadline = time.monotonic() + 30
        state = ""
        while time.monotonic() < deadline:
            done = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env(), capture_output=True, text=True,
                                  timeout=10)
            state = done.stdout.strip()
            if state == "idle":
                return
            time.sleep(0.2)  # waiting for a daemon we started (nothing to block on)
        raise RuntimeError(f"the SLURM node did not become idle within 30 s (state {state!r})\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-2000:]}" for p in sorted((self.dir / "log").glob("*")))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(5)

    def run(self, argv: list, timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env(), cwd=ROOT, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    if shutil.which("slurmctld") is None or shutil.which("slurmd") is None or shutil.which("srun") is None:
        pytest.skip("SLURM is not installed (Debian: apt-get install slurm-wlm)")
    if os.geteuid() != 0:
        pytest.skip("the test's slurmd runs jobs as root; run the SLURM tests as root")
    cluster = Slurm(tmp_path_factory.mktemp("slurm"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


def test_srun_runs_an_example_unchanged(slurm):
    # Three tasks: each builds its World from SLURM's variables alone (launch() runs in place).
    done = slurm.run(["srun", "-n", "3", "--time=2", sys.executable, str(EXAMPLES / "rpc_group.py"),
                      "--steps", "5"], timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr + slurm.logs()
    assert done.stdout.count("services registered") == 3, done.stdout
    assert re.search(r"^\[0\] \d+ calls done; stop flag raised$", done.stdout, re.M), done.stdout
    assert done.stdout.count("saw the stop flag") == 2
    assert done.stdout.count("done in") == 3  # three one-rank launch() calls, no nested processes


def test_sbatch_script_with_srun(slurm, tmp_path):
    # The documented batch script: the allocation, then one srun step of all its tasks.
    script = tmp_path / "job.sh"
    script.write_text(f"#!/bin/bash\n#SBATCH --ntasks=2\n#SBATCH --time=2\n"
                      f"srun {sys.executable} {EXAMPLES / 'rpc_group.py'} --steps 3\n")
    out = tmp_path / "job.out"
    done = slurm.run(["sbatch", "--wait", "-o", str(out), str(script)], timeout=120)
    text = out.read_text() if out.exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + text + slurm.logs()
    assert re.search(r"^\[0\] \d+ calls done; stop flag raised$", text, re.M) and "[1] saw the stop flag" in text, text
