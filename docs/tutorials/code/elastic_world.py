"""The program of the "Elastic worlds" tutorial: actors that die, come back and join late."""

from __future__ import annotations

import os
import signal
import threading

import machinlike
from machinlike.distributed import MemberEvent
from machinlike.exception import PeerLostError
from machinlike.process import Process


# [actor]
def actor(world: machinlike.World) -> str:
    """An actor: serves ``act`` under its own key; the first one crashes once."""
    group = world.create_rpc_group("actors")  # open: whoever is in the world, now or later
    group.register(f"act/{world.name}", lambda x: x + 1)
    if world.name == "actor-1" and world.incarnation == 1:
        world.wait_for_members(["learner"], timeout=30)
        os.kill(os.getpid(), signal.SIGKILL)  # an environment bug, an OOM kill, ...
    if world.name == "actor-1":  # back: tell the learner its service is up again
        world.create_rpc_group("ready", ["learner", "actor-1"]).barrier(timeout=30)
    # Serve until the learner has left (it leaves the world when its function returns).
    # membership.gone() tells "left" from "not here yet", and knows a learner that came
    # and went while this actor was busy.
    world.membership.wait_until(lambda live: world.membership.gone("learner") is not None, 60)
    return f"{world.name} incarnation {world.incarnation}"
# [/actor]


# [learner]
def learner(world: machinlike.World) -> list:
    log = []
    seen = threading.Condition()

    def on_change(event: MemberEvent) -> None:  # runs on the World's liveness thread
        with seen:
            log.append(f"{event.kind} {event.member}#{event.incarnation}")
            seen.notify_all()

    world.on_member_change(on_change)
    group = world.create_rpc_group("actors")
    world.wait_for_members(["actor-0", "actor-1"], timeout=30)
    # actor-1 dies: calls to it (and to a service of its that this process called
    # before) fail fast with PeerLostError naming it, never by waiting out the timeout.
    with seen:
        seen.wait_for(lambda: "lost actor-1#1" in log, timeout=10)
    try:
        group.rpc_sync("actor-1", os.getpid, timeout=30)
    except PeerLostError as err:
        print(f"[learner] {err}")
    # The launcher restarts it in place: same name, incarnation 2, same services again.
    world.wait_for_members(["actor-1"], timeout=30)
    world.create_rpc_group("ready", ["learner", "actor-1"]).barrier(timeout=30)
    print("[learner] actor-1 is back:", group.registered_sync("act/actor-1", args=(41,), timeout=30))
    return log
# [/learner]


def job(world: machinlike.World) -> object:
    return learner(world) if world.name == "learner" else actor(world)


# [late]
def late_actor(address: str) -> None:
    """A process started by hand joins the running world by its address and a name."""
    with machinlike.World("actor-late", elastic=True, init_method=address) as world:
        group = world.create_rpc_group("actors")
        print("[actor-late] members:", world.get_members())
        print("[actor-late] actor-0 says", group.registered_sync("act/actor-0", args=(1,), timeout=30))
# [/late]


def joined_late(world: machinlike.World) -> object:
    if world.name != "learner":
        return actor(world)
    world.wait_for_members(["actor-0"], timeout=30)
    child = Process(target=late_actor, args=(world.store_address,))
    child.start()
    child.join(60)
    return child.exitcode


def main() -> None:
    # [run]
    result = machinlike.launch(job, 3, names=["learner", "actor-0", "actor-1"],
                               max_restarts=2, essential=["learner"], timeout=120)
    print(result)
    print(result.restarts)
    assert result[2] == "actor-1 incarnation 2"
    assert "lost actor-1#1" in result[0] and "join actor-1#2" in result[0]
    # [/run]
    assert machinlike.launch(joined_late, 2, names=["learner", "actor-0"], max_restarts=1,
                             timeout=120)[0] == 0


if __name__ == "__main__":
    main()
