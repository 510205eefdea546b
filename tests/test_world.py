"""World: arguments, start-up, shutdown, torchrun, and one per process."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import textwrap
import time

import pytest

from machinlike.distributed import World, get_cur_name, get_cur_rank, get_world, is_world_initialized
from machinlike.distributed._membership import connect_read_only
from machinlike import SilentStoreError, launch
from machinlike.testing import world_test

from proc_util import free_port, printed

LOCAL = "tcp://127.0.0.1:0"  # rank 0 picks a free port itself: only valid for world_size=1


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(rank=2, world_size=2), ValueError, r"rank=2 must be in \[0, world_size=2\)"),
        (dict(rank=0, world_size=0), ValueError, "world_size=0 must be at least 1"),
        (dict(rank="0", world_size=1), TypeError, "rank must be an int"),
        (dict(rank=0, world_size=1, name="a b"), ValueError, "name='a b' is not a valid member name"),
        # a letter, but not one torch RPC's worker names allow (it raised at start-up)
        (dict(rank=0, world_size=1, name="acteur-é"), ValueError, "is not a valid member name: use 1-100 ASCII"),
        (dict(rank=0, world_size=1, rpc_timeout=0), ValueError, "rpc_timeout=0 must be a positive"),
        (dict(rank=0, world_size=1, rpc_threads=0), ValueError, "rpc_threads=0 must be a positive int"),
        (dict(rank=0, world_size=1, init_method="file:///tmp/x"), ValueError, "init_method='file:///tmp/x' is not supported"),
        (dict(rank=0, world_size=1, store="store"), TypeError, "store must be a torch.distributed.Store"),
    ],
)
def test_bad_arguments_are_named(kwargs, error, match):
    with pytest.raises(error, match=match):
        World(**kwargs)
    assert get_world() is None


def test_rank_and_size_come_from_the_environment(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="World needs rank: pass it .* or start the script with torchrun"):
        World()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    with World(init_method=LOCAL) as world:
        assert (world.rank, world.world_size, world.name) == (0, 1, "0")


def test_in_process_lifecycle_and_one_world_per_process():
    assert not is_world_initialized()
    with pytest.raises(RuntimeError, match="no World in this process"):
        get_cur_rank()
    for round_ in range(2):  # a process may build a new World after stopping the last one
        world = World("solo", 0, 1, init_method=LOCAL)
        assert isinstance(world, World) and get_world() is world and is_world_initialized()
        assert get_cur_rank() == 0 and get_cur_name() == "solo"
        assert world.get_members() == ["solo"] and world.get_ranks() == [0]
        with pytest.raises(RuntimeError, match="already has a World"):
            World("other", 0, 1, init_method=LOCAL)
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(world)
        group = world.create_rpc_group("g", ["solo"])
        group.register("twice", lambda x: 2 * x)
        assert group.registered_sync("twice", (round_,)) == 2 * round_
        world.stop()
        world.stop()  # safe twice
        assert get_world() is None
        with pytest.raises(RuntimeError, match="has been stopped"):
            world.create_rpc_group("late", ["solo"])
        with pytest.raises(RuntimeError, match="has been stopped"):
            world.get_rpc_group("g")
        # A handle kept past stop() was told "a pool worker or a child process has not"
        # joined the world (cold trial 20).
        with pytest.raises(RuntimeError, match="World 'solo' of this process has been stopped: RpcGroup 'g' "
                                               "belonged to it; create a new World"):
            group.registered_sync("twice", (1,))


def _two_worlds_in_a_row(rank: int, port: int) -> None:
    for _ in range(2):
        with World(str(rank), rank, 2, init_method=f"tcp://127.0.0.1:{port}", dist_timeout=20) as world:
            group = world.create_rpc_group("g", ["0", "1"])
            assert group.rpc_sync(str(1 - rank), get_cur_name) == str(1 - rank)


def test_every_rank_of_a_static_world_builds_a_new_world_right_after_stop():
    # Cold trial 31: rank 1 left its stop() before rank 0 closed the store, joined the old
    # store with its new World and lost it a moment later; rank 0's new World then waited
    # out its dist_timeout for it.
    from machinlike.process import Process

    port = free_port()
    ranks = [Process(target=_two_worlds_in_a_row, args=(rank, port)) for rank in range(2)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(90)
    for p in ranks:
        assert p.exitcode == 0, p.exception
        p.watch()


WORKER_ID_SCRIPT = """
import datetime, socket, time
import torch.distributed as dist
from machinlike.distributed import World

