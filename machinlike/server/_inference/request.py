"""Request: one caller's rows while they wait for a batch (see ``batcher``)."""

from __future__ import annotations

import time
from typing import Any, Callable, Hashable, Optional

import torch

from .batch import Inputs

__all__ = ["Request"]


class Request:
    """One caller's rows, waiting for a batch.

    Args:
        x: The rows (a tensor or a tuple of tensors).
        rows: Their count.
        fut: Completed with ``(output rows, version)`` or fn's exception.
        caller: The caller's member name, and its incarnation (a restarted caller is
            another process: the old one's requests are dropped).
        timeout: Seconds from now after which the caller stops waiting.
        reply: Turns the result into what travels back (same-host encoding); None: as it is.

    ``sig`` (see ``_inference.batch.signature``) is filled in when the request is queued:
    one run at once on an idle server's RPC thread never needs it.
    """

    __slots__ = ("x", "rows", "sig", "fut", "caller", "incarnation", "arrived", "deadline", "reply")

    def __init__(self, x: Optional[Inputs], rows: int, fut: torch.futures.Future, caller: str,
                 incarnation: int, timeout: float, reply: Optional[Callable[[Any], Any]]) -> None:
        self.x, self.rows, self.fut = x, rows, fut
        self.sig: Hashable = None
        self.caller, self.incarnation = caller, incarnation
        self.arrived = time.monotonic()
        self.deadline = self.arrived + timeout
        self.reply = reply
