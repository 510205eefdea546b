"""SLURM: node lists, rank/size/master from an srun task's environment, and bad environments.

The multi-host run (SLURM's variables on three network-namespace "hosts") is in
``tests/test_multihost.py``; a real single-node SLURM (slurmctld + slurmd) in
``tests/test_slurm_cluster.py``.
"""

from __future__ import annotations

import pytest

from machinlike.distributed import World
from machinlike.distributed._store import rendezvous as _rendezvous
from machinlike.distributed._store.rendezvous import external_launcher, parse_nodelist, resolve_rank_and_size

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
               "TORCHELASTIC_USE_AGENT_STORE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_NPROCS",
               "SLURM_STEP_NUM_TASKS", "SLURM_STEP_ID", "SLURM_STEPID", "SLURM_JOB_NODELIST",
               "SLURM_STEP_NODELIST", "SLURM_NODELIST", "SLURM_JOB_ID", "SLURM_JOBID")


@pytest.fixture
def env(monkeypatch):
    """A clean launch environment; returns a setter of variables."""
    for name in LAUNCH_VARS:
        monkeypatch.delenv(name, raising=False)

    def set_vars(**values: str) -> None:
        for name, value in values.items():
            monkeypatch.setenv(name, value)
    return set_vars


def srun_task(rank: int, ntasks: int, nodelist: str = "node[01-03]", job_id: str = "4321") -> dict:
    """What srun gives one task (the variables machinlike reads)."""
    return dict(SLURM_PROCID=str(rank), SLURM_NTASKS=str(ntasks), SLURM_STEP_NUM_TASKS=str(ntasks),
                SLURM_STEP_ID="0", SLURM_JOB_NODELIST=nodelist, SLURM_STEP_NODELIST=nodelist,
                SLURM_JOB_ID=job_id)


@pytest.mark.parametrize("nodelist, hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("tux[8-10]", ["tux8", "tux9", "tux10"]),  # no padding: widths grow
    ("n[098-101]", ["n098", "n099", "n100", "n101"]),  # padding kept, then outgrown
    ("rack[1-2]-n[09-10]", ["rack1-n09", "rack1-n10", "rack2-n09", "rack2-n10"]),
    ("a,b[2],c", ["a", "b2", "c"]),
    (" single ", ["single"]),
    ("10.0.0.[1-2]", ["10.0.0.1", "10.0.0.2"]),
])
def test_nodelist_expands_like_slurm(nodelist, hosts):
    assert parse_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, match", [
    ("", "is empty"),
    ("node[01-", r"unmatched '\['"),
    ("node]", r"unmatched '\]'"),
    ("node[[1]]", r"nested '\['"),
    ("node[a-b]", r"'a-b' inside \[...\] is not a number or a range"),
    ("node[3-1]", "range '3-1' runs backwards"),
    ("a,,b", "empty entry in 'a,,b'"),
])
def test_malformed_nodelist_is_quoted(nodelist, match):
    with pytest.raises(ValueError, match=match):
        parse_nodelist(nodelist, where="SLURM_JOB_NODELIST")


def test_srun_task_gives_rank_size_and_master(env):
    env(**srun_task(2, 3, nodelist="gpu[7-9],cpu1", job_id="123456"))
    assert resolve_rank_and_size(None, None) == (2, 3)
    assert _rendezvous._master_from(None) == ("gpu7", _rendezvous.slurm_master_port(123456), False)
    assert _rendezvous.slurm_master_port(123456) == 20000 + 3456
    assert external_launcher() == "srun"


def test_master_port_and_address_can_be_given(env):
    env(**srun_task(0, 2), MASTER_PORT="31000")
    assert _rendezvous._master_from(None) == ("node01", 31000, False)
    env(MASTER_ADDR="head")  # e.g. exported by the sbatch script
    assert _rendezvous._master_from(None) == ("head", 31000, False)


