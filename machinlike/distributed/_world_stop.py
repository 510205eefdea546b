"""World stop: ``stop(timeout)`` never waits past its deadline.

Static: a stop barrier (a lost member wakes it at once), a graceful RPC shutdown only when
every peer arrived, else a local one. Elastic: free this member's keys, post "leave", stop
RPC locally. Local teardown always completes (``finally``), so a failed stop never keeps
the process from building a new World.

    stop(timeout)  static:   w/stop/<rank> barrier -> RPC shutdown (graceful when all came)
                             -> destroy the process group -> w/left/<rank> (the store's host
                             waits for the others: they still need the store)
                   elastic:  destroy this member's groups -> Membership.leave -> the store's
                             host waits for the others to leave
                   always:   _teardown_local (monitor, RPC, process group, environment,
                             this process's World slot)
"""

from __future__ import annotations

import datetime
import logging
import os
import time
from typing import Optional

import torch.distributed as dist

from . import _calls, _checks, _rendezvous, _samehost, _state, _transport
from ._registry import deadline_left

__all__ = ["WorldStop"]

log = logging.getLogger(__name__)


class WorldStop:
    """The stop paths of :class:`~machinlike.distributed.World` (a mixin it inherits).

    Holds no state of its own: what these methods use (``_stopped``, ``_stop_lock``,
    ``_membership``, ``_store_info``, ``_rpc_url``, ``_rpc_running``, ``_pg_running``,
    ``_saved_env``, ``_samehost``, ...) is initialised in ``World.__init__``, which owns it.
    """

    # -------------------------------------------------------------------- shutdown
    def stop(self, timeout: Optional[float] = None) -> None:
        """Leave the world.

        Static world: gracefully when every peer stops too, else locally. Waits at most
        ``timeout`` seconds for every member to call ``stop`` (a member known to be lost is
        not waited for). When all did, RPC shuts down gracefully (pending calls finish);
        otherwise, or when the graceful shutdown fails, locally.

        Elastic world: this member's services and values are withdrawn, the others see it
        leave, and RPC stops locally; the process hosting the store first waits (within
        ``timeout``) for the other members to leave, since they need the store.

        Safe to call twice; called on leaving a ``with World(...)`` block.

        Args:
            timeout: Seconds to wait for the peers. None: ``dist_timeout``.

        Raises:
            ValueError: ``timeout`` is not a positive number.
        """
        wait = _checks.seconds_or_none("timeout", timeout, self.dist_timeout)
        with self._stop_lock:
            if self._stopped:
                return
            self._stopped = True
        deadline = time.monotonic() + wait
        try:
            if self._membership is not None:
                self._leave_elastic(deadline) if self.elastic else self._leave_static(deadline, wait)
        except Exception as err:  # the local teardown below still has to happen
            log.warning("World %r: stop did not complete (%s); tearing down locally", self.name, err)
        finally:
            self._teardown_local()

    def _leave_static(self, deadline: float, wait: float) -> None:
        members = self.membership
        everyone = False
        names = [str(r) for r in range(self._size)]
        order = members.roster.names_by_rank()
        try:
            members.registry.set(members.keys.stop_prefix() + str(self.rank), "1")
            members.waits.wait_all(members.keys.stop_prefix(), names, order, deadline_left(deadline), "World.stop: ranks", wait)
            everyone = not self._rpc_running or members.members() == sorted(order)
        except (TimeoutError, ConnectionError) as err:
            log.warning("World %r stops without its peers: %s", self.name, err)
        members.close()
        if self._rpc_running:
            self._rpc_running = False
            if everyone:
                self._store_info.store.set_timeout(datetime.timedelta(seconds=max(deadline_left(deadline), 0.5)))
            _transport.shutdown(everyone, max(deadline_left(deadline), 0.5))
        if self._pg_running:
            self._pg_running = False
            dist.destroy_process_group()
        if not everyone:
            return
        try:
            members.registry.set(members.keys.left_prefix() + str(self.rank), "1")
            if self._store_info.hosted_here:
                # Peers may still be talking to the store inside their own shutdown.
                members.waits.wait_all(members.keys.left_prefix(), names[1:], order[1:], deadline_left(deadline),
                                 "World.stop: ranks leaving", wait)
        except (TimeoutError, ConnectionError) as err:
            log.warning("World %r closes its store before all peers left: %s", self.name, err)

    def _leave_elastic(self, deadline: float) -> None:
        members = self.membership
        for group in list(members.groups.values()):
            group.destroy()
        members.leave(deadline)
        if self._store_info.hosted_here:
            try:
                members.wait_until(lambda live: live in ([], [self.name]), deadline_left(deadline))
            except TimeoutError as err:
                log.warning("World %r closes the store while members remain: %s", self.name, err)

    def _teardown_local(self) -> None:
        self._stopped = True
        try:
            if self._membership is not None:
                self._membership.close()
            if self._rpc_url is not None:
                _rendezvous.forget_rpc_store(self._rpc_url)
            if self._rpc_running:
                self._rpc_running = False
                _transport.shutdown(False, 1.0)
            if self._pg_running:
                self._pg_running = False
                dist.destroy_process_group()
        finally:
            for var, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
            self._saved_env.clear()
            with _state.lock:
                if _state.current is self:
                    _calls.bind_tables(None)
                    _samehost.bind(None)  # [shm hook] then free this process's segments
                    if self._samehost is not None:
                        self._samehost.close()
                    _state.current = None
