"""A lease of the CUDA export area: one slab (or a pinned slab's reader row) lent to one
message (``cuda_ipc_area`` has the control page it lives in)."""

from __future__ import annotations

from typing import Protocol

from .cuda_ipc_slab import Slab

__all__ = ["Lender", "Lease"]


class Lender(Protocol):
    """What a lease asks of the area that lent it (``cuda_ipc_area.ExportArea``)."""

    def holds(self, lease: "Lease") -> bool: ...

    def release(self, *leases: "Lease") -> None: ...

    def release_unsent(self, lease: "Lease") -> None: ...


class Lease:
    """A slab of ``area`` lent to one message, through ``row`` of the control page: the
    slab's own row (lent alone), or a reader row (a pinned slab, read in place). It ends
    in the area that lent it (lease ids are that area's: a World restarted in this process
    has another). ``give_up``: when it is abandoned if still untaken (``time.monotonic()``
    s, a reply's: ``cuda_ipc_claim``); 0: never."""

    __slots__ = ("area", "slab", "ident", "row", "give_up")

    def __init__(self, area: Lender, slab: Slab, ident: int, row: int = -1, give_up: float = 0.0) -> None:
        self.area = area
        self.slab = slab
        self.ident = ident
        self.row = slab.slot if row < 0 else row
        self.give_up = give_up