def test_a_step_of_fewer_tasks_than_the_job(env):
    env(**{**srun_task(1, 4), "SLURM_STEP_NUM_TASKS": "2"})  # srun -n 2 inside an allocation of 4 tasks
    assert resolve_rank_and_size(None, None) == (1, 2)


def test_torchrun_wins_over_slurm(env):
    # torchrun started by srun (one agent per node): the workers' numbers are torchrun's.
    env(**srun_task(1, 2), RANK="5", WORLD_SIZE="8", MASTER_ADDR="10.1.2.3", MASTER_PORT="29400",
        TORCHELASTIC_RUN_ID="job", TORCHELASTIC_USE_AGENT_STORE="True")
    assert resolve_rank_and_size(None, None) == (5, 8)
    assert _rendezvous._master_from(None) == ("10.1.2.3", 29400, True)
    assert external_launcher() == "torchrun"


def test_arguments_win_over_both(env):
    env(**srun_task(1, 2), RANK="1", WORLD_SIZE="2")
    assert resolve_rank_and_size(0, 3) == (0, 3)
    assert _rendezvous._master_from("tcp://127.0.0.1:4000") == ("127.0.0.1", 4000, False)


def test_batch_script_and_single_task_start_ranks_locally(env):
    # SLURM's batch script: SLURM_PROCID=0 and the job's SLURM_NTASKS, but no step.
    env(SLURM_PROCID="0", SLURM_NTASKS="4", SLURM_JOB_NODELIST="node[01-02]", SLURM_JOB_ID="7")
    assert external_launcher() is None
    assert _rendezvous._master_from(None) == ("127.0.0.1", 29500, False)  # machin-style worlds unchanged
    assert resolve_rank_and_size(1, 3) == (1, 3)
    with pytest.raises(ValueError, match=r"SLURM's batch script, not a task started by srun .*SLURM_STEP_ID "
                                         r"is missing\): start the ranks with srun, or call machinlike.launch"):
        resolve_rank_and_size(None, None)
    env(**srun_task(0, 1))  # srun -n 1: one process, which may launch() locally
    assert external_launcher() is None


@pytest.mark.parametrize("drop, match", [
    ("SLURM_NTASKS", "SLURM_PROCID is set but SLURM_NTASKS is missing"),
    ("SLURM_PROCID", "SLURM_NTASKS is set but SLURM_PROCID is missing"),
    ("SLURM_JOB_NODELIST", "SLURM_PROCID is set but SLURM_JOB_NODELIST is missing"),
    ("SLURM_JOB_ID", "SLURM_PROCID is set but SLURM_JOB_ID is missing"),
])
def test_partial_slurm_environment_is_named(env, monkeypatch, drop, match):
    task = srun_task(1, 2)
    for name in ("SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST"):
        del task[name]  # so that dropping the job-wide variable leaves nothing to fall back on
    del task[drop]
    env(**task)
    with pytest.raises(ValueError, match=match) as info:
        World()  # no arguments: everything from the environment; fails before any socket
    assert "start every rank with srun" in str(info.value)


def test_non_numeric_slurm_variable_is_named(env):
    env(**srun_task(0, 2, job_id="12_3"))
    with pytest.raises(ValueError, match=r"environment variable SLURM_JOB_ID='12_3' is not an integer"):
        World()
    env(SLURM_JOB_NODELIST="node[", SLURM_STEP_NODELIST="node[")
    with pytest.raises(ValueError, match=r"SLURM_STEP_NODELIST: unmatched '\[' in 'node\['"):
        World()


def test_world_from_a_one_task_srun_environment(env):
    # A real World from SLURM's variables alone; port 0 (any free one) instead of the derived
    # port, which another job on this machine could hold.
    env(**srun_task(0, 1, nodelist="localhost"), MASTER_PORT="0")
    with World(dist_timeout=20) as world:
        assert (world.rank, world.world_size, world.name) == (0, 1, "0")