def port():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return p

World("e", rank=0, elastic=True, init_method=f"tcp://127.0.0.1:{port()}", dist_timeout=20).stop()  # worker id 0
# Rank 1 of a static world whose store is up (rank 0 would host it; here the script does).
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=20))
start = time.monotonic()
try:
    World("s1", rank=1, world_size=2, init_method=f"tcp://127.0.0.1:{store.port}", dist_timeout=20)
except RuntimeError as err:
    print(f"refused in {time.monotonic() - start:.2f} s: {err}", flush=True)
world = World("s0", rank=0, world_size=1, init_method="tcp://127.0.0.1:0")  # the id it had: fine
world.stop()
print("rank 0 started", flush=True)
"""


def test_a_static_rank_other_than_the_processes_worker_id_is_refused_at_once():
    # torch's distributed autograd keeps a process's first RPC worker id for good: a static
    # World as another rank used to fail inside init_rpc, after the other ranks' rendezvous.
    done = subprocess.run([sys.executable, "-c", WORKER_ID_SCRIPT], capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr[-3000:]
    refused, started = printed(done.stdout)
    assert refused.startswith("refused in ") and float(refused.split()[2]) < 2.0, refused
    assert "cannot start a static World as rank 1" in refused and "worker_id: 0" in refused, refused
    assert "fresh process" in refused and started == "rank 0 started"


SAME_PORT_SCRIPT = """
import gc, socket
from machinlike.distributed import World
from machinlike.distributed._store.connections import connections_to

gc.disable()  # nothing may depend on the cyclic collector
probe = socket.socket(); probe.bind(("127.0.0.1", 0)); port = probe.getsockname()[1]; probe.close()
url = f"tcp://127.0.0.1:{port}"

def free():  # can something else listen on the port now?
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("127.0.0.1", port)); return True
    except OSError:
        return False
    finally:
        s.close()

for round_ in range(3):
    world = World("solo", 0, 1, init_method=url)  # RPC and gloo, as by default
    group = world.create_rpc_group("g", ["solo"])
    group.register("twice", lambda x: 2 * x)
    assert group.registered_sync("twice", (round_,)) == 2 * round_
    world.stop()
    print("stopped, port free:", free(), flush=True)
    # What stays open: each stopped World's main connection until its cycles are collected
    # (before: six, from the look-ups, the waiters, the ring, the store watch and RPC too),
    # and the last RPC agent's, which torch frees when the next one starts.
    print("store connections left:", len(connections_to(port)), flush=True)
try:
    World("solo", 0, 2, init_method=url, dist_timeout=3)  # (1 s: the look-ups connection missed it under load)
except TimeoutError:
    print("failed start, port free:", free(), flush=True)
World("solo", 0, 1, init_method=url).stop()
print("built again", flush=True)
before = len(connections_to(port))
elastic = World("e", rank=0, elastic=True, init_method=url, dist_timeout=20)
elastic.create_rpc_group("open").register("twice", lambda x: 2 * x)
elastic.stop()
print("elastic: store connections left:", len(connections_to(port)) - before, flush=True)
"""


def test_a_world_frees_its_store_port_at_stop_and_after_a_failed_start():
    # torch's RPC agent keeps the store it was given for the rest of the process: given the
    # hosting store, it kept the port bound after stop(), and the next World on that port
    # failed with "Address already in use" (a failed start kept it until a gc pass).
    done = subprocess.run([sys.executable, "-c", SAME_PORT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = printed(done.stdout)
    assert lines[0:6:2] == ["stopped, port free: True"] * 3, done.stdout
    assert lines[6:8] == ["failed start, port free: True", "built again"], done.stdout
    left = [int(line.rpartition(": ")[2]) for line in lines[1:7:2]]
    assert left == [2, 3, 4], done.stdout
    # an elastic World: its main connection, and its agent's (torch binds its RRef context
    # to a process's first dynamic agent for good, so that agent is never shut down)
    assert lines[8] == "elastic: store connections left: 2", done.stdout


OWN_GROUP_SCRIPT = """
import os, socket
import torch, torch.distributed as dist
from machinlike.distributed import World

