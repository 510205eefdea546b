"""Open files: this process's allowance (``ulimit -n``) raised once, and a warning before a
World outgrows it.

Why: torch's RPC agent (TensorPipe) cannot survive a connection that finds no descriptor:
its event loop throws, and the process ends by SIGABRT ("too many open files"), a learner
with it. A process of a World keeps about 200 descriptors for torch's agent and gloo
alone, and the process that hosts the store about ten more for each member (six store
connections, the member's RPC pipe and lane), so under the soft limit most Linux
sessions start with (1,024) a store host died at about 90 members. The hard limit there
is usually 512k or more: raising the soft one is a user's right, and what Go's runtime
and Ray do at start. What may not be raised (a hard limit that low) is said, once, with
the fix, when the members a World has or expects need more::

    World(...)  raise_limit()           soft = min(hard, TARGET) when it was lower
                Budget(name, hosts)     one per World
      static:   budget.check(size)      at start-up: size is known
      elastic:  budget.joined(+1 / -1)  on each join, leave or loss: the count changes
                  need(members) > soft ─► one warning for this World (never an error: the
                                          figures are estimates, and a World that calls few
                                          peers needs fewer)
"""

from __future__ import annotations

import logging
import resource
import threading

__all__ = ["TARGET", "BASE", "PER_MEMBER_HOST", "PER_MEMBER", "raise_limit", "need", "Budget"]

log = logging.getLogger("machinlike")

TARGET = 65536  # enough for thousands of members at the store's host; not unlimited: some
# code still walks every possible descriptor before an exec (a soft limit of 2**30 makes
# that take seconds)
BASE = 200  # a World's process before any peer (torch's agent, gloo; measured 150-180)
PER_MEMBER_HOST = 10  # the store's host, for each member (measured 9.2, each member calling it)
PER_MEMBER = 2  # any other member, for each member (measured 1.2)

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


def need(members: int, hosts_store: bool) -> int:
    """Descriptors a process of a World of ``members`` members needs, about."""
    return BASE + members * (PER_MEMBER_HOST if hosts_store else PER_MEMBER)


class Budget:
    """Warns, once, when a World's members need more descriptors than this process may
    open (the module doc). ``hosts_store``: this process hosts the World's store."""

    def __init__(self, name: str, hosts_store: bool) -> None:
        self._name = name
        self._hosts_store = hosts_store
        self._members = 0
        self._warned = False
        self._lock = threading.Lock()

    def joined(self, change: int) -> None:
        """Members counted here changed by ``change`` (+1 a join, -1 a leave or a loss)."""
        with self._lock:
            self._members += change
            members = self._members
        self.check(members)

    def check(self, members: int) -> bool:
        """Warn (once) if ``members`` members need more descriptors than the soft limit;
        returns whether they do."""
        if self._warned:
            return True
        wanted = need(members, self._hosts_store)
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or wanted <= soft:
            return False
        self._warned = True
        role = (f"it hosts the store: about {PER_MEMBER_HOST} a member" if self._hosts_store
                else f"about {PER_MEMBER} a member")
        log.warning(
            "World %r: this process may open %d files (ulimit -n; hard limit %s) and %d members need about %d "
            "here (%d for torch's RPC agent and gloo, %s). Out of descriptors, torch's RPC agent aborts the "
            "process (SIGABRT, 'too many open files'). Fix: raise the hard limit before starting (`ulimit -Hn "
            "65536` as root, LimitNOFILE= in a systemd unit, `--ulimit nofile=65536` for docker); machinlike "
            "raises the soft one itself", self._name, soft,
            "unlimited" if hard == resource.RLIM_INFINITY else hard, members, wanted, BASE, role)
        return True
