"""ReducerServices: what one reducer member of a gradient server serves in its RpcGroup.

Owns the keys it registered and whether it paired the accessor, so that withdrawing
takes back exactly what was published, after a full start or a failed one::

    secondary   <server>/_push/<member>        SecondaryReducer.accept (fast path)
                <server>/_push_wait/<member>   SecondaryReducer.offer (waits for room)
                <server>/_flush/<member>       SecondaryReducer.flush
    primary     <server>/_reduce               PrimaryReducer.accept (a partial sum)
                <server>/_flush                PrimaryReducer.flush
                <server>/_spec                 ManagedModel.spec (clients check their model)
                pair <server>                  the PushPullGradServer accessor

Why apart from ``grad``: the server's RPC surface (names, entry points, what each role
answers) is one concept; the entrance in ``grad`` wires the roles and their life cycle.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

import torch
from torch.distributed import rpc

from ...distributed import RpcGroup
from .accessor import PushPullGradServer
from .items import Item
from .primary import ManagedModel
from .reducer import PrimaryReducer, SecondaryReducer
from .._spec import Spec

__all__ = ["ReducerServices"]


class ReducerServices:
    """The services of one member's reducers (either role, or both).

    Args:
        group: The server's group.
        server_name: The gradient server's name.
        member: This member's name.
        primary_name: The primary reducer's member name (for messages).
        primary: This member's primary reducer; None when it is not the primary.
        managed: The primary's managed model (with ``primary``).
        secondary: This member's secondary reducer; None when it is not one.
        owner: Kept alive while the services are registered: machin's way of building
            the server drops the member's ``PushPullGradServerImpl``, whose share must
            still serve (the group's table holds these services, and so the owner).
    """

    def __init__(self, group: RpcGroup, server_name: str, member: str, primary_name: str,
                 primary: Optional[PrimaryReducer], managed: Optional[ManagedModel],
                 secondary: Optional[SecondaryReducer], owner: object) -> None:
        self._owner = owner
        self._group = group
        self._server_name = server_name
        self._member = member
        self._primary_name = primary_name
        self._primary = primary
        self._managed = managed
        self._secondary = secondary
        self._keys: List[str] = []
        self._paired = False

    def publish(self, accessor: Optional[PushPullGradServer]) -> None:
        """Register this member's services; the primary pairs ``accessor`` under the server's name.

        Raises:
            KeyError: a name is taken in the group (what was registered stays listed:
                :meth:`withdraw` takes it back).
        """
        name = self._server_name
        if self._secondary is not None:
            self._register(f"{name}/_push/{self._member}", self._secondary.accept)
            self._register(f"{name}/_push_wait/{self._member}", self._push_wait_service)
            self._register(f"{name}/_flush/{self._member}", self._flush_secondary_service)
        if self._primary is not None:
            self._register(f"{name}/_reduce", self._reduce_service)
            self._register(f"{name}/_flush", self._flush_primary_service)
            self._register(f"{name}/_spec", self._spec_service)
            if accessor is not None:
                self._group.pair(name, accessor)
                self._paired = True

    def withdraw(self) -> None:
        """Deregister every service and unpair the accessor; safe to call twice."""
        for key in self._keys:
            self._group.deregister(key)
        self._keys = []
        if self._paired:
            self._group.unpair(self._server_name)
            self._paired = False
        self._owner = None  # nothing serves any more: the owner may go

    def _register(self, key: str, service: Callable[..., Any]) -> None:
        self._group.register(key, service)
        self._keys.append(key)

    # ------------------------------------------------------------- the services
    # Registered only on a member with that role (see publish).
    def _the_primary(self) -> PrimaryReducer:
        if self._primary is None:
            raise RuntimeError(f"member {self._member!r} hosts no primary reducer of {self._server_name!r}")
        return self._primary

    def _the_secondary(self) -> SecondaryReducer:
        if self._secondary is None:
            raise RuntimeError(f"member {self._member!r} hosts no secondary reducer of {self._server_name!r}")
        return self._secondary

    @rpc.functions.async_execution
    def _reduce_service(self, grads: Dict[str, torch.Tensor], count: int, versions: List[int],
                        origin: Optional[Dict[Any, int]] = None) -> torch.futures.Future:
        return self._the_primary().accept(Item(grads, count, versions, origin))

    @rpc.functions.async_execution
    def _push_wait_service(self, grads: Dict[str, torch.Tensor], version: int,
                           client: str = "") -> torch.futures.Future:
        return self._the_secondary().offer(grads, version, client)

    @rpc.functions.async_execution
    def _flush_secondary_service(self) -> torch.futures.Future:
        return self._the_secondary().flush()

    @rpc.functions.async_execution
    def _flush_primary_service(self) -> torch.futures.Future:
        return self._the_primary().flush()

    def _spec_service(self) -> Spec:
        spec = None if self._managed is None else self._managed.spec
        if spec is None:
            raise RuntimeError(f"gradient server {self._server_name!r} has no model yet: call manage_model() on "
                               f"the primary reducer {self._primary_name!r}")
        return spec