def url():
    s = socket.socket(); s.bind(("127.0.0.1", 0)); p = s.getsockname()[1]; s.close(); return f"tcp://127.0.0.1:{p}"

dist.init_process_group("gloo", init_method=url(), rank=0, world_size=1)
try:
    World("solo", 0, 1, init_method=url())
except RuntimeError as err:
    print("refused:", err, flush=True)
world = World("solo", 0, 1, init_method=url(), collective=False)  # keeps the user's group
group = world.create_rpc_group("g", ["solo"])
group.register("twice", lambda x: 2 * x)
assert group.registered_sync("twice", (2,)) == 4
world.stop()
t = torch.ones(1)
dist.all_reduce(t)
print("the user's group still works:", dist.is_initialized() and t.item() == 1.0, flush=True)
dist.destroy_process_group()  # (torch may abort at exit with a gloo group still alive)
"""


def test_a_process_with_its_own_default_process_group_is_told_how_to_keep_it():
    done = subprocess.run([sys.executable, "-c", OWN_GROUP_SCRIPT], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    refused, works = printed(done.stdout)
    assert refused.startswith("refused: this process already has torch's default process group"), refused
    assert "pass collective=False to keep yours" in refused and "destroy_process_group()" in refused
    assert works == "the user's group still works: True"


def test_startup_names_the_missing_rank():
    start = time.monotonic()
    with pytest.raises(TimeoutError, match=r"World start-up: ranks: '1' did not arrive within"):
        World(rank=0, world_size=2, init_method=LOCAL, dist_timeout=1)
    assert time.monotonic() - start < 10
    assert get_world() is None


def test_unreachable_master_is_a_clear_timeout():
    port = free_port()  # a port nobody listens on
    with pytest.raises(TimeoutError, match=rf"could not reach the world's store .* at 127.0.0.1:{port} within 1 s"):
        World(rank=1, world_size=2, init_method=f"tcp://127.0.0.1:{port}", dist_timeout=1)


def test_a_port_held_by_a_listener_that_never_answers_is_named_within_the_timeout():
    # Another program on the port, accepting and never answering: torch's client reads its
    # first answer without a timeout, so a rank other than 0 waited for good.
    import socket

    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        start = time.monotonic()
        with pytest.raises(SilentStoreError,
                           match=rf"127.0.0.1:{port} accepted the connection but did not answer.*port of its own"):
            World(rank=1, world_size=2, init_method=f"tcp://127.0.0.1:{port}", dist_timeout=2)
        assert time.monotonic() - start < 8
        with pytest.raises(ConnectionError, match="did not answer"):
            connect_read_only(f"127.0.0.1:{port}", timeout=2)  # (python -m machinlike status)
    assert get_world() is None


def test_master_port_in_use_is_named():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(OSError, match=rf"rank 0 cannot listen on 127.0.0.1:{port}"):
            World(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")


def _wait_for_a_stopping_rank(world):
    import logging

    if world.rank == 0:
        return []  # done: its World.stop waits for every rank, the waiting ones included
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("machinlike.distributed._world.world").addHandler(handler)
    with pytest.raises(TimeoutError, match=r"\['0'\] to be gone, still live"):
        world.wait_for_members(["0"], timeout=4, gone=True)
    return said


def test_waiting_for_a_static_member_that_began_its_stop_says_why_it_lasts():
    said = launch(_wait_for_a_stopping_rank, 2, timeout=60)[1]
    assert len(said) == 1 and "member '0' has begun World.stop" in said[0] and "elastic world" in said[0], said


@world_test(3, timeout=60)
def test_world_basics_on_three_ranks(world):
    assert world.get_members() == ["0", "1", "2"] and world.get_ranks() == [0, 1, 2]
    assert get_world() is world and get_cur_name() == str(world.rank)


@world_test(2, timeout=60, collective=False)
def test_rpc_only_world(world):
    import torch.distributed as dist

    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="collective=False"):
        world.create_collective_group([0, 1])


TORCHRUN_SCRIPT = textwrap.dedent(
    """
    import os

    import torch
    from machinlike.distributed import World

    world = World()  # everything comes from torchrun's environment
    group = world.create_rpc_group("g", world.get_members())
    group.register(f"rank{world.rank}", lambda: world.rank)
    group.barrier()
    total = sum(group.registered_sync(f"rank{r}") for r in range(world.world_size))
    t = torch.ones(1) * world.rank
    torch.distributed.all_reduce(t)
    # One write per line: print() writes the text and the newline separately, and three
    # ranks share torchrun's stdout pipe, so their lines could interleave.
    os.write(1, f"rank {world.rank} of {world.world_size}: services {total} all_reduce {int(t.item())}\\n".encode())
    group.barrier()
    world.stop()

    # The same script's launch() call runs in place under torchrun (no nested processes).
    import machinlike

    def job(world, base):
        return base + world.rank

    (mine,) = machinlike.launch(job, 99, args=(100,))
    os.write(1, f"launched rank {mine - 100} of {world.world_size}\\n".encode())
    # Restarts and kills are torchrun's to do here: asked of launch(), they are refused.
    for bad in ({"chaos": 1.0, "max_restarts": 1}, {"max_restarts": 2}):
        try:
            machinlike.launch(job, 99, args=(100,), **bad)
        except ValueError as err:
            os.write(1, f"refused {sorted(bad)}: {'but torchrun started this one' in str(err)}\\n".encode())
    # Cold trial 32: names of another length failed in rank 1 alone (an IndexError; rank 0
    # waited 60 s for it), and return_exceptions was dropped.
    try:
        machinlike.launch(job, 3, args=(100,), names=["learner"])
    except ValueError as err:
        os.write(1, f"names refused: {'names has 1 entries; world_size is 3' in str(err)}\\n".encode())

    def fails_on_1(world):
        if world.rank == 1:
            raise KeyError("one")
        return world.rank

    (kept,) = machinlike.launch(fails_on_1, 3, return_exceptions=True, timeout=60)
    os.write(1, f"kept {world.rank if isinstance(kept, int) else type(kept).__name__}\\n".encode())
    """
)


IN_PLACE_TIMEOUT = """
import time
import machinlike

