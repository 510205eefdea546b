"""launch_ray on a real local Ray cluster: results, resources, failures, timeouts, bad input.

One Ray instance (4 CPUs and one "learner" resource) serves the whole module: Ray takes
seconds to start, so the tests share it; each launch still starts fresh actors.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from machinlike import ProcessExitedError, launch_ray

ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=4, resources={"learner": 1}, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


def _gone(pids, within: float) -> list:
    """The pids still alive after at most ``within`` seconds (Ray kills actors asynchronously)."""
    deadline = time.monotonic() + within
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if _alive(pid)]
        time.sleep(0.05)  # polling a teardown condition, not synchronising ranks
    return alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ranks_are_actors_with_their_resources(cluster):
    def rank_fn(world, scale):
        import ray as ray_here
        import torch

        group = world.create_rpc_group("g", world.get_members())
        peer = world.get_members()[(world.rank + 1) % world.world_size]
        got = group.rpc_sync(peer, lambda t: t * scale, args=(torch.full((1,), float(world.rank)),))
        group.barrier()
        group.destroy()
        return world.name, os.getpid(), got.item(), ray_here.get_runtime_context().get_assigned_resources()

    results = launch_ray(rank_fn, 3, args=(10,), names=["learner", "a", "b"], timeout=60,
                         resources=[{"num_cpus": 1, "learner": 1}, {"num_cpus": 0.5}, {"num_cpus": 0.5}])
    assert [r[0] for r in results] == ["learner", "a", "b"]
    assert [r[2] for r in results] == [0.0, 10.0, 20.0]  # each lambda ran on the caller's peer
    pids = [r[1] for r in results]
    assert len(set(pids)) == 3 and os.getpid() not in pids
    assert results[0][3]["learner"] == 1.0 and results[0][3]["CPU"] == 1.0
    assert "learner" not in results[1][3] and results[1][3]["CPU"] == 0.5
    assert _gone(pids, 10.0) == []  # the actors end with the call


def test_first_failure_ends_the_run_with_its_traceback(cluster, tmp_path):
    def rank_fn(world, where):
        (where / f"{world.rank}.pid").write_text(str(os.getpid()))
        if world.rank == 2:
            # Fail once the others are at work: a rank torn down before it wrote its pid
            # (its start slowed by a loaded box) left the test nothing to check it by.
            until = time.monotonic() + 30
            while not all((where / f"{r}.pid").exists() for r in range(3)) and time.monotonic() < until:
                time.sleep(0.05)
            raise KeyError("rank two failed")
        threading.Event().wait(120)  # a rank still working when its peer fails

    start = time.monotonic()
    with pytest.raises(KeyError, match="rank two failed") as info:
        launch_ray(rank_fn, 3, args=(tmp_path,), timeout=90)
    assert time.monotonic() - start < 45
    cause = str(info.value.__cause__)
    assert "on rank 2 ('2') on Ray node" in cause and "raise KeyError" in cause
    pids = [int((tmp_path / f"{r}.pid").read_text()) for r in range(3)]
    assert _gone(pids, 10.0) == []  # the working ranks were killed, not left running


def test_a_dead_actor_is_named(cluster):
    def rank_fn(world):
        if world.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        threading.Event().wait(120)

    with pytest.raises(ProcessExitedError, match=r"rank 1 \('1'\) \(pid \d+\) died without reporting a result: "
                                                 r"its Ray actor died"):
        launch_ray(rank_fn, 2, timeout=90)


def test_timeout_dumps_the_stacks_of_the_late_ranks(cluster, capfd):
    def stuck_in_rank(world):
        if world.rank == 0:
            return "done"
        threading.Event().wait(120)

    # Rank 0 reports at once on a quiet machine; under load even its World may take the
    # 10 s, and then it is named too (what matters: the late ranks' stacks, rank 1's here).
    with pytest.raises(TimeoutError, match=r"launch_ray: (rank 0 \('0'\), )?rank 1 \('1'\) did not finish within "
                                           r"10 s \([01] of 2 ranks reported\); their stacks were dumped to stderr"):
        launch_ray(stuck_in_rank, 2, timeout=10)
    err = capfd.readouterr().err
    assert "--- launch_ray: stacks of rank 1 ('1')" in err and "in stuck_in_rank" in err


def test_a_restarted_actor_rejoins_under_its_name(cluster, tmp_path):
    # Ray restarts the SIGKILLed actor and re-sends the rank's run; with max_restarts the
    # world is elastic, so the rank comes back as incarnation 2 while rank 0 goes on.
    def rank_fn(world, where):
        marker = where / "died-once"
        if world.rank == 1 and not marker.exists():
            marker.write_text("")
            os.kill(os.getpid(), signal.SIGKILL)
        if world.rank == 0:
            world.membership.wait_until(lambda live: world.get_incarnation("1") == 2, 60)
            group = world.create_rpc_group("back", ["0", "1"])
            group.barrier(timeout=60)
            return world.get_incarnation("1")
        world.create_rpc_group("back", ["0", "1"]).barrier(timeout=60)
        return world.incarnation

    assert launch_ray(rank_fn, 2, args=(tmp_path,), timeout=90, max_restarts=1) == [2, 2]


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(resources={"num_cpus": 2}), ValueError,
     r"the 3 ranks need more than the Ray cluster has: \{'CPU': '6 asked, 4 in the cluster'\}"),
    (dict(resources=[{"learner": 2}, {"num_cpus": 1}, {"num_cpus": 1}]), ValueError,
     r"rank 0 asks for \{'learner': 2.0\}, which no node of the Ray cluster has"),
    (dict(resources=[{"num_cpus": 1}] * 3 + [{"num_gpus": 1}]), ValueError, "resources has 4 entries; world_size is 3"),
    (dict(resources={"num_cpus": 0}), ValueError, r"asks for nothing"),
    (dict(resources={"num_cpus": -1}), ValueError, r"resources\[0\]\['num_cpus'\]=-1 must be a non-negative number"),
    (dict(resources={"CPU": 1}), ValueError, "write 'CPU' as 'num_cpus'"),
    (dict(address="127.0.0.1:6379"), ValueError, "already connected to Ray"),
    (dict(max_restarts=-1), ValueError, "max_restarts=-1 must be a non-negative int"),
    (dict(init_method="tcp://x:1"), TypeError, r"launch_ray\(\) sets \['init_method'\] itself"),
])
def test_bad_input_is_refused_before_any_actor_starts(cluster, kwargs, error, match):
    start = time.monotonic()
    with pytest.raises(error, match=match):
        launch_ray(lambda world: None, 3, **kwargs)
    assert time.monotonic() - start < 5


def test_unreachable_cluster_is_named_at_once():
    # A fresh interpreter, not connected to Ray; the port is bound but never listens (refused).
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{closed.getsockname()[1]}"
        # (then the same address from RAY_ADDRESS, as `ray job submit` exports it: cold trial 32
        # found ray.init retrying it for minutes)
        probe = (f"import os, machinlike\ntry:\n    machinlike.launch_ray(lambda w: 0, 2, address={address!r})\n"
                 f"except ConnectionError as e:\n    print('ERR', e)\n"
                 f"os.environ['RAY_ADDRESS'] = {address!r}\n"
                 f"try:\n    machinlike.launch_ray(lambda w: 0, 2, start_timeout=10)\n"
                 f"except ConnectionError as e:\n    print('ENV', e)\n")
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert f"ERR no Ray cluster answers at address={address!r}" in done.stdout, done.stdout + done.stderr
    assert "ray start --head" in done.stdout
    assert f"ENV no Ray cluster answers at RAY_ADDRESS={address!r} (address=None)" in done.stdout, done.stdout
    assert time.monotonic() - start < 30


def test_example_runs_on_the_ray_cluster(cluster, tmp_path):
    # The CI smoke test: an unchanged example, one flag, on the module's Ray cluster.
    out = tmp_path / "ps.csv"
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "param_server.py"), "--engine", "ray", "--ray-address", cluster,
         "--ray-cpus", "1", "--num-workers", "2", "--epochs", "1", "--time-budget", "20", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=150,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "test accuracy" in done.stdout and out.exists()
    line = next(x for x in done.stdout.splitlines() if "secondary reducers" in x)
    assert line.count("pushes taken") == 2
