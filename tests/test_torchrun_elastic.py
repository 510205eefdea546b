"""torchrun elastic (c10d rendezvous, MIN:MAX nodes, restarts): the World uses the agent's store.

A worker of the first attempt dies; torchrun restarts the whole worker group, whose new
Worlds meet on the same agent store (in a namespace of their attempt, so nothing of the
dead attempt leaks in) and finish.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

from proc_util import free_port

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import os

    import torch
    from machinlike.distributed import World

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    world = World(dist_timeout=30)
    info = world._store_info  # the test looks under the hood: whose store is this?
    group = world.create_rpc_group("g", world.get_members())
    group.register(f"rank{world.rank}", lambda: (attempt, world.rank))
    group.barrier()
    if attempt == 0 and world.rank == 1:
        os._exit(3)  # a worker dies mid-run: torchrun restarts the worker group
    seen = [group.registered_sync(f"rank{r}") for r in range(world.world_size)]
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    line = (f"attempt {attempt} rank {world.rank} of {world.world_size}: seen {seen} all_reduce {int(t.item())} "
            f"store {info.host}:{info.port} hosted_here={info.hosted_here} "
            f"agent_store={os.environ['TORCHELASTIC_USE_AGENT_STORE']} {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}")
    os.write(1, (line + "\\n").encode())
    group.barrier()
    world.stop()
    """
)


def test_restarted_worker_group_rejoins_on_the_agents_store(tmp_path):
    script = tmp_path / "elastic.py"
    script.write_text(SCRIPT)
    port = free_port()  # torchrun takes the endpoint as a number (its agent listens there)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(tmp_path / "torchrun-logs"),  # (not /tmp)
         "--nnodes", "1:2", "--nproc-per-node", "2",
         "--max-restarts", "2", "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"mlk-{os.getpid()}",
         "--rdzv-conf", "last_call_timeout=1", str(script)],
        capture_output=True, text=True, timeout=150, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr[-5000:]
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("attempt "))
    # Only the restarted group finished, each rank seeing the other's restarted service.
    pattern = (r"attempt 1 rank {} of 2: seen \[\(1, 0\), \(1, 1\)\] all_reduce 2 "
               r"store (\S+):(\d+) hosted_here=False agent_store=True (\S+):(\d+)")
    assert len(lines) == 2, done.stdout + done.stderr[-5000:]
    for rank, line in enumerate(lines):
        match = re.fullmatch(pattern.format(rank), line)
        assert match, line
        # The World is a client of the store torchrun's agent hosts (MASTER_ADDR/PORT): it
        # opens no store of its own, on no second port.
        assert match.group(1, 2) == match.group(3, 4), line
    assert "exitcode  : 3" in done.stderr or "exitcode: 3" in done.stderr.replace("  ", " "), done.stderr[-3000:]


TWO_NODES = textwrap.dedent(
    """
    import os, sys, time

    import torch
    from machinlike.distributed import World

    marker = sys.argv[1]
    node = os.environ["GROUP_RANK"]
    world = World(dist_timeout=25)
    group = world.create_rpc_group("g", world.get_members())
    group.register(f"rank{world.rank}", lambda: node)
    group.barrier()
    if not os.path.exists(marker + node):
        open(marker + node, "w").close()
        if node == "1":
            os._exit(3)  # node 1's worker dies: its agent restarts for a failure, ...
        time.sleep(120)  # ... node 0's, healthy, for a change of membership (its agent stops it)
    seen = [group.registered_sync(f"rank{r}") for r in range(world.world_size)]
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    from machinlike.distributed._membership import ReadOnlyStore, read_status
    status = read_status(ReadOnlyStore(world._store_info.store))  # what the status view finds there
    os.write(1, f"node {node} count {os.environ['TORCHELASTIC_RESTART_COUNT']} rank {world.rank}: seen {seen} "
                f"all_reduce {int(t.item())} status {status.kind} {status.alive()}\\n".encode())
    group.barrier()
    world.stop()
    """
)


