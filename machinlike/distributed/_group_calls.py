"""RpcGroup's plain calls: run any function on a named member (``rpc_sync``, ``rpc_async``,
``remote``). The blocking call itself is ``_calls.sync_call``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from torch.distributed import rpc

from . import _calls, _samehost
from ._calls import RpcFuture, is_async, prepare_call, sync_call, unwrap
from ._group_directory import GroupDirectory

__all__ = ["GroupCalls"]


class GroupCalls:
    """The plain calls of :class:`~machinlike.distributed.RpcGroup` (a mixin it inherits).

    Holds no state of its own; it declares what it reads of the group's (initialised in
    ``RpcGroup.__init__``, which owns it) and the two group methods it calls.
    """

    _name: str
    _members: Optional[Tuple[str, ...]]

    def _check_usable(self, need_member: bool) -> GroupDirectory:
        raise NotImplementedError  # RpcGroup's

    def _timeout(self, d: GroupDirectory, timeout: Optional[float]) -> float:
        raise NotImplementedError  # RpcGroup's

    # ---------------------------------------------------------------- plain calls
    def _target(self, d: GroupDirectory, to: str) -> str:
        """The RPC worker of member ``to``; refuses non-members, fails fast for the gone."""
        if not isinstance(to, str):
            raise TypeError(f"to must be a member name (str), not {type(to).__name__} ({to!r})")
        if self._members is not None and to not in self._members:
            raise ValueError(f"{to!r} is not a member of RpcGroup {self._name!r} (members: {list(self._members)})")
        return d.roster.transport_of(to)

    def rpc_sync(self, to: str, func: Callable[..., Any], timeout: Optional[float] = None,
                 args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None) -> Any:
        """Run ``func(*args, **kwargs)`` on member ``to`` and return the result.

        ``func`` may be a lambda or local function (sent with dill); tensors in ``args``
        travel as tensors. A ``func`` decorated with
        ``@torch.distributed.rpc.functions.async_execution`` may return a future.

        Args:
            to: Name of a member of this group.
            func: The callable to run there.
            timeout: Seconds; None: the world's ``rpc_timeout``.
            args: Positional arguments of ``func``.
            kwargs: Keyword arguments of ``func``; None: none.

        Returns:
            What ``func`` returned.

        Raises:
            ValueError: ``to`` is not a member of the group.
            TypeError: ``func`` is not callable.
            TimeoutError, PeerLostError: ``to`` did not answer in time / is gone (named).
            Exception: whatever ``func`` raised, with its remote traceback as cause.
        """
        d = self._check_usable(need_member=False)
        wait = self._timeout(d, timeout)
        call = prepare_call(func, args, kwargs)
        entry = _calls._run_async if is_async(func) else _calls._run
        worker = self._target(d, to)
        return unwrap(sync_call(d.roster, d.waits, worker, entry, _samehost.outgoing(worker, call), wait,  # [shm hook]
                                 f"rpc_sync of {func!r}"))

    def rpc_async(self, to: str, func: Callable[..., Any], timeout: Optional[float] = None,
                  args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None) -> RpcFuture:
        """Like :meth:`rpc_sync` but returns at once; ``wait()`` on the result.

        Args:
            to: Name of a member of this group.
            func: The callable to run there.
            timeout: Seconds, counted from now; None: the world's ``rpc_timeout``.
            args: Positional arguments of ``func``.
            kwargs: Keyword arguments of ``func``; None: none.

        Returns:
            An :class:`RpcFuture` whose ``wait()`` returns the result or raises what
            :meth:`rpc_sync` would.

        Raises:
            ValueError: ``to`` is not a member of the group.
            TypeError: ``func`` is not callable.
        """
        d = self._check_usable(need_member=False)
        wait = self._timeout(d, timeout)
        call = prepare_call(func, args, kwargs)
        entry = _calls._run_async if is_async(func) else _calls._run
        worker = self._target(d, to)
        d.roster.pipes.called(worker)
        fut = rpc.rpc_async(worker, entry, args=_samehost.outgoing(worker, call), timeout=wait)  # [shm hook]
        return RpcFuture(fut, to, f"rpc_async of {func!r}", wait)

    def remote(self, to: str, func: Callable[..., Any], timeout: Optional[float] = None,
               args: Sequence[Any] = (), kwargs: Optional[Dict[str, Any]] = None) -> rpc.RRef:
        """Run ``func`` on member ``to`` and return an RRef to the result at once.

        Errors of ``func`` surface from ``rref.to_here()`` as torch reports them.

        Args:
            to: Name of a member of this group.
            func: The callable to run there.
            timeout: Seconds for creating the result on ``to``; None: the world's
                ``rpc_timeout``.
            args: Positional arguments of ``func``.
            kwargs: Keyword arguments of ``func``; None: none.

        Returns:
            A ``torch.distributed.rpc.RRef`` owned by ``to``.

        Raises:
            ValueError: ``to`` is not a member of the group.
            TypeError: ``func`` is not callable.
        """
        d = self._check_usable(need_member=False)
        wait = self._timeout(d, timeout)
        call = prepare_call(func, args, kwargs)
        entry = _calls._run_bare_async if is_async(func) else _calls._run_bare
        worker = self._target(d, to)
        d.roster.pipes.called(worker)
        return rpc.remote(worker, entry, args=_samehost.outgoing(worker, call), timeout=wait)  # [shm hook]
