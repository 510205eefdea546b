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

Dtypes and devices. A client's model may differ from the managed one in dtype and
device; names and shapes must match. ``push`` casts the gradients to the managed
parameters' dtypes at the client (a float64 actor of a float32 learner sends float32) and
sends them through the CPU; the primary moves them to each parameter's device when it
applies them. ``pull`` casts the published values to the client's parameters' dtypes and
devices, as ``load_state_dict`` does. Any floating dtype casts to any other (rounding to
the narrower one), and real to complex; the casts that would lose meaning are refused
with ``ValueError`` before anything is sent or loaded: complex to real (the imaginary
part), floating or complex to an integer or bool dtype (truncation).

Back-pressure. A secondary holds at most ``max_queue_size`` pushes. A push made the machin
way (``push(model)``: push, then pull) that finds the queue full waits for room, bounded
by the accessor's timeout; a fast-path push (``push(model, pull=False)``) is refused
instead (it returns False, nothing of it is applied) and counted as ``rejected`` in
:meth:`PushPullGradServerImpl.stats`. The primary never drops: a partial
sum that finds its queue full waits (the forwarding secondary pauses, its queue fills,
clients get False). ``stop()`` drops what is still queued and counts it as ``dropped``;
call the accessor's :meth:`PushPullGradServer.flush` first to apply everything.

Parts. :class:`PushPullGradServerImpl` is the entrance: it checks its arguments once and
wires one member's parts, each owning its state: the reducers' state machine
(``_grad.reducer``, summing with ``_grad.items``), a secondary's link to the primary
(``_grad.forward``), the primary's model and version chain (``_grad.primary``, with its
checkpoint in ``_grad.checkpoint``), and the services the member registers
(``_grad.services``). The accessor clients use is ``_grad.accessor``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Optional, Sequence

import torch

from ..distributed import MemberEvent, RpcGroup, get_world
from ._checkpoint import CheckpointError
from ._churn import Admission, Ledger
from ._common import ServerNote, check_group, check_timeout, publish_notes, rpc_timeout
from ._grad import PushPullGradServer
from ._grad import PrimaryCheckpoint
from ._grad import Forwarder
from ._grad import ManagedModel
from ._grad import ReducerServices
from ._grad import GradSettings, grad_settings
from ._host import host_checkpoint
from ._grad import Hosting, check_not_hosted
from ._errors import MissingGradientError, ServerStoppedError
from ._grad import PrimaryReducer, SecondaryReducer
from ._spec import check_module, unwrap
from ._state_pool import StatePool
from .ordered import OrderedServerBase, OrderedServerSimple, OrderedServerSimpleImpl

__all__ = ["PushPullGradServer", "PushPullGradServerImpl", "ServerStoppedError", "MissingGradientError",
           "CheckpointError"]