def _two_nodes(tmp_path, text, max_restarts):
    """Two torchrun agents on this host as two "nodes" of one job (c10d rendezvous), each
    running ``text`` with a marker path: each node's ``(stdout, stderr)`` and a report.
    Asserts both agents exited 0."""
    script = tmp_path / "nodes.py"
    script.write_text(text)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    command = [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(tmp_path / "torchrun-logs"),
               "--nnodes", "2", "--nproc-per-node", "1",
               "--max-restarts", str(max_restarts), "--monitor-interval", "0.1", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"mlk2-{os.getpid()}-{port}",
               "--rdzv-conf", "last_call_timeout=1", str(script), str(tmp_path / "died")]
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
             for _ in range(2)]
    try:
        outs = [node.communicate(timeout=150) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
    report = "\n".join(out + err[-4000:] for out, err in outs)
    assert [node.returncode for node in nodes] == [0, 0], report
    return outs, report


def test_two_nodes_meet_again_after_a_worker_of_one_died(tmp_path):
    # torchrun counts a restart for a failure on the failed node only: the two nodes' workers
    # came back with restart counts 1 and 0, and once waited for each other in two
    # namespaces until the start-up timeout. Their Worlds now agree on the round.
    outs, report = _two_nodes(tmp_path, TWO_NODES, max_restarts=2)
    lines = sorted(line for out, _ in outs for line in out.splitlines() if line.startswith("node "))
    assert [re.sub(r"rank \d", "rank R", line) for line in lines] == [
        "node 0 count 0 rank R: seen ['0', '1'] all_reduce 2 status static ['0', '1']",
        "node 1 count 1 rank R: seen ['0', '1'] all_reduce 2 status static ['0', '1']"], report


ELASTIC_NODES = textwrap.dedent(
    """
    import os, sys, time

    from machinlike.distributed import World

    marker = sys.argv[1]
    node = os.environ["GROUP_RANK"]
    world = World(f"w{node}", rank=0 if node == "0" else None, elastic=True, dist_timeout=25)
    world.wait_for_members(["w0", "w1"], timeout=25)
    group = world.create_rpc_group("g", ["w0", "w1"])
    group.register(f"node{node}", lambda: node)
    group.barrier()
    if not os.path.exists(marker + node):
        open(marker + node, "w").close()
        if node == "1":
            os._exit(3)
        time.sleep(120)
    seen = [group.registered_sync(f"node{n}") for n in "01"]
    from machinlike.distributed._membership import ReadOnlyStore, read_status
    status = read_status(ReadOnlyStore(world._store_info.store))  # what the status view finds there
    os.write(1, f"node {node} count {os.environ['TORCHELASTIC_RESTART_COUNT']}: seen {seen} "
                f"members {sorted(world.get_members())} status {status.kind} {sorted(status.alive())}\\n".encode())
    group.barrier()
    world.stop()
    """
)


def test_an_elastic_world_of_two_nodes_meets_again_after_a_worker_of_one_died(tmp_path):
    # The same restart as above, in an elastic World: its namespace came from the restart
    # count too, so node 1's new worker (count 1) waited 25 s for w0, whose new worker
    # (count 0) had joined the old namespace, where the dead round's records were.
    outs, report = _two_nodes(tmp_path, ELASTIC_NODES, max_restarts=1)
    lines = sorted(line for out, _ in outs for line in out.splitlines() if line.startswith("node "))
    assert lines == ["node 0 count 0: seen ['0', '1'] members ['w0', 'w1'] status elastic ['w0', 'w1']",
                     "node 1 count 1: seen ['0', '1'] members ['w0', 'w1'] status elastic ['w0', 'w1']"], report


ACTOR = textwrap.dedent(
    """
    import sys

    from machinlike.distributed import World

    with World("actor", elastic=True, init_method=sys.argv[1], dist_timeout=20) as world:
        world.wait_for_members(["learner"], timeout=20)
        group = world.create_rpc_group("g", ["learner", "actor"])
        group.barrier()
        print("actor got", group.registered_sync("hello", ("actor",)), flush=True)
    """
)


def test_torchrun_workers_join_an_elastic_world_on_a_store_of_its_own(tmp_path):
    # A learner started on its own hosts the World; actors started by torchrun join it by
    # init_method. Their World is not the torchrun job's (its store is the learner's), so
    # it keeps one namespace: agreeing on a torchrun round there put the actors in one of
    # their own, where no learner ever came.
    from machinlike.distributed import World

    script = tmp_path / "actor.py"
    script.write_text(ACTOR)
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "MASTER_"))}
    env.update(PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    with World("learner", rank=0, elastic=True, init_method=address, dist_timeout=30) as world:
        actor = subprocess.Popen([sys.executable, "-m", "torch.distributed.run",
                                  "--log-dir", str(tmp_path / "torchrun-logs"), "--standalone", "--nproc-per-node",
                                  "1", str(script), address], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, env=env, cwd=ROOT)
        try:
            group = world.create_rpc_group("g", ["learner", "actor"])  # (waits for the actor to join)
            group.register("hello", lambda who: f"hello {who}")
            group.barrier()
            out, err = actor.communicate(timeout=120)
        finally:
            actor.kill()
        assert actor.returncode == 0, out + err[-4000:]
        assert "actor got hello actor" in out, out + err[-4000:]


def test_rank_0_waits_for_a_late_rank_of_its_round_without_a_line_of_log(capfd):
    # A node restarting late: rank 0 looked at the wants in timed store waits, and torch
    # logged two C++ warnings for each that timed out (86 lines for a worker 8 s late).
    import datetime
    import threading
    import time

    import torch.distributed as dist

    from machinlike.distributed._world.rounds import agree_round

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, None, True, datetime.timedelta(seconds=10), wait_for_workers=False)
    late = dist.TCPStore("127.0.0.1", port, None, False, datetime.timedelta(seconds=10))
    got = {}

    def rank_1():
        time.sleep(1.0)
        got[1] = agree_round(late, 1, 2, time.monotonic() + 10, f"127.0.0.1:{port}")

    thread = threading.Thread(target=rank_1)
    thread.start()
    got[0] = agree_round(server, 0, 2, time.monotonic() + 10, f"127.0.0.1:{port}")
    thread.join(10)
    assert got == {0: "r1", 1: "r1"}
    assert "timed out" not in capfd.readouterr().err
