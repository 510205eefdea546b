"""An RRef to a paired value whose owner restarted its RPC agent.

torch binds a process's RRef bookkeeping to its first RPC agent for good. A member that
renewed its agent (its listener closed, see ``_listener``) can no longer make RRefs that
name its new agent, nor take an RRef in as an argument. ``get_paired`` then has the caller
make the RRef (``rpc.remote``), and wraps it so that method calls on the value go to the
owner as plain calls by value name instead of carrying the RRef along::

    caller                                     owner (renewed)
    get_paired ──── _paired_rref ────────────► "stale"
               ──── rpc.remote(_paired_value) ► the value (kept by the RRef)
    ref.to_here()                              (torch's RRef fetch)
    ref.rpc_sync().m(x) ── _paired_method ───► value.m(x)
"""

from __future__ import annotations

from typing import Any, Callable

from torch.distributed import rpc

from . import _calls

__all__ = ["RenewedOwnerRRef"]

# torch's "no timeout given": the agent's default applies.
_UNSET = -1.0


class _Proxy:
    def __init__(self, worker: str, sid: str, how: Callable[..., Any], timeout: float) -> None:
        self._worker, self._sid, self._how, self._timeout = worker, sid, how, timeout

    def __getattr__(self, name: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return self._how(self._worker, _calls._paired_method, args=(self._sid, name, args, kwargs),
                             timeout=self._timeout)
        return call


class RenewedOwnerRRef:
    """Behaves as the ``rpc.RRef`` it wraps; ``rpc_sync()``/``rpc_async()``/``remote()``
    proxies call the value's methods by its paired name.

    Args:
        rref: The caller-made RRef to the value.
        worker: The owner's RPC worker.
        sid: The value's service id (``group/epoch/key``).
    """

    def __init__(self, rref: rpc.RRef, worker: str, sid: str) -> None:
        self._rref, self._worker, self._sid = rref, worker, sid

    def rpc_sync(self, timeout: float = _UNSET) -> _Proxy:
        return _Proxy(self._worker, self._sid, rpc.rpc_sync, timeout)

    def rpc_async(self, timeout: float = _UNSET) -> _Proxy:
        return _Proxy(self._worker, self._sid, rpc.rpc_async, timeout)

    def remote(self, timeout: float = _UNSET) -> _Proxy:
        return _Proxy(self._worker, self._sid, rpc.remote, timeout)

    def __getattr__(self, name: str) -> Any:  # to_here, owner, owner_name, ...
        return getattr(self._rref, name)

    def __repr__(self) -> str:
        return f"RenewedOwnerRRef({self._rref!r})"
