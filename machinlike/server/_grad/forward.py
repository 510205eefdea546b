"""Forwarder: a secondary reducer's link to the primary, one partial sum in flight at a time.

Owns the forward in flight and the counts of what was forwarded and what was lost. Only
the secondary's reducer thread calls :meth:`Forwarder.send` and :meth:`Forwarder.drain`,
so it needs no lock (``stats`` reads two ints)::

    send(item)   drain() ─► start the forward:
                   primary in this process: its accept(item), waited with a timeout
                   elsewhere: registered_async("<server>/_reduce") on the group
                 ─► in flight; the thread reduces the next batch while it travels
    drain()      wait for the forward in flight (a flush completes only after it)
    lost         the primary's service gone (KeyError), the primary stopped
                 (ServerStoppedError: its member closes the server) or the primary lost:
                 a PeerLostError naming the primary; the pushes are counted as
                 lost_forwarding (with the one not yet sent); static world: raised (the
                 reducer thread fails with it); elastic world: logged (once, until a
                 forward lands again), for the primary may come back

Why apart from ``_grad.reducer``: where a partial sum goes and what its loss means is the
server's wiring, not the queue-and-thread state machine; the reducer only sends.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Tuple, Union

import torch

from ...distributed import RpcFuture, RpcGroup
from ...exception import PeerLostError, raised_remotely
from .._errors import ServerStoppedError
from .items import Item, wait_future

__all__ = ["Forwarder"]

log = logging.getLogger(__name__)


class _LocalForward:
    """A forward to the primary of the same process, waited on with a timeout."""

    def __init__(self, fut: torch.futures.Future, timeout: float, what: str) -> None:
        self._fut = fut
        self._timeout = timeout
        self._what = what

    def wait(self) -> Any:
        return wait_future(self._fut, self._timeout, self._what)


class _RemoteForward:
    """A forward to the primary in another process; its loss is named as the primary's."""

    def __init__(self, fut: RpcFuture, lost: Callable[[BaseException], BaseException]) -> None:
        self._fut = fut
        self._lost = lost

    def wait(self) -> Any:
        try:
            return self._fut.wait()
        except (PeerLostError, KeyError) as err:
            if raised_remotely(err):  # the primary's own KeyError: not its loss
                raise
            raise self._lost(err) from err


class Forwarder:
    """Sends one secondary's partial sums to the primary.

    Args:
        group: The server's group.
        server_name: The gradient server's name.
        member: This (the secondary's) member name, for messages.
        primary: The primary reducer's member name.
        local: The primary's ``accept`` when it shares this process; None otherwise.
        timeout: Seconds a forward to a local primary may wait to be queued.
        elastic: Whether a lost forward is counted (elastic world) rather than fatal.

    Attributes:
        forwarded: Pushes sent on (in partial sums).
        lost: Pushes dropped because the primary was gone, whether sent first or not (in
            a static world the reducer then fails: these are the pushes it had taken).
        failing: Why the last forward was lost, while none has landed since; None otherwise.
    """

    def __init__(self, group: RpcGroup, server_name: str, member: str, primary: str,
                 local: Optional[Callable[[Item], torch.futures.Future]], timeout: float, elastic: bool) -> None:
        self._group = group
        self._server_name = server_name
        self._member = member
        self._primary = primary
        self._local = local
        self._timeout = timeout
        self._elastic = elastic
        self._in_flight: Optional[Tuple[Union[_LocalForward, _RemoteForward], int]] = None
        self.forwarded = 0
        self.lost = 0
        # Why the last forward was lost, while no forward has landed since (else None): a
        # loss is logged once a streak, and the reducer's stop names it instead of advising
        # a flush that could not help.
        self.failing: Optional[str] = None

    @property
    def primary(self) -> str:
        """The primary reducer's member name."""
        return self._primary

    def send(self, item: Item) -> None:
        """Wait for the forward in flight, then start forwarding ``item`` (on the reducer's device).

        Raises:
            PeerLostError: (static world) the primary is gone.
        """
        try:
            self.drain()
        except BaseException:
            self.lost += item.count  # (static world: the reducer fails; this one is never sent)
            raise
        try:
            self._in_flight = (self._start(item), item.count)
        except (ConnectionError, KeyError, ServerStoppedError) as err:  # no primary to send to
            self._lose(item.count, err)
            return
        self.forwarded += item.count

    def drain(self) -> None:
        """Wait for the forward in flight, if any (bounded by the call's timeout)."""
        in_flight, self._in_flight = self._in_flight, None
        if in_flight is not None:
            try:
                in_flight[0].wait()
            except (ConnectionError, KeyError, ServerStoppedError) as err:
                if isinstance(err, KeyError) and raised_remotely(err):  # (a failure of the primary's code)
                    self.lost += in_flight[1]
                    raise
                self._lose(in_flight[1], err)
            else:
                self.failing = None

    def _start(self, item: Item) -> Union[_LocalForward, _RemoteForward]:
        if self._local is not None:  # primary and secondary share this process
            return _LocalForward(self._local(item), self._timeout, f"forward to the primary of {self._server_name!r}")
        try:
            fut = self._group.registered_async(f"{self._server_name}/_reduce",
                                               (item.grads, item.count, item.versions, item.origin))
        except (PeerLostError, KeyError) as err:
            raise self._primary_lost(err) from err
        return _RemoteForward(fut, self._primary_lost)

    def _primary_lost(self, err: BaseException) -> BaseException:
        """A forward's failure as the loss of the primary, named: its service is gone (KeyError:
        its keys were freed, or it closed) or the primary did not answer. Another member's
        loss is passed on as it is."""
        if isinstance(err, PeerLostError) and err.member != self._primary:
            return err
        why = err.detail if isinstance(err, PeerLostError) else (err.args[0] if err.args else repr(err))
        return PeerLostError(self._primary, f"the primary reducer of gradient server {self._server_name!r} "
                                            f"is gone ({why})")

    def _lose(self, count: int, err: BaseException) -> None:
        # Static worlds: the primary's loss ends this reducer (its thread fails). Elastic
        # ones: the pushes are dropped (the primary's ledger reports them) and the
        # reducer goes on, for the primary may come back.
        self.lost += count
        streak = self.failing is not None
        self.failing = str(err)
        if not self._elastic:
            raise err
        # (once a streak: a primary that stopped or died meets every forward until it is back)
        log.log(logging.DEBUG if streak else logging.WARNING,
                "gradient server %r: secondary reducer %r dropped %d pushes it could not forward (said once until "
                "a forward lands again; lost_forwarding counts them): %s", self._server_name, self._member, count, err)
