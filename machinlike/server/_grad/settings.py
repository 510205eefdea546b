"""A gradient server's construction arguments, checked once at its public entrance.

:class:`~machinlike.server.PushPullGradServerImpl` and
:func:`~machinlike.server.grad_server_helper` both check through :func:`grad_settings`
and hand the resulting :class:`GradSettings` inward; nothing past them checks again::

    PushPullGradServerImpl(...)  ─┐
                                  ├─► grad_settings(...) ─► GradSettings ─► Impl._open
    grad_server_helper(...)  ─────┘    (one per helper call, renamed per model)
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional

import torch

from ..._checks import local_device
from ...distributed import RpcGroup
from .._checkpoint import check_checkpoint_dir
from .._common import check_count, check_members, check_name, check_timeout
from ..ordered import OrderedServerBase

__all__ = ["GradSettings", "grad_settings"]


class GradSettings(NamedTuple):
    """A gradient server's arguments once checked (see :class:`PushPullGradServerImpl`)."""

    server_name: str
    group: RpcGroup
    model_name: str
    primary: str
    secondaries: List[str]
    discover: bool  # secondary_reducers was None: in an elastic world, whoever hosts one
    reduce_method: str
    reduce_device: torch.device
    batch: int
    max_queue: int
    o_server: Optional[OrderedServerBase]
    checkpoint_dir: Any  # None: no checkpoints
    checkpoint_every: int
    checkpoint_interval: Optional[float]


def grad_settings(server_name: Any, group: RpcGroup, model_name: Any = "model", primary_reducer: Any = None,
                  secondary_reducers: Any = None, o_server: Any = None, reduce_method: Any = "sum",
                  reduce_device: Any = "cpu", reduce_batch_size: Any = 4, max_queue_size: Any = 64,
                  checkpoint_dir: Any = None, checkpoint_every: Any = 100,
                  checkpoint_interval: Any = None) -> GradSettings:
    """Check a gradient server's arguments; ``group`` is the caller's, checked already.

    Raises:
        TypeError, ValueError: an invalid argument (named, with the fix).
    """
    check_name(server_name, "server_name")
    check_name(model_name, "model_name")
    members = group.get_group_members()
    primary = members[0] if primary_reducer is None else primary_reducer
    if primary not in members:
        raise ValueError(f"primary_reducer={primary_reducer!r} is not a member of group "
                         f"{group.get_group_name()!r} ({members})")
    secondaries = check_members(group, secondary_reducers, "secondary_reducers")
    if reduce_method not in ("sum", "mean"):
        raise ValueError(f"reduce_method={reduce_method!r} must be 'sum' or 'mean'")
    device = local_device("reduce_device", reduce_device)
    batch = check_count(reduce_batch_size, "reduce_batch_size", 1)
    limit = check_count(max_queue_size, "max_queue_size", 1)
    if limit < batch:
        raise ValueError(f"max_queue_size={limit} must be at least reduce_batch_size={batch}, or no batch "
                         f"could ever fill")
    if o_server is not None and not isinstance(o_server, OrderedServerBase):
        raise TypeError(f"o_server must be an OrderedServerBase accessor or None, not {type(o_server).__name__}")
    every = check_count(checkpoint_every, "checkpoint_every", 1)  # named even without a directory
    interval = check_timeout(checkpoint_interval, "checkpoint_interval")
    if checkpoint_dir is not None:
        checkpoint_dir = check_checkpoint_dir(checkpoint_dir)
    return GradSettings(server_name, group, model_name, primary, secondaries, secondary_reducers is None,
                        reduce_method, device, batch, limit, o_server, checkpoint_dir, every, interval)
