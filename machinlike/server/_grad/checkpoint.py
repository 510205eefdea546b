"""The gradient server primary's checkpoint: its model, optimizer, lr-scheduler and push
accounting on disk, and a version lease so that a resumed primary never reuses a version.

Why: the primary publishes version v (clients may pull it at once) and only then does
anything else. A primary killed between the two used to come back from an older
checkpoint and publish under a number a client might already hold with other contents;
a client holding it would then never pull (it thinks it is up to date). So every version
is *leased* before it is published (:class:`~machinlike.server._host.HostCheckpoint`:
one small atomic write per ``LEASE_BLOCK`` versions) and a resumed primary publishes
above the lease::

    manage_model, fresh:  checkpoint (version 0) ─► lease 0 ─► publish 0
    each step:            lease v ─► publish v ─► note applied ─► every N versions or
                                                                  T seconds: checkpoint
    manage_model, resume: load checkpoint + lease L ─► parameters, optimizer, scheduler,
                          accounting back ─► lease L + 1 ─► publish the checkpoint's
                          parameters as version L + 1

The first checkpoint is written before version 0 is published, so a primary killed
before its first periodic checkpoint also resumes above every version it showed.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Tuple

import torch

from .._checkpoint import CheckpointError
from .._host import HostCheckpoint
from .._spec import mismatch, spec_of

__all__ = ["PrimaryCheckpoint"]


class PrimaryCheckpoint:
    """Checkpoint file, version lease and cadence of one gradient server's primary.

    Args:
        host: The file, lease and cadence, checked by the server's public entrance (kind
            ``"grad-server"``, named after the server: ``<server_name>.ckpt``).
    """

    def __init__(self, host: HostCheckpoint) -> None:
        self._host = host
        self._state: Optional[Callable[[], Dict[str, Any]]] = None
        self._made = 0  # versions made by this primary since it started (the cadence)

    @property
    def path(self) -> str:
        return self._host.path

    def manage(self, state: Callable[[], Dict[str, Any]]) -> None:
        """Set what a checkpoint holds: ``state()`` returns ``params`` (name -> CPU
        tensor), ``optimizer``, ``lr_scheduler`` (state dicts, None without one),
        ``version`` and ``applied`` (the push accounting)."""
        self._state = state

    def resume(self, params: Dict[str, torch.nn.Parameter], optimizer: Any,
               lr_scheduler: Any) -> Optional[Tuple[Dict[str, Any], int]]:
        """Load the checkpoint into the managed objects.

        Returns:
            None when there is no checkpoint; else the saved state and the version to
            publish it under (leased already, above every version ever published).

        Raises:
            CheckpointError: the files are corrupt, another server's, without a lease, or
                do not fit the managed model or the lr_scheduler argument.
        """
        loaded = self._host.load(newest=lambda saved: saved["version"])
        if loaded is None:
            return None
        state, lease = loaded
        path = self._host.path
        saved = state["params"]
        diff = mismatch(spec_of(saved), spec_of(params), f"checkpoint {path!r}", "the managed model")
        if diff is not None:
            raise CheckpointError(f"checkpoint {path!r} does not fit the managed model: {diff}")
        if (lr_scheduler is None) != (state["lr_scheduler"] is None):
            raise CheckpointError(f"checkpoint {path!r} was written {'with' if state['lr_scheduler'] else 'without'} "
                                  f"an lr_scheduler; manage_model() got "
                                  f"{'one' if lr_scheduler is not None else 'none'}")
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(saved[name])
        optimizer.load_state_dict(state["optimizer"])
        if lr_scheduler is not None:
            lr_scheduler.load_state_dict(state["lr_scheduler"])
        # Every version up to the lease may have been visible before the crash, some with
        # contents this checkpoint does not have: the next number names nothing yet.
        fresh = lease + 1
        self._host.cover(fresh)
        return state, fresh

    def first(self) -> None:
        """A fresh primary: write the initial checkpoint before version 0 is published
        (its ``version`` is then -1: nothing published yet)."""
        self._host.save(0, self._snapshot())

    def cover(self, version: int) -> None:
        """Lease ``version`` before it is published (on the primary's thread only)."""
        self._host.cover(version)

    def made(self) -> None:
        """A version was made: write a checkpoint when one is due.

        Raises:
            OSError: the checkpoint could not be written.
        """
        self._made += 1
        if self._host.due(self._made):
            self._host.save(self._made, self._snapshot())

    def last(self) -> None:
        """Write a checkpoint of every version made, unless it is written already.

        Raises:
            OSError: the checkpoint could not be written.
        """
        self._host.save(self._made, self._snapshot())

    def _snapshot(self) -> Dict[str, Any]:
        if self._state is None:
            raise RuntimeError("PrimaryCheckpoint.manage() must be called before a checkpoint is written")
        return self._state()
