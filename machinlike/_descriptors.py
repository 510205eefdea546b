"""Open files: this process's allowance (``ulimit -n``) raised once, and a warning before a
World, a launch or a process pool outgrows it.

Why: torch's RPC agent (TensorPipe) cannot survive a connection that finds no descriptor:
its event loop throws, and the process ends by SIGABRT ("too many open files"), a learner
with it. A process of a World keeps about 50 descriptors for torch's agent and gloo on
one host (about 200 in a static World across hosts, whose agent keeps torch's default
channels); a member that hosts the store and that every member calls (rank 0 of a World
started by hand, a learner) about 20 more a member (six store connections, the RPC pipes
both ways and their channels' connections, the same-host lane, gloo's pair); ``launch``'s
own process, which hosts its ranks' store, about 12 a rank; a process pool's owner about
5 a worker. So under the soft limit most Linux sessions start with (1,024) a store host
runs out at about 50 members. The hard limit there is usually 512k or more: raising the
soft one is a user's right, and what Go's runtime and Ray do at start. What may not be
raised (a hard limit that low) is said, once, with the fix, when the members a World has
or expects (or a pool's workers) need more::

    World / launch / Pool      raise_limit()        soft = min(hard, TARGET) when lower
                               Budget(who, per)     one per World / launch / pool
      static, launch, pool:  budget.check(size)     at start-up: the size is known
      elastic:         budget.joined(+1 / -1)       on each join, leave or loss
                         need(members) > soft ─► one warning (never an error: the figures
                                                  are estimates; a World that calls few
                                                  peers needs fewer)

(Measured on 2-core Linux, torch 2.13, every member calling rank 0: a static World's rank
0 hosting the store 102 descriptors at 4 members, 251 at 12 (214 and 363 with torch's
default channels); any other member 43 and 56; raw torch RPC's rank 0, 327 and 799, its
shared-memory transport's memfds. An elastic World's host, its members calling nobody:
62 at 3 members, 164 at 11. The estimates below keep the larger figures: a warning is
better early than late.)
"""

from __future__ import annotations

import logging
import resource
import threading

__all__ = ["TARGET", "BASE", "BASE_NO_GLOO", "PER_MEMBER_HOST", "PER_MEMBER", "PER_RANK_LAUNCHER", "PER_POOL_WORKER",
           "raise_limit", "need", "Budget"]

log = logging.getLogger("machinlike")

TARGET = 65536  # enough for thousands of members at the store's host; not unlimited: some
# code still walks every possible descriptor before an exec (a soft limit of 2**30 makes
# that take seconds)
BASE = 200  # a World's process before any peer (torch's agent, gloo; measured 150-180)
BASE_NO_GLOO = 100  # the same without a gloo process group (an elastic World; measured 40-60)
PER_MEMBER_HOST = 20  # a member hosting the store, for each member (measured 18.6, each calling it)
PER_MEMBER = 2  # any other member, for each member (measured 1.6)
PER_RANK_LAUNCHER = 12  # launch()'s process, which hosts the store, for each rank (measured 12)
PER_POOL_WORKER = 5  # a process pool's owner, for each worker (measured 4.2: pipes, sentinels)

_ABORTS = "torch's RPC agent aborts the process (SIGABRT, 'too many open files')"
_lock = threading.Lock()


def raise_limit(target: int = TARGET) -> int:
    """Raise this process's soft limit of open files to ``target`` (or the hard limit,
    if lower); never lower it. Returns the soft limit now (``resource.RLIM_INFINITY``
    when unlimited)."""
    with _lock:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = target if hard == resource.RLIM_INFINITY else min(hard, target)
        if soft != resource.RLIM_INFINITY and soft < want:
            try:
                resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            except (ValueError, OSError) as exc:  # (a sandbox may refuse even this)
                log.debug("could not raise the soft limit of open files from %d to %d: %s", soft, want, exc)
            else:
                log.debug("raised the soft limit of open files from %d to %d (hard limit %d)", soft, want, hard)
                soft = want
        return soft


def need(members: int, per_member: int, base: int = BASE) -> int:
    """Descriptors a process needs, about: ``base`` and ``per_member`` for each of ``members``."""
    return base + members * per_member


class Budget:
    """Warns, once, when the members of a World (the ranks of a launch, the workers of a
    pool) need more descriptors than this process may open (the module doc). ``who``:
    the World, the launch or the pool, for the message; ``per_member``, ``base``: as for :func:`need`;
    ``role``: what this process is to them, ``unit`` what they are, and ``outcome`` what
    running out does, for the message."""

    def __init__(self, who: str, per_member: int, base: int = BASE, role: str = "", unit: str = "members",
                 outcome: str = _ABORTS) -> None:
        self._who = who
        self._unit = unit
        self._outcome = outcome
        self._per_member = per_member
        self._base = base
        self._role = role
        self._members = 0
        self._warned = False
        self._lock = threading.Lock()

    def joined(self, change: int) -> None:
        """Members counted here changed by ``change`` (+1 a join, -1 a leave or a loss)."""
        with self._lock:
            self._members += change
            members = self._members
        self.check(members)

    def refuse_beyond_hard(self, members: int, param: str) -> None:
        """Raise before anything starts when ``members`` need more descriptors than the
        hard limit lets this process open: such a job cannot run (a launch of 10**6 ranks
        started hundreds, each warning, until killed minutes on; cold trial 20).

        Raises:
            ValueError: naming ``param``, the need, the limit and the fix.
        """
        wanted = need(members, self._per_member, self._base)
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        if hard != resource.RLIM_INFINITY and wanted > hard:
            raise ValueError(
                f"{param}={members:,}: {members:,} {self._unit} need about {wanted:,} open files in this process "
                f"({self._base} to start, about {self._per_member} a {self._unit[:-1]}"
                f"{': ' + self._role if self._role else ''}), and it may open at most {hard:,} (the hard limit, "
                f"ulimit -Hn). Fix: fewer {self._unit}, or raise the hard limit before starting (`ulimit -Hn "
                f"{max(65536, wanted):,}` as root, LimitNOFILE= in a systemd unit, `--ulimit nofile=...` for docker)")

    def check(self, members: int) -> bool:
        """Warn (once) if ``members`` members need more descriptors than the soft limit;
        returns whether they do."""
        if self._warned:
            return True
        wanted = need(members, self._per_member, self._base)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or wanted <= soft:
            return False
        self._warned = True
        log.warning(
            "%s: this process may open %d files (ulimit -n; hard limit %s) and %d %s need about %d here (%d "
            "to start, about %d a %s%s). Out of descriptors, %s. Fix: raise the hard limit before starting "
            "(`ulimit -Hn 65536` as root, LimitNOFILE= in a systemd unit, `--ulimit nofile=65536` for docker); "
            "machinlike raises the soft one itself", self._who, soft,
            "unlimited" if hard == resource.RLIM_INFINITY else hard, members, self._unit, wanted, self._base,
            self._per_member, self._unit[:-1], f": {self._role}" if self._role else "", self._outcome)
        return True