def sleeps(world):
    print("rank", world.rank, "sleeps", flush=True)
    time.sleep(120)

if __name__ == "__main__":
    machinlike.launch(sleeps, 1, torchrun=True, timeout=3)
    print("launch returned", flush=True)
"""


def test_a_launch_run_in_place_ends_at_its_timeout_with_the_stacks(tmp_path):
    # Cold trial 32: under torchrun or srun, launch(timeout=) was dropped, and a rank that
    # hung ran for good. In place it ends the process after dumping its stacks.
    port = free_port()
    script = tmp_path / "in_place.py"
    script.write_text(IN_PLACE_TIMEOUT)
    env = dict(os.environ, RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
               PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])))
    start = time.monotonic()
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode == 1 and time.monotonic() - start < 60, (done.returncode, done.stderr[-2000:])
    assert "rank 0 sleeps" in done.stdout and "launch returned" not in done.stdout
    assert "Timeout (0:00:03)!" in done.stderr and "in sleeps" in done.stderr, done.stderr[-2000:]


def test_torchrun_builds_world_without_arguments(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [os.getcwd(), os.environ.get("PYTHONPATH")])),
               OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--log-dir", str(tmp_path / "torchrun-logs"),  # (not /tmp)
         "--standalone", "--nproc-per-node", "3", str(script)],
        capture_output=True, text=True, timeout=150, env=env,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("rank "))
    assert lines == [f"rank {r} of 3: services 3 all_reduce 3" for r in range(3)], done.stdout
    launched = sorted(line for line in done.stdout.splitlines() if line.startswith("launched "))
    assert launched == [f"launched rank {r} of 3" for r in range(3)], done.stdout
    # Asked for 99 ranks, it got torchrun's 3: said once, by rank 0.
    assert done.stderr.count("launch(world_size=99) runs in place under torchrun, whose 3 processes are the ranks") \
        == 1, done.stderr
    refused = sorted(line for line in done.stdout.splitlines() if line.startswith("refused "))
    assert refused == sorted(["refused ['chaos', 'max_restarts']: True", "refused ['max_restarts']: True"] * 3), \
        done.stdout
    assert done.stdout.count("names refused: True") == 3, done.stdout
    assert sorted(line for line in done.stdout.splitlines() if line.startswith("kept ")) == \
        ["kept 0", "kept 2", "kept KeyError"], done.stdout
