"""The inference host's weights: ``fn`` with the version of its weights, swapped only
between batches, and a thread that pulls new weights from a model server.

    update(state, v) ─────────────────────────┐
    Puller thread: every pull_every s          │  ModelSlot.load: under the slot's lock,
      model_server.pull(private copy)  ── new? ┴─ so never during a batch
    batcher: ModelSlot.run(batch) ── under the lock, no_grad ──► (output, version)

Why a private copy: a pull moves a whole state dict over RPC; into the copy it takes as
long as it takes while batches go on, and only the final ``load_state_dict`` waits for
the running batch.
"""

from __future__ import annotations

import copy
import itertools
import logging
import threading
from typing import Any, Callable, Mapping, Optional, Tuple

import torch

from .batch import Inputs, to_device
from .._spec import unwrap
from .._model_version import get_version
from ..model import PushPullModelServer

__all__ = ["ModelSlot", "Puller", "StaleVersionError"]

log = logging.getLogger(__name__)


class StaleVersionError(ValueError):
    """Weights older than those loaded: versions a server's outputs carry never go back."""


class ModelSlot:
    """``fn`` and the version of its weights; weights change only between batches.

    Args:
        fn: The callable or module run over each batch.
        version: The version of its weights now.
        device: Where batches go before ``fn`` (None: where they are, the CPU).
    """

    def __init__(self, fn: Callable[..., Any], version: int, device: Optional[torch.device]) -> None:
        self.fn = fn
        # Weights load into the module a compiled or wrapped fn runs (names without prefixes).
        self.module: Optional[torch.nn.Module] = unwrap(fn) if isinstance(fn, torch.nn.Module) else None
        self.device = device
        self._lock = threading.Lock()  # a batch, or a weight swap: never both
        self.version = version

    def run(self, batch: Inputs) -> Tuple[Any, int]:
        if self.device is not None:
            batch = to_device(batch, self.device)
            if self.device.type == "cuda":
                # The server's GPU current while fn runs: the batcher and RPC threads start
                # on cuda:0, and fn's own torch.zeros(..., device="cuda") would land there.
                with torch.cuda.device(self.device):
                    return self._run(batch)
        return self._run(batch)

    def _run(self, batch: Inputs) -> Tuple[Any, int]:
        # Grad mode is per thread: set here, fewer Python frames than torch.no_grad's
        # context (a no-op call costs ~80 us on the host, every frame shows).
        with self._lock:
            enabled = torch.is_grad_enabled()
            torch.set_grad_enabled(False)
            try:
                return (self.fn(*batch) if isinstance(batch, tuple) else self.fn(batch)), self.version
            finally:
                torch.set_grad_enabled(enabled)

    def load(self, state: Mapping[str, Any], version: int) -> None:
        """Load ``state`` into ``fn`` (a module) once no batch runs.

        Raises:
            TypeError: ``fn`` is not an ``nn.Module``.
            StaleVersionError: ``version`` is below the version loaded now (nothing is
                loaded): outputs would carry versions that go back.
        """
        module = self.module
        if module is None:
            raise TypeError(f"fn is a {type(self.fn).__name__}, not an nn.Module: it has no weights to load")
        with self._lock:
            # Checked under the lock: an update and a pull racing must not let the older win.
            if version < self.version:
                raise StaleVersionError(f"version {version} is older than version {self.version}, which the "
                                        f"server runs now (nothing was loaded): pass a version of at least "
                                        f"{self.version}")
            # On a GPU the copies run on the loading thread's stream (a caller of update()
            # under a stream of its own), not the batcher's: a batch still queued would read
            # weights half written, and the next one could too. Swaps are rare: wait for both.
            devices = {t.device for t in itertools.chain(module.parameters(), module.buffers()) if t.is_cuda}
            for device in devices:
                torch.cuda.synchronize(device)
            module.load_state_dict(state)
            for device in devices:
                torch.cuda.synchronize(device)
            self.version = version


class Puller:
    """A thread that pulls a model server's newest weights into a private copy of ``fn``
    every ``every`` seconds and hands new ones to the slot (the batcher never waits on it)."""

    def __init__(self, what: str, model_server: PushPullModelServer, slot: ModelSlot, every: float) -> None:
        self._model_server = model_server
        self._slot = slot
        self._every = every
        self._what = what
        if slot.module is None:
            raise TypeError(f"model_server needs fn to be an nn.Module to load weights into, not "
                            f"{type(slot.fn).__name__}")
        self._shadow: torch.nn.Module = copy.deepcopy(slot.module)
        self._stop = threading.Event()
        self.pulls = 0
        self.failures = 0
        self.stale = 0  # pulls older than an update() the user made meanwhile: not loaded
        self._thread = threading.Thread(target=self._loop, name=f"machinlike-infer-pull-{what}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        wait = 0.0  # the first pull at once
        while not self._stop.wait(wait):
            wait = self._every
            try:
                if self._model_server.pull(self._shadow):
                    version = get_version(self._shadow)
                    self._slot.load(self._shadow.state_dict(), -1 if version is None else version)
                    self.pulls += 1
            except StaleVersionError:
                self.stale += 1
            except Exception as exc:  # the server keeps serving the weights it has; say so
                self.failures += 1
                log.warning("inference server %r: pulling from %r failed: %s: %s", self._what,
                            self._model_server, type(exc).__name__, exc)

    def close(self, timeout: float) -> None:
        self._stop.set()
        self._thread.join(timeout)
