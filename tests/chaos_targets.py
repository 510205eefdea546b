"""The fault-injection loop of elastic worlds, shared by the test and ``benchmarks/elastic.py``.

Four members: ``d`` (the driver, essential) and ``m1``..``m3``. Iteration ``i`` picks a
victim and a phase from a seeded schedule; every member creates the group ``it<i>``,
registers a service and pairs a value, meets at a barrier, then calls everyone's service
and reads everyone's value (the group is destroyed once the next one exists, so readers
never meet a withdrawn key). The victim SIGKILLs itself in its phase:

    create   when the others are creating    survivors wait in group creation
    service  inside its own service         survivors are in registered_sync
    pair     right after pairing            survivors wait at the first barrier
    barrier  after the first barrier        survivors are in get_paired / registered_sync

The launcher (``max_restarts``) starts it again; the new incarnation resumes at the next
iteration. Survivors must fail fast (``PeerLostError``, or ``KeyError`` once the victim's
keys are freed), never by waiting out a timeout.
"""

from __future__ import annotations

import os
import random
import signal
import time
from typing import Dict, List, Tuple

from machinlike.exception import PeerLostError

MEMBERS = ["d", "m1", "m2", "m3"]
PHASES = ("create", "service", "pair", "barrier")
#: A survivor's failing call must return within this many seconds (liveness is 2 s).
FAST = 4.0
#: Generous timeouts: reaching one is a failure of the test, not a pass.
SLOW = 60.0
#: World.stop's timeout at the end; it must return within STOP + 1 s.
STOP = 5.0


def schedule(i: int, seed: int) -> Tuple[str, str]:
    """(victim, phase) of iteration ``i``; one iteration in four has no victim ("")."""
    rng = random.Random(seed * 1_000_003 + i)
    victim, phase = rng.choice(MEMBERS[1:]), rng.choice(PHASES)
    return ("", "") if rng.random() < 0.25 else (victim, phase)


def _die(*_: object) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _echo(x: int) -> int:
    return x


def _deaths_before(member: str, i: int, seed: int) -> int:
    return sum(1 for j in range(i) if schedule(j, seed)[0] == member)


def chaos_body(world, iterations: int, seed: int) -> Dict[str, object]:
    """Run the loop as one member; returns its counts (survivors) or never returns (victims)."""
    me = world.name
    start = 0
    if world.incarnation > 1:  # resume after the iteration this member died in
        mine = [i for i in range(iterations) if schedule(i, seed)[0] == me]
        start = mine[world.incarnation - 2] + 1
    failed_fast: List[float] = []
    unexpected: List[str] = []  # failures of iterations in which nobody died
    completed = skipped = 0
    previous = None  # the last iteration's group, destroyed when the next one exists
    for i in range(start, iterations):
        victim, phase = schedule(i, seed)
        expected = {m: 1 + _deaths_before(m, i, seed) for m in MEMBERS[1:]}
        # Everyone takes part in iteration i with the incarnation that lives through it.
        world.membership.wait_until(
            lambda live: all((world.get_incarnation(m) or 0) >= n for m, n in expected.items()), SLOW)
        if victim and (world.get_incarnation(victim) or 0) > expected[victim]:
            skipped += 1  # it already died in this iteration and came back for the next
            continue
        dying = me == victim
        group = None
        began = time.monotonic()
        try:
            if dying and phase == "create":
                # Die while the others are inside group creation: once each has written
                # its join record (so each waits for this incarnation, not the next).
                # (each writes the list it proposes just before its join record, under a
                # key that does not depend on the epoch, which digests the incarnations)
                others = [m for m in MEMBERS if m != me]
                world.membership.registry.wait_all(world.membership.keys.group_proposal(f"it{i}", ""), others, SLOW,
                                                   f"iteration {i}: the others entering group creation")
                _die()
            group = world.create_rpc_group(f"it{i}", MEMBERS, timeout=SLOW)
            # The previous group goes once everyone is in this one (creating it is where
            # everyone meets), so nobody still reading it meets a withdrawn key.
            if previous is not None:
                previous.destroy()
                previous = None
            group.register(f"s-{me}", _die if dying and phase == "service" else _echo)
            group.pair(f"v-{me}", i)
            if dying and phase == "pair":
                _die()
            group.barrier(timeout=SLOW)
            if dying and phase == "barrier":
                _die()
            for other in MEMBERS:
                if other != me:
                    began = time.monotonic()
                    assert group.registered_sync(f"s-{other}", args=(i,), timeout=SLOW) == i
                    rref = group.get_paired(f"v-{other}", timeout=SLOW)
                    try:
                        value = rref.to_here(timeout=SLOW)
                    except RuntimeError as err:  # torch's RRef reports its owner's death as text
                        raise PeerLostError(other, str(err)) from err
                    assert value == i
            completed += 1
        except (PeerLostError, KeyError) as err:
            elapsed = time.monotonic() - began
            assert elapsed < FAST, f"iteration {i} ({victim} dies in {phase}): {err!r} after {elapsed:.1f} s"
            failed_fast.append(elapsed)
            if not victim:
                unexpected.append(f"iteration {i} {me}#{world.incarnation} t={time.time():.3f}: {err!r}")
        finally:
            if group is not None:
                if previous is not None:
                    previous.destroy()
                previous = group
        if dying:
            _die()  # its trigger was not reached (the others failed first): keep the schedule
    # Nobody leaves while another still reads the last iteration's group; the meeting is
    # among the final incarnations (a victim of the last iteration is back first).
    final = {m: 1 + _deaths_before(m, iterations, seed) for m in MEMBERS[1:]}
    world.membership.wait_until(
        lambda live: all((world.get_incarnation(m) or 0) >= n for m, n in final.items()), SLOW)
    world.create_rpc_group("end", MEMBERS, timeout=SLOW).barrier(timeout=SLOW)
    if previous is not None:
        previous.destroy()
    renewals = world.membership.renewals
    began = time.monotonic()
    world.stop(timeout=STOP)
    return {"completed": completed, "failed_fast": len(failed_fast), "skipped": skipped, "unexpected": unexpected,
            "renewals": renewals,
            "slowest_failure": max(failed_fast, default=0.0), "stop": time.monotonic() - began}


def dies_after_rank_0(world, args) -> object:
    """Rank 0 returns at once; every other rank SIGKILLs itself once rank 0 has left the
    world (a rank lost after the essential one finished: launch keeps its exception)."""
    if world.rank == 0:
        return {"name": "0"}
    world.membership.wait_until(lambda live: "0" not in live, SLOW)
    _die()
    return None  # (never reached)
