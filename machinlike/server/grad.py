"""PushPullGradServer: clients push gradients, reducers sum them in a tree, the primary
steps the optimizer and publishes parameters that clients pull.

Data flow::

    client push(model) ── validated, one RPC (or a local call) ──► secondary reducer
         ▲                  True: queued; False: its queue was full     │ reduce_batch_size
         │                                                              ▼ pushes summed
    pull(model) ◄── ordered server ◄── publish ◄── primary reducer ◄── partial sums
      (nothing is sent when the     version v+1    sets .grad, optimizer.step(),
       model already has the newest)               lr_scheduler.step()

Maths. A secondary sums ``reduce_batch_size`` pushed gradient dicts; the primary sums
``reduce_batch_size`` of those partial sums, so one optimizer step normally combines
``reduce_batch_size ** 2`` pushes (fewer after a :meth:`PushPullGradServer.flush`). With
``reduce_method="sum"`` the gradient set on each parameter is the sum of the pushed
gradients; with ``"mean"`` it is that sum divided, once, by the number of pushes in the
step. Sums are accumulated in the gradient's dtype (float16/bfloat16 in float32) and cast
to the parameter's dtype at the end, so integer-valued gradients (below 2**24 in float32)
are summed exactly and, with ``SGD(lr=1)``, the weights are predictable to the last bit.
A parameter with no gradient in any push of a step gets a zero gradient.

Routing. A client whose process hosts a secondary reducer of the server pushes to it
directly (no RPC, one copy of the gradients); other clients go round-robin over the
secondaries. A secondary that cannot be reached fails that push with
:class:`~machinlike.exception.PeerLostError` naming it (within the call's timeout); the
accessor then leaves it out, so later pushes are rerouted to the remaining secondaries.
Gradients queued on a secondary that died are lost with it.

Back-pressure. A secondary holds at most ``max_queue_size`` pushes. A push made the machin
way (``push(model)``: push, then pull) that finds the queue full waits for room, bounded
by the accessor's timeout; a fast-path push (``push(model, pull=False)``) is refused
instead (it returns False, nothing of it is applied) and counted as ``rejected`` in
:meth:`PushPullGradServerImpl.stats`. The primary never drops: a partial
sum that finds its queue full waits (the forwarding secondary pauses, its queue fills,
clients get False). ``stop()`` drops what is still queued and counts it as ``dropped``;
call ``flush()`` first to apply everything.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence

import torch
from torch.distributed import rpc

from ..distributed import MemberEvent, RpcGroup, RpcFuture, get_world
from ..exception import PeerLostError
from ._checkpoint import CheckpointError
from ._churn import Admission, Ledger
from ._common import check_group, check_timeout, rpc_timeout
from ._grad_checkpoint import PrimaryCheckpoint
from ._grad_accessor import PushPullGradServer
from ._grad_settings import GradSettings, grad_settings
from ._host import host_checkpoint
from ._hosted import Hosting, check_not_hosted
from ._reducer import Item, PrimaryReducer, SecondaryReducer, ServerStoppedError, wait_future
from ._spec import Spec, check_module, spec_of
from .ordered import OrderedServerBase, OrderedServerSimple, OrderedServerSimpleImpl

__all__ = ["PushPullGradServer", "PushPullGradServerImpl", "ServerStoppedError", "CheckpointError"]

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

    def __init__(self, fut: RpcFuture, lost: Any) -> None:
        self._fut = fut
        self._lost = lost

    def wait(self) -> Any:
        try:
            return self._fut.wait()
        except (PeerLostError, KeyError) as err:
            raise self._lost(err) from err


class PushPullGradServerImpl:
    """One member's part of a gradient server: primary reducer, secondary reducer, or both.

    Construct it on the primary and on every secondary (all with the same arguments);
    call :meth:`manage_model` on the primary, then :meth:`start` everywhere. A secondary
    that was not started starts on its first push, so machin's way of building the
    server (``start()`` on the primary only) uses every member's gradients too. The primary
    hosts the default ordered server and pairs the :class:`PushPullGradServer` accessor
    under ``server_name``.

    Args:
        server_name: Name of the server, unique in ``group``.
        group: The RpcGroup of reducers and clients.
        model_name: Key of the published parameters in the ordered server.
        primary_reducer: Member that steps the optimizer; None: the first group member.
        secondary_reducers: Members that take client pushes; None: every group member.
        o_server: Ordered server to publish to; None: one hosted by the primary
            (``"<server_name>/ordered"``, version_depth 1).
        reduce_method: ``"sum"`` or ``"mean"`` (see the module documentation).
        reduce_device: Device the reductions run on.
        reduce_batch_size: Items each reducer combines per batch (>= 1).
        max_queue_size: Pushes a secondary (or partial sums the primary) may hold
            (>= reduce_batch_size).
        checkpoint_dir: Directory where the primary keeps an atomic checkpoint
            (parameters, optimizer and lr-scheduler state, version, push accounting)
            and its version lease; a primary whose directory holds one resumes from it
            in :meth:`manage_model`, publishing above every version ever published.
            None: no checkpoints.
        checkpoint_every: With ``checkpoint_dir``: write one every this many versions
            (and one before version 0).
        checkpoint_interval: With ``checkpoint_dir``: also write one when this many
            seconds passed since the last; None: by versions only.

    Raises:
        ValueError, TypeError: invalid arguments, or this member is no reducer.
        KeyError: the server's names are already used in ``group``.
    """

    def __init__(self, server_name: str, group: RpcGroup, model_name: str = "model",
                 primary_reducer: Optional[str] = None, secondary_reducers: Optional[Sequence[str]] = None,
                 o_server: Optional[OrderedServerBase] = None, reduce_method: str = "sum",
                 reduce_device: Any = "cpu", reduce_batch_size: int = 4, max_queue_size: int = 64,
                 checkpoint_dir: Any = None, checkpoint_every: int = 100,
                 checkpoint_interval: Optional[float] = None) -> None:
        self._open(grad_settings(server_name, check_group(group), model_name, primary_reducer, secondary_reducers,
                                 o_server, reduce_method, reduce_device, reduce_batch_size, max_queue_size,
                                 checkpoint_dir, checkpoint_every, checkpoint_interval))

    @classmethod
    def _checked(cls, settings: GradSettings) -> "PushPullGradServerImpl":
        """Built from :func:`grad_settings` a helper checked already."""
        self = cls.__new__(cls)
        self._open(settings)
        return self

    def _open(self, settings: GradSettings) -> None:
        server_name, group = settings.server_name, settings.group
        self.server_name = server_name
        self.group = group
        self.model_name = settings.model_name
        self.primary_reducer = settings.primary
        self.secondary_reducers = settings.secondaries
        self.reduce_method = settings.reduce_method
        self.reduce_device = settings.reduce_device
        checkpoint = host_checkpoint(settings.checkpoint_dir, "grad-server", server_name, settings.checkpoint_every,
                                     settings.checkpoint_interval)
        self._checkpoint = None if checkpoint is None else PrimaryCheckpoint(checkpoint)
        self.member = group.get_cur_name()
        if self.member != self.primary_reducer and self.member not in self.secondary_reducers:
            raise ValueError(f"member {self.member!r} is neither the primary reducer ({self.primary_reducer!r}) nor "
                             f"a secondary one ({self.secondary_reducers}): construct PushPullGradServerImpl only "
                             f"on reducers; clients use the PushPullGradServer accessor")
        check_not_hosted(group, server_name)
        # The World's setting, read once: the reducer threads wait with it, even while
        # the World is stopping.
        self._rpc_timeout = rpc_timeout()
        o_server = settings.o_server

        self._model: Optional[torch.nn.Module] = None
        self._params: Dict[str, torch.nn.Parameter] = {}
        self._spec: Optional[Spec] = None
        self._optimizer: Any = None
        self._lr_scheduler: Any = None
        self._version = -1  # nothing published yet
        self._lag = {"sum": 0, "count": 0, "max": 0}
        self._keys: List[str] = []
        self._paired = False
        self._closed = False
        self.o_server_impl: Optional[OrderedServerSimpleImpl] = None
        args = (server_name, self.member, settings.batch, settings.max_queue, self.reduce_device)
        self.secondary: Optional[SecondaryReducer] = None
        self.primary: Optional[PrimaryReducer] = None
        world = get_world()
        # Elastic worlds: pushes are counted in the store so that what dies with a
        # secondary is reported (see _churn); secondaries are whoever hosts one, now or later.
        self._elastic = world is not None and world.elastic
        self._dynamic = self._elastic and settings.discover
        self._admission = self._ledger = None
        self._events = {"losses": 0, "rejoins": 0}
        self._published_at = time.monotonic()
        if self.member in self.secondary_reducers:
            if self._elastic:
                self._admission = Admission(world, group.get_group_name(), server_name, self.primary_reducer)
            self.secondary = SecondaryReducer(*args, forward=self._forward,
                                              admit=None if self._admission is None else self._admission.admit)
        if self.member == self.primary_reducer:
            if self._elastic:
                self._ledger = Ledger(world, group.get_group_name(), server_name)
            self.primary = PrimaryReducer(*args, apply=self._apply, version=lambda: self._version,
                                          receive=None if self._ledger is None else self._ledger.receive)
        try:
            if self.secondary is not None:
                self._register(f"{server_name}/_push/{self.member}", self.secondary.accept)
                self._register(f"{server_name}/_push_wait/{self.member}", self._push_wait_service)
                self._register(f"{server_name}/_flush/{self.member}", self._flush_secondary_service)
            if self.primary is not None:
                self._register(f"{server_name}/_reduce", self._reduce_service)
                self._register(f"{server_name}/_flush", self._flush_primary_service)
                self._register(f"{server_name}/_spec", self._spec_service)
                if o_server is None:
                    self.o_server_impl = OrderedServerSimpleImpl._checked(f"{server_name}/ordered", group, 1)
                    o_server = OrderedServerSimple._checked(f"{server_name}/ordered", group)
                group.pair(server_name, PushPullGradServer._checked(
                    server_name, group, self.model_name, None if self._dynamic else self.secondary_reducers,
                    o_server, None))
                self._paired = True
            self._hosting = Hosting(group, server_name, self.secondary)
        except BaseException:
            self._withdraw()
            raise
        self.o_server = o_server
        if self._elastic:
            world.on_member_change(self._on_member)

    def _on_member(self, event: MemberEvent) -> None:
        # On the liveness thread: count and log only.
        if event.member == self.member:
            return
        if event.kind == "lost":
            self._events["losses"] += 1
            log.warning("gradient server %r on %r: member %r (incarnation %d) was lost", self.server_name,
                        self.member, event.member, event.incarnation)
        elif event.kind == "join" and event.incarnation > 1:
            self._events["rejoins"] += 1
            log.warning("gradient server %r on %r: member %r rejoined (incarnation %d)", self.server_name,
                        self.member, event.member, event.incarnation)

    def __repr__(self) -> str:
        roles = [r for r, x in (("primary", self.primary), ("secondary", self.secondary)) if x is not None]
        return f"<PushPullGradServerImpl {self.server_name!r} on {self.member!r} ({'+'.join(roles)})>"

    def _register(self, key: str, service: Any) -> None:
        self.group.register(key, service)
        self._keys.append(key)

    def _withdraw(self) -> None:
        for key in self._keys:
            self.group.deregister(key)
        self._keys = []
        if self._paired:
            self.group.unpair(self.server_name)
            self._paired = False
        if self.o_server_impl is not None:
            self.o_server_impl.close()

    # ------------------------------------------------------------ the primary
    def manage_model(self, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any = None) -> None:
        """Hand the primary the model it optimises; publishes its parameters as version 0.

        The model stays on its device (gradients are moved to it). Do not use it
        elsewhere once :meth:`start` ran: the primary's thread steps it.

        Args:
            model: The managed model.
            optimizer: Anything with ``step()`` over the model's parameters.
            lr_scheduler: Anything with ``step()``, stepped after every optimizer step.

        Raises:
            RuntimeError: this member is not the primary reducer, or a model is managed already.
            TypeError: bad arguments.
        """
        if self.primary is None:
            raise RuntimeError(f"manage_model() must be called on the primary reducer {self.primary_reducer!r}, "
                               f"not on member {self.member!r}")
        if self._model is not None:
            raise RuntimeError(f"gradient server {self.server_name!r} already manages a model")
        check_module(model)
        if not callable(getattr(optimizer, "step", None)):
            raise TypeError(f"optimizer must have a step() method, not {type(optimizer).__name__}")
        if lr_scheduler is not None and not callable(getattr(lr_scheduler, "step", None)):
            raise TypeError(f"lr_scheduler must have a step() method or be None, not {type(lr_scheduler).__name__}")
        params = dict(model.named_parameters())
        if not params:
            raise ValueError("the managed model has no parameters")
        self._model, self._params, self._spec = model, params, spec_of(params)
        self._optimizer, self._lr_scheduler = optimizer, lr_scheduler
        if self._checkpoint is not None:
            self._checkpoint.manage(self._checkpoint_state)
        if self._resume():
            return
        self._publish_first()

    # ------------------------------------------------------------ checkpoints
    def _resume(self) -> bool:
        """Load the checkpoint, if any, and publish it under a never-used version."""
        if self._checkpoint is None:
            return False
        loaded = self._checkpoint.resume(self._params, self._optimizer, self._lr_scheduler)
        if loaded is None:
            return False
        state, resume = loaded
        if self._ledger is not None:
            self._ledger.restore(state["applied"])
        snapshot = self._snapshot()
        if self.o_server_impl is not None:
            stored = self.o_server_impl.store(self.model_name, snapshot, resume, None)
        else:
            got = self.o_server.pull(self.model_name)
            stored = self.o_server.push(self.model_name, snapshot, resume, None if got is None else got[1])
        if not stored:
            raise RuntimeError(f"the ordered server refused resumed version {resume} of {self.model_name!r}")
        self._version = resume
        self._published_at = time.monotonic()
        log.warning("gradient server %r: primary resumed from %r (checkpoint version %d) as version %d",
                    self.server_name, self._checkpoint.path, state["version"], resume)
        return True

    def _checkpoint_state(self) -> Dict[str, Any]:
        scheduler = self._lr_scheduler.state_dict() if self._lr_scheduler is not None else None
        return {"params": self._snapshot(), "optimizer": self._optimizer.state_dict(), "lr_scheduler": scheduler,
                "version": self._version, "applied": self._ledger.state() if self._ledger is not None else {}}

    def _snapshot(self) -> Dict[str, torch.Tensor]:
        return {name: p.detach().to("cpu", copy=True) for name, p in self._params.items()}

    def _publish_first(self) -> None:
        if self._checkpoint is not None:  # on disk before anything is visible (see _grad_checkpoint)
            self._checkpoint.first()
            self._checkpoint.cover(0)
        snapshot = self._snapshot()
        if self.o_server_impl is not None:
            stored = self.o_server_impl.store(self.model_name, snapshot, 0, None)
        else:
            stored = self.o_server.push(self.model_name, snapshot, 0, None)
        if stored:
            self._version = 0
            self._published_at = time.monotonic()
            return
        # A custom ordered server that already holds a chain under this key: continue it.
        got = self.o_server.pull(self.model_name)
        if got is None or not isinstance(got[1], int):
            raise RuntimeError(f"the ordered server refused version 0 of {self.model_name!r} and holds no "
                               f"integer version to continue from")
        self._version = got[1]
        self._publish(self._version + 1)

    def _publish(self, version: int) -> None:
        if self._checkpoint is not None:
            self._checkpoint.cover(version)  # leased before visible: a resume goes above it
        snapshot = self._snapshot()
        if self.o_server_impl is not None:
            stored = self.o_server_impl.store(self.model_name, snapshot, version, self._version)
        else:
            stored = self.o_server.push(self.model_name, snapshot, version, self._version)
        if not stored:
            raise RuntimeError(f"the ordered server refused version {version} of {self.model_name!r}: something "
                               f"else pushes to that key")
        self._version = version
        self._published_at = time.monotonic()

    def _apply(self, item: Item) -> None:
        # Runs on the primary's thread only.
        with torch.no_grad():
            for name, param in self._params.items():
                grad = item.grads.get(name)
                if grad is None:
                    param.grad = torch.zeros_like(param)
                    continue
                if self.reduce_method == "mean":
                    grad.div_(item.count)  # the sum belongs to us: divide it in place, once
                param.grad = grad.to(device=param.device, dtype=param.dtype)
        self._optimizer.step()
        if self._lr_scheduler is not None:
            self._lr_scheduler.step()
        for version in item.versions:
            if version >= 0:
                lag = self._version - version
                self._lag["sum"] += lag
                self._lag["count"] += 1
                self._lag["max"] = max(self._lag["max"], lag)
        self._publish(self._version + 1)
        if self._ledger is not None and item.origin is not None:
            self._ledger.applied(item.origin)
        if self._checkpoint is not None:
            self._checkpoint.made()

    # ------------------------------------------------------------ services
    def _forward(self, item: Item) -> Any:
        if self.primary is not None:  # primary and secondary share this process
            return _LocalForward(self.primary.accept(item), self._rpc_timeout,
                                 f"forward to the primary of {self.server_name!r}")
        try:
            fut = self.group.registered_async(f"{self.server_name}/_reduce",
                                              (item.grads, item.count, item.versions, item.origin))
        except (PeerLostError, KeyError) as err:
            raise self._primary_lost(err) from err
        return _RemoteForward(fut, self._primary_lost)

    def _primary_lost(self, err: BaseException) -> BaseException:
        """A forward's failure as the loss of the primary, named: its service is gone (KeyError:
        its keys were freed, or it closed) or the primary did not answer. Another member's
        loss is passed on as it is."""
        if isinstance(err, PeerLostError) and err.member != self.primary_reducer:
            return err
        why = err.detail if isinstance(err, PeerLostError) else (err.args[0] if err.args else repr(err))
        return PeerLostError(self.primary_reducer, f"the primary reducer of gradient server {self.server_name!r} "
                                                   f"is gone ({why})")

    @rpc.functions.async_execution
    def _reduce_service(self, grads: Dict[str, torch.Tensor], count: int, versions: List[int],
                        origin: Optional[Dict[Any, int]] = None) -> torch.futures.Future:
        return self.primary.accept(Item(grads, count, versions, origin))

    @rpc.functions.async_execution
    def _push_wait_service(self, grads: Dict[str, torch.Tensor], version: int,
                           client: str = "") -> torch.futures.Future:
        return self.secondary.offer(grads, version, client)

    @rpc.functions.async_execution
    def _flush_secondary_service(self) -> torch.futures.Future:
        return self.secondary.flush()

    @rpc.functions.async_execution
    def _flush_primary_service(self) -> torch.futures.Future:
        return self.primary.flush()

    def _spec_service(self) -> Spec:
        if self._spec is None:
            raise RuntimeError(f"gradient server {self.server_name!r} has no model yet: call manage_model() on "
                               f"the primary reducer {self.primary_reducer!r}")
        return self._spec

    # ------------------------------------------------------------ life cycle
    def _reducers(self) -> List[Any]:
        # Secondaries first: stopping them before the primary lets a forward in flight
        # land instead of failing against a stopped primary.
        return [r for r in (self.secondary, self.primary) if r is not None]

    def start(self) -> None:
        """Start this member's reducer threads (named ``machinlike-grad-<server>-<role>``).

        Raises:
            RuntimeError: on the primary before :meth:`manage_model`; after :meth:`stop`.
        """
        if self._closed:
            raise RuntimeError(f"gradient server {self.server_name!r} is closed")
        if self.primary is not None and self._model is None:
            raise RuntimeError("call manage_model(model, optimizer) on the primary reducer before start()")
        for reducer in self._reducers():
            reducer.start()

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop this member's reducers; what they still hold is dropped (counted, logged).

        Later pushes and flushes reaching this member raise :class:`ServerStoppedError`.
        Safe to call twice.

        Args:
            timeout: Seconds to wait for the threads to end; None: the world's rpc_timeout.

        Raises:
            TimeoutError: a thread was still finishing a batch when the time ran out.
        """
        self._stop_roles(("secondary", "primary"), timeout)

    def _stop_roles(self, roles: Sequence[str], timeout: Optional[float]) -> None:
        wait = check_timeout(timeout) or self._rpc_timeout
        deadline = time.monotonic() + wait
        for reducer in self._reducers():
            if reducer.role in roles:
                reducer.stop(max(0.001, deadline - time.monotonic()))

    def watch(self) -> None:
        """Re-raise the exception that ended a reducer thread of this member, if any."""
        for reducer in self._reducers():
            reducer.watch()

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop, then withdraw the services, the accessor and the hosted ordered server.

        Safe to call twice. Every reducer member closes its own part; with
        :func:`~machinlike.server.grad_server_helper` use ``ServerHandles.close()``, which
        orders the members' shutdown.

        Args:
            timeout: Seconds to wait for the reducer threads; None: the world's rpc_timeout.

        Raises:
            TimeoutError: a thread was still finishing a batch when the time ran out.
        """
        if self._closed:
            return
        self.stop(timeout)
        self._closed = True
        world = get_world()
        if self._elastic and world is not None:
            world.remove_member_callback(self._on_member)
        self._withdraw()
        self._hosting.withdraw()

    def threads(self) -> List[str]:
        """Names of this member's live reducer threads."""
        return [r.thread_name for r in self._reducers() if r.is_alive()]

    def stats(self) -> Dict[str, Any]:
        """Counters of this member's reducers.

        ``secondary``: ``accepted``, ``rejected`` (queue full), ``forwarded``, ``batches``,
        ``dropped`` (at stop), ``queued``, ``state``. ``primary``: ``received``, ``parked``
        (forwards that waited for room), ``steps``, ``applied`` (pushes in those steps),
        ``batches``, ``dropped``, ``queued``, ``state``, ``version``, ``lag_mean`` and
        ``lag_max`` (versions published between the one a gradient was computed on and
        the step applying it), ``since_version`` (seconds since the last published
        version), ``ordered`` (the hosted ordered server's counters).

        In an elastic world also: ``secondary["lost_forwarding"]`` (pushes it could not
        forward because the primary was gone); ``primary["clients"]`` (members whose
        pushes it received), ``primary["dropped_by_client"]`` and
        ``primary["dropped_dead_reducer"]`` (pushes acknowledged by a secondary reducer
        that died, or accepted for a primary incarnation that died, and never applied:
        by client, and in total; read from the world's store), ``refused_forwards``;
        ``members``: ``losses`` and ``rejoins`` seen.
        """
        out: Dict[str, Any] = {}
        if self.secondary is not None:
            out["secondary"] = self.secondary.stats()
        if self.primary is not None:
            primary = self.primary.stats()
            primary["version"] = self._version
            lag = self._lag
            primary["lag_mean"] = lag["sum"] / lag["count"] if lag["count"] else 0.0
            primary["lag_max"] = lag["max"]
            primary["since_version"] = time.monotonic() - self._published_at
            if self.o_server_impl is not None:
                primary["ordered"] = self.o_server_impl.stats()
            if self._ledger is not None:
                primary["clients"] = self._ledger.clients()
                primary["dropped_by_client"] = self._ledger.dropped()
                primary["dropped_dead_reducer"] = sum(primary["dropped_by_client"].values())
                primary["refused_forwards"] = self._ledger.refused
            out["primary"] = primary
        if self._elastic:
            out["members"] = dict(self._events)
        return out