log = logging.getLogger(__name__)


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
        host = host_checkpoint(settings.checkpoint_dir, "grad-server", server_name, settings.checkpoint_every,
                               settings.checkpoint_interval)
        checkpoint = None if host is None else PrimaryCheckpoint(host)
        self.member = group.get_cur_name()
        if self.member != self.primary_reducer and self.member not in self.secondary_reducers:
            raise ValueError(f"member {self.member!r} is neither the primary reducer ({self.primary_reducer!r}) nor "
                             f"a secondary one ({self.secondary_reducers}): construct PushPullGradServerImpl only "
                             f"on reducers; clients use the PushPullGradServer accessor")
        check_not_hosted(group, server_name)
        # The World's setting, read once: the reducer threads wait with it, even while
        # the World is stopping.
        self._rpc_timeout = rpc_timeout()
        # The primary's (None: the default one it hosts, built below).
        o_server: OrderedServerBase = (OrderedServerSimple._checked(f"{server_name}/ordered", group)
                                       if settings.o_server is None else settings.o_server)

        self._closed = False
        self.o_server_impl: Optional[OrderedServerSimpleImpl] = None
        self._pool: Optional[StatePool] = None  # the hosted chain's memory (see _grad.primary)
        args = (server_name, self.member, settings.batch, settings.max_queue, self.reduce_device)
        self.secondary: Optional[SecondaryReducer] = None
        self.primary: Optional[PrimaryReducer] = None
        self._managed: Optional[ManagedModel] = None
        self._services: Optional[ReducerServices] = None
        world = get_world()
        # Elastic worlds: pushes are counted in the store so that what dies with a
        # secondary is reported (see _churn); secondaries are whoever hosts one, now or later.
        self._elastic = world is not None and world.elastic
        self._dynamic = self._elastic and settings.discover
        self._admission = self._ledger = None
        self._events = {"losses": 0, "rejoins": 0}
        if self.member in self.secondary_reducers and self._elastic:
            self._admission = Admission(world, group.get_group_name(), server_name, self.primary_reducer)
        if self.member == self.primary_reducer and self._elastic:
            self._ledger = Ledger(world, group.get_group_name(), server_name)
        try:
            if self.member == self.primary_reducer:
                # The hosted ordered server first: the managed model publishes into it.
                if settings.o_server is None:
                    self.o_server_impl = OrderedServerSimpleImpl._checked(f"{server_name}/ordered", group, 1,
                                                                          lease_in_store=checkpoint is None)
                    self._pool = StatePool()
                managed = self._managed = ManagedModel(server_name, self.model_name, self.reduce_method, o_server,
                                                       self.o_server_impl, checkpoint, self._ledger, self._pool)
                self.primary = PrimaryReducer(*args, apply=managed.apply, version=lambda: managed.version,
                                              receive=None if self._ledger is None else self._ledger.receive)
            if self.member in self.secondary_reducers:
                forward = Forwarder(group, server_name, self.member, self.primary_reducer,
                                    None if self.primary is None else self.primary.accept, self._rpc_timeout,
                                    elastic=self._admission is not None)
                self.secondary = SecondaryReducer(*args, forward=forward,
                                                  admit=None if self._admission is None else self._admission.admit)
            self._services = ReducerServices(group, server_name, self.member, self.primary_reducer, self.primary,
                                             self._managed, self.secondary, owner=self)
            self._services.publish(None if self.primary is None else PushPullGradServer._checked(
                server_name, group, self.model_name, None if self._dynamic else self.secondary_reducers,
                o_server, None))
            self._hosting = Hosting(group, server_name, self.secondary)
        except BaseException:
            self._withdraw()
            raise
        self.o_server = o_server
        if world is not None and self._elastic:
            world.on_member_change(self._on_member)
        self._unnote = publish_notes(self._notes)  # (withdrawn at close)

    def _on_member(self, event: MemberEvent) -> None:
        # On the liveness thread: count and log only.
        if event.member == self.member:
            return
        if event.kind == "lost":
            self._events["losses"] += 1
            log.info("gradient server %r on %r: member %r (incarnation %d) was lost", self.server_name,
                     self.member, event.member, event.incarnation)
        elif event.kind == "join" and event.incarnation > 1:
            self._events["rejoins"] += 1
            log.info("gradient server %r on %r: member %r rejoined (incarnation %d)", self.server_name,
                     self.member, event.member, event.incarnation)

    def __repr__(self) -> str:
        roles = [r for r, x in (("primary", self.primary), ("secondary", self.secondary)) if x is not None]
        return f"<PushPullGradServerImpl {self.server_name!r} on {self.member!r} ({'+'.join(roles)})>"

    def _withdraw(self) -> None:
        if self._services is not None:
            self._services.withdraw()
        if self.o_server_impl is not None:
            self.o_server_impl.close()
        if self._pool is not None:
            self._pool.close()

    # ------------------------------------------------------------ the primary
    def manage_model(self, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any = None) -> None:
        """Hand the primary the model it optimises; publishes its parameters as version 0.

        The model stays on its device and dtype (gradients are cast and moved to them:
        see the module's "Dtypes and devices"). Do not use it
        elsewhere once :meth:`start` ran: the primary's thread steps it.

        Args:
            model: The managed model.
            optimizer: Anything with ``step()`` over the model's parameters.
            lr_scheduler: Anything with ``step()``, stepped after every optimizer step.

        Raises:
            RuntimeError: this member is not the primary reducer, or a model is managed already.
            TypeError: bad arguments.
        """
        managed = self._managed  # built with the primary (see _open)
        if managed is None:
            raise RuntimeError(f"manage_model() must be called on the primary reducer {self.primary_reducer!r}, "
                               f"not on member {self.member!r}")
        if managed.model is not None:
            raise RuntimeError(f"gradient server {self.server_name!r} already manages a model")
        check_module(model)
        if not callable(getattr(optimizer, "step", None)):
            raise TypeError(f"optimizer must have a step() method, not {type(optimizer).__name__}")
        if lr_scheduler is not None and not callable(getattr(lr_scheduler, "step", None)):
            raise TypeError(f"lr_scheduler must have a step() method or be None, not {type(lr_scheduler).__name__}")
        params = dict(unwrap(model).named_parameters())
        if not params:
            raise ValueError("the managed model has no parameters")
        managed.manage(model, params, optimizer, lr_scheduler)

    @property
    def checkpoint_path(self) -> Optional[str]:
        """The primary's checkpoint file, on the primary with ``checkpoint_dir``; else None."""
        return None if self._managed is None else self._managed.checkpoint_path

    def checkpoint(self, timeout: Optional[float] = None) -> str:
        """Write the primary's checkpoint now, e.g. when the job is told to stop (SIGTERM).

        Holds the newest version's parameters, optimizer, lr-scheduler and accounting;
        the primary's next step waits while it is written. Nothing is rewritten when the
        file holds that version already. Call it from the program's loop (a SIGTERM handler
        sets an event), as ``examples/param_server.py`` does.

        Args:
            timeout: Seconds to wait for the step in progress; None: the world's rpc_timeout.

        Returns:
            The checkpoint file's path.

        Raises:
            RuntimeError: not the primary reducer, no ``checkpoint_dir``, no model managed
                yet, or closed.
            TimeoutError: the step in progress did not end within ``timeout``.
            OSError: the file could not be written.
        """
        wait = check_timeout(timeout) or self._rpc_timeout
        if self._managed is None:
            raise RuntimeError(f"checkpoint() must be called on the primary reducer {self.primary_reducer!r}, "
                               f"not on member {self.member!r}")
        if self._closed:
            raise RuntimeError(f"gradient server {self.server_name!r} is closed (it wrote its last checkpoint then)")
        return self._managed.checkpoint_now(wait)

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
        if self._managed is not None and self._managed.model is None:
            raise RuntimeError("call manage_model(model, optimizer) on the primary reducer before start()")
        for reducer in self._reducers():
            reducer.start()

    def stop(self, timeout: Optional[float] = None) -> None:
        """Stop this member's reducers; what they still hold is dropped (counted, logged).
        With ``checkpoint_dir``, the primary then writes a checkpoint of every version made.

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
        if "primary" in roles and self._managed is not None:
            try:  # (the primary's thread has ended: its model and optimizer hold still)
                self._managed.last_checkpoint()
            except OSError as err:  # the versions are served already: say so, as a periodic one does
                log.error("gradient server %r could not write its last checkpoint: %s", self.server_name, err)

    def watch(self) -> None:
        """Re-raise the exception that ended a reducer thread of this member, if any: the
        primary's first, for a secondary beside it fails after it, saying only that it did
        (cold trial 29: the optimizer's own exception never came out)."""
        for reducer in reversed(self._reducers()):
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
        self._unnote()
        self._withdraw()
        self._hosting.withdraw()

    def _notes(self) -> List[ServerNote]:
        """This member's numbers for the status view: the reducers' own counters (unlike
        :meth:`stats`, no store request)."""
        group, out = self.group.get_group_name(), []
        if self.primary is not None:
            p = self.primary.stats()
            m = self._managed.stats() if self._managed is not None else {}
            version = m.get("version")
            out.append(ServerNote("grad", self.server_name, group, "primary",
                                  version=version if version is not None and version >= 0 else None,
                                  accepted=p["received"], applied=p["applied"], dropped=p["dropped"],
                                  queued=p["queued"], lag_mean=m.get("lag_mean"), lag_max=m.get("lag_max"),
                                  since=m.get("since_version")))
        if self.secondary is not None:
            s = self.secondary.stats()
            out.append(ServerNote("grad", self.server_name, group, "secondary", accepted=s["accepted"],
                                  refused=s["rejected"], dropped=s["dropped"], queued=s["queued"]))
        return out

    def threads(self) -> List[str]:
        """Names of this member's live reducer threads."""
        return [r.thread_name for r in self._reducers() if r.is_alive()]

    def stats(self) -> Dict[str, Any]:
        """Counters of this member's reducers.

        ``secondary``: ``accepted``, ``rejected`` (queue full), ``forwarded`` (sent on to
        the primary), ``lost_forwarding`` (pushes it took that never reached the primary:
        it was gone, stopped or lost; sent first or not), ``batches``, ``dropped`` (at
        stop), ``queued``, ``state``. ``primary``: ``received``, ``parked``
        (forwards that waited for room), ``steps``, ``applied`` (pushes in those steps),
        ``batches``, ``dropped``, ``queued``, ``state``, ``version``, ``lag_mean`` and
        ``lag_max`` (versions published between the one a gradient was computed on and
        the step applying it), ``since_version`` (seconds since the last published
        version), ``resumed_version`` (the version a primary resumed from its checkpoint
        published first; None: it started afresh; its ``steps`` and ``applied`` count from
        there), ``ordered`` (the hosted ordered server's counters).

        In an elastic world also: ``primary["clients"]`` (members whose
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
            if self._managed is not None:
                primary.update(self._managed.stats())
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
