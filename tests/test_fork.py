"""A child forked (os.fork) from a member's process leaves its parent's World alone.

The child shares its parent's store connections and pipes. Before: a child that ended by
unwinding through launch's body or a ``with World`` block stopped the parent's World over
them (and launch reported the child's end as the rank's result), so the parent's World
broke; and torch's RPC agent, inherited as a husk, crashed the child at exit (SIGSEGV in
place of its exit status).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import torch

from machinlike.testing import world_test

from proc_util import printed


def _twice(x):
    return 2 * x


def _use_in_child(world, group, collective):
    # Before: an RPC call waited for good (torch's timeout thread did not cross the fork),
    # and a store request went over the parent's connection.
    uses = [lambda: group.registered_sync("twice1", (1,), timeout=5), lambda: group.barrier(),
            lambda: group.get_paired("value1").to_here(), lambda: group.register("other", _twice),
            lambda: collective.all_reduce(torch.ones(1)), lambda: world.create_rpc_group("h", ["0"])]
    start = time.monotonic()
    for use in uses:
        try:
            use()
            return 10
        except RuntimeError as err:
            if "forked (os.fork) from process" not in str(err) or "'spawn'" not in str(err):
                return 11
    return 0 if time.monotonic() - start < 2.0 else 12


@world_test(2, timeout=90)
def test_a_forked_child_ends_without_touching_its_parents_world(world):
    group = world.create_rpc_group("g", ["0", "1"])
    group.register(f"twice{world.rank}", _twice)
    group.barrier()
    group.pair(f"value{world.rank}", world.rank)
    collective = world.create_collective_group([0, 1])
    statuses = []
    if world.rank == 0:
        for how in ("exit", "return", "raise", "use"):
            pid = os.fork()
            if pid == 0:  # the child: it leaves through world_test's frames, as a user's would
                if how == "exit":
                    sys.exit(3)
                if how == "raise":
                    sys.stderr = open(os.devnull, "w")  # (its traceback is expected)
                    raise ValueError("raised in the forked child")
                if how == "use":
                    os._exit(_use_in_child(world, group, collective))
                return None
            statuses.append(os.waitpid(pid, 0)[1])
        # its own exit status each (sys.exit's, 0, 1 for the exception, 0: every use of
        # the World refused at once), no signal
        assert statuses == [3 << 8, 0, 1 << 8, 0], statuses
    group.barrier()  # the parents' World still works, both ways
    peer = 1 - world.rank
    assert [group.registered_sync(f"twice{peer}", (torch.tensor(float(i)),)).item() for i in range(3)] == [0, 2, 4]
    assert world.get_members() == ["0", "1"]
    group.barrier()


WITH_WORLD = textwrap.dedent("""
    import os, socket, sys
    from machinlike.distributed import World

    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    with World("solo", 0, 1, init_method=f"tcp://127.0.0.1:{port}") as world:
        group = world.create_rpc_group("g", ["solo"])
        group.register("twice", lambda x: 2 * x)
        pid = os.fork()
        if pid == 0:
            sys.exit(3)  # leaves the with block: World.stop in the child
        print("child status", os.waitpid(pid, 0)[1], flush=True)
        print("after the child", [group.registered_sync("twice", (i,)) for i in range(3)], flush=True)
    print("stopped", flush=True)
""")


def test_stop_in_a_forked_child_does_nothing_and_says_so():
    done = subprocess.run([sys.executable, "-c", WITH_WORLD], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert printed(done.stdout) == ["child status 768", "after the child [0, 2, 4]", "stopped"], done.stdout
    assert "stop() in process" in done.stderr and "does nothing" in done.stderr, done.stderr[-3000:]


WITH_POOL = textwrap.dedent("""
    import os, sys
    from machinlike.pool import Pool

    def square(x):
        return x * x

    if __name__ == "__main__":
        with Pool(1) as pool:
            assert pool.map(square, range(3)) == [0, 1, 4]
            pid = os.fork()
            if pid == 0:
                try:
                    pool.map(square, range(3))
                    os._exit(10)
                except RuntimeError as err:
                    if "forked (os.fork) from it, cannot submit" not in str(err):
                        os._exit(11)
                sys.exit(3)  # leaves the with block: terminate() in the child
            print("child status", os.waitpid(pid, 0)[1], flush=True)
            print("after the child", pool.map(square, range(3)), flush=True)
        print("terminated", flush=True)
""")


def test_a_forked_child_neither_submits_to_nor_ends_its_parents_pool(tmp_path):
    # Before: the child's submission went over the workers' pipes it shares with its
    # parent, and leaving the with block SIGTERMed the parent's workers.
    script = tmp_path / "pool_fork.py"
    script.write_text(WITH_POOL)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert printed(done.stdout) == ["child status 768", "after the child [0, 1, 4]", "terminated"], done.stdout
    assert "terminate() in process" in done.stderr and "does nothing" in done.stderr, done.stderr[-3000:]
