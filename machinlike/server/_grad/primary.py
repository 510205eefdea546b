"""ManagedModel: the gradient server primary's model, and the versions it publishes.

Owns the managed model with its parameters, optimizer and lr-scheduler, the version last
published, and the lag counters. Only the primary's reducer thread changes them after
:meth:`ManagedModel.manage` (through :meth:`ManagedModel.apply`), so they need no lock;
``stats`` reads them as they are (a counter one step behind is fine)::

    manage(model, ...)   checkpoint? resume: publish its parameters above the lease
                         else: publish version 0 (or continue a custom server's chain)
    apply(item)          (the primary's thread) .grad = sum (/ count for "mean"; a sparse
                         one made dense for an optimizer that cannot step on it),
                         optimizer.step(), lr_scheduler.step(), lag, publish v + 1,
                         note the pushes applied (elastic), checkpoint when due
    publish(v)           lease v (checkpoint) ─► snapshot to CPU ─► the ordered server:
                         the hosted one stores it directly, another one gets a push

A hosted chain's snapshots go through its ``StatePool``: each large parameter is copied
into shared memory the pool reuses once no version, reply or puller holds it, so a step
makes no fresh memory and the same-host pulls read the version in place (their
``load_whole`` loads again a version rewritten under them).

Why apart from ``grad``: the server's entrance wires roles, services and life cycle; the
maths of a step and the version chain are one concept with its own state, and the
checkpoint's ordering rules (see ``_grad.checkpoint``) live next to the only code that
publishes.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, Optional

import torch

from .._churn import Ledger
from .._state_pool import StatePool
from .checkpoint import PrimaryCheckpoint
from .items import Item, takes_sparse
from .._spec import Spec, spec_of
from ..ordered import OrderedServerBase, OrderedServerSimpleImpl

__all__ = ["ManagedModel"]

log = logging.getLogger(__name__)


class ManagedModel:
    """The primary's model, optimizer, scheduler and version chain.

    Args:
        server_name: The gradient server's name (for messages).
        model_name: Key of the published parameters in the ordered server.
        reduce_method: ``"sum"`` or ``"mean"`` (checked).
        o_server: The ordered server to publish to (an accessor).
        hosted: The ordered server this primary hosts (``o_server``'s implementation,
            stored into directly); None when ``o_server`` is another one.
        pool: The memory of the hosted chain's versions (its owner closes it); None: each
            version is fresh memory (always so without ``hosted``).
        checkpoint: The primary's checkpoint; None: no checkpoints.
        ledger: The push accounting of an elastic world; None: not counted.

    Attributes:
        model, optimizer, lr_scheduler: What :meth:`manage` was given (None before).
        spec: The parameters' names, shapes and dtypes (None before :meth:`manage`).
        version: The version published last; -1 before the first.
    """

    def __init__(self, server_name: str, model_name: str, reduce_method: str, o_server: OrderedServerBase,
                 hosted: Optional[OrderedServerSimpleImpl], checkpoint: Optional[PrimaryCheckpoint],
                 ledger: Optional[Ledger], pool: Optional[StatePool] = None) -> None:
        self._server_name = server_name
        self._model_name = model_name
        self._reduce_method = reduce_method
        self._o_server = o_server
        self._hosted = hosted
        self._pool = pool if hosted is not None else None  # (a pushed version is another host's copy)
        self._checkpoint = checkpoint
        self._ledger = ledger
        self.model: Optional[torch.nn.Module] = None
        self._params: Dict[str, torch.nn.Parameter] = {}
        self.spec: Optional[Spec] = None
        self.optimizer: Any = None
        self.lr_scheduler: Any = None
        self.version = -1  # nothing published yet
        self.resumed_version: Optional[int] = None  # the version a resume published its checkpoint as
        self._lag = {"sum": 0, "count": 0, "max": 0}
        self._published_at = time.monotonic()
        # Held through a step: a checkpoint asked for from another thread (checkpoint_now)
        # reads the model, optimizer and accounting between two steps, never inside one.
        self._stepping = threading.Lock()
        self._managed = False  # manage() is over: its model resumed or published

    def manage(self, model: torch.nn.Module, params: Dict[str, torch.nn.Parameter], optimizer: Any,
               lr_scheduler: Any) -> None:
        """Take the model (checked by the caller; ``params`` its named parameters, not
        empty) and publish it: resumed from the checkpoint, or as version 0."""
        with self._stepping:  # (a checkpoint asked for meanwhile waits for the resume, or version 0)
            self.model, self._params, self.spec = model, params, spec_of(params)
            self.optimizer, self.lr_scheduler = optimizer, lr_scheduler
            if self._checkpoint is not None:
                self._checkpoint.manage(self._checkpoint_state)
            if not self._resume():
                self._publish_first()
            self._managed = True

    # ------------------------------------------------------------ checkpoints
    def last_checkpoint(self) -> None:
        """With the primary stopped: write a checkpoint of the versions made since the last
        one (a job restarted from it loses none of them); nothing without checkpoints.

        Raises:
            OSError: the checkpoint could not be written.
        """
        if self._checkpoint is not None and self.model is not None:
            self._checkpoint.last()

    @property
    def checkpoint_path(self) -> Optional[str]:
        """The primary's checkpoint file; None without ``checkpoint_dir``."""
        return None if self._checkpoint is None else self._checkpoint.path

    def checkpoint_now(self, timeout: float) -> str:
        """From any thread: write a checkpoint of the newest version between two steps.

        Args:
            timeout: Seconds to wait for the step in progress to end (> 0).

        Returns:
            The checkpoint file's path.

        Raises:
            RuntimeError: no checkpoint_dir, or no model managed yet.
            TimeoutError: the step in progress (or manage_model) did not end within ``timeout``.
            OSError: the checkpoint could not be written.

        Not from a signal handler of a thread inside ``manage_model``: set an event there and
        call this from a loop.
        """
        if self._checkpoint is None:
            raise RuntimeError(f"gradient server {self._server_name!r} keeps no checkpoint: create it with "
                               f"checkpoint_dir=<a directory> (grad_server_helper too) to write one")
        if self.model is None:
            raise RuntimeError(f"gradient server {self._server_name!r} has no model yet: call manage_model() first")
        if not self._stepping.acquire(timeout=timeout):
            raise TimeoutError(f"gradient server {self._server_name!r}: the primary's step did not end within "
                               f"{timeout:g} s, so no checkpoint was written; pass a longer timeout")
        try:  # (the primary waits at its next step while the file is written)
            if not self._managed:  # (manage() failed: what is managed is not what the file holds)
                raise RuntimeError(f"gradient server {self._server_name!r}: manage_model() did not finish; no "
                                   f"checkpoint was written")
            self._checkpoint.last()
        finally:
            self._stepping.release()
        return self._checkpoint.path

    def _resume(self) -> bool:
        """Load the checkpoint, if any, and publish it under a never-used version."""
        if self._checkpoint is None:
            return False
        loaded = self._checkpoint.resume(self._params, self.optimizer, self.lr_scheduler)
        if loaded is None:
            return False
        state, resume = loaded
        if self._ledger is not None:
            self._ledger.restore(state["applied"])
        snapshot = self._version_state()
        if self._hosted is not None:
            stored = self._hosted.store(self._model_name, snapshot, resume, None)
        else:
            got = self._o_server.pull(self._model_name)
            stored = self._o_server.push(self._model_name, snapshot, resume, None if got is None else got[1])
        if not stored:
            raise RuntimeError(f"the ordered server refused resumed version {resume} of {self._model_name!r}")
        self.version = self.resumed_version = resume
        self._published_at = time.monotonic()
        log.warning("gradient server %r: primary resumed from %r (checkpoint version %d) as version %d",
                    self._server_name, self._checkpoint.path, state["version"], resume)
        return True

    def _checkpoint_state(self) -> Dict[str, Any]:
        scheduler = self.lr_scheduler.state_dict() if self.lr_scheduler is not None else None
        return {"params": self._snapshot(), "optimizer": self.optimizer.state_dict(), "lr_scheduler": scheduler,
                "version": self.version, "applied": self._ledger.state() if self._ledger is not None else {}}

    def _snapshot(self) -> Dict[str, torch.Tensor]:
        """The parameters' values in fresh CPU memory (a checkpoint's)."""
        return {name: p.detach().to("cpu", copy=True) for name, p in self._params.items()}

    def _version_state(self) -> Dict[str, torch.Tensor]:
        """The parameters' values as a version to publish (see the module doc)."""
        if self._pool is None:
            return self._snapshot()
        return self._pool.snapshot(self._model_name, self._params)

    # ------------------------------------------------------------- publishing
    def _publish_first(self) -> None:
        if self._checkpoint is not None:  # on disk before anything is visible (see _grad_checkpoint)
            self._checkpoint.first()
            self._checkpoint.cover(0)
        snapshot = self._version_state()
        if self._hosted is not None:
            stored = self._hosted.store(self._model_name, snapshot, 0, None)
        else:
            stored = self._o_server.push(self._model_name, snapshot, 0, None)
        if stored:
            # (a host restarted without a checkpoint stores it above its predecessors'
            # versions: _store_lease)
            self.version = self._hosted.newest_version(self._model_name) if self._hosted is not None else 0
            self._published_at = time.monotonic()
            return
        # A custom ordered server that already holds a chain under this key: continue it.
        got = self._o_server.pull(self._model_name)
        if got is None or not isinstance(got[1], int):
            raise RuntimeError(f"the ordered server refused version 0 of {self._model_name!r} and holds no "
                               f"integer version to continue from")
        self.version = got[1]
        self._publish(self.version + 1)

    def _publish(self, version: int) -> None:
        if self._checkpoint is not None:
            self._checkpoint.cover(version)  # leased before visible: a resume goes above it
        snapshot = self._version_state()
        if self._hosted is not None:
            stored = self._hosted.store(self._model_name, snapshot, version, self.version)
        else:
            stored = self._o_server.push(self._model_name, snapshot, version, self.version)
        if not stored:
            raise RuntimeError(f"the ordered server refused version {version} of {self._model_name!r}: something "
                               f"else pushes to that key")
        self.version = version
        self._published_at = time.monotonic()

    # ------------------------------------------------------------------- a step
    def apply(self, item: Item) -> None:
        """Step the model with a reduced item and publish the next version.

        Runs on the primary's reducer thread only.
        """
        with self._stepping:
            self._step(item)

    def _step(self, item: Item) -> None:
        with torch.no_grad():
            for name, param in self._params.items():
                grad = item.grads.get(name)
                if grad is None:  # no push of the batch had one: the optimizer skips it, as locally
                    param.grad = None
                    continue
                if self._reduce_method == "mean":
                    grad.div_(item.count)  # the sum belongs to us: divide it in place, once
                if grad.layout != torch.strided and not takes_sparse(self.optimizer):
                    grad = grad.to_dense()
                param.grad = grad.to(device=param.device, dtype=param.dtype)
        self.optimizer.step()
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        for version in item.versions:
            if version >= 0:
                lag = self.version - version
                self._lag["sum"] += lag
                self._lag["count"] += 1
                self._lag["max"] = max(self._lag["max"], lag)
        self._publish(self.version + 1)
        if self._ledger is not None and item.origin is not None:
            self._ledger.applied(item.origin)
        if self._checkpoint is not None:
            self._checkpoint.made()

    def stats(self) -> Dict[str, Any]:
        """``version``, ``lag_mean``, ``lag_max``, ``since_version`` (seconds) and
        ``resumed_version`` (None: this primary did not resume from a checkpoint)."""
        lag = self._lag
        return {"version": self.version, "lag_mean": lag["sum"] / lag["count"] if lag["count"] else 0.0,
                "lag_max": lag["max"], "since_version": time.monotonic() - self._published_at,
                "resumed_version": self.resumed_version}

