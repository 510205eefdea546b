"""RpcGroup's plain calls: run any function on a named member (``rpc_sync``, ``rpc_async``,
``remote``), and the one blocking call every group call makes.

    _sync(worker, ...)   worker gone in this view       -> PeerLostError at once
                         worker on this host (/proc)     -> rpc_sync: its death closes the sockets
                         worker elsewhere                -> rpc_async + Membership.wait_call: the
                                                            liveness monitor ends the wait
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence, Tuple, Union

from torch.distributed import rpc

from . import _calls, _checks, _samehost
from ._calls import RpcFuture, is_async, ship_function, translate_error, unwrap
from ._state import require_world
from ..exception import PeerLostError

__all__ = ["GroupCalls"]


def _text(what: Union[str, Callable[[], str]]) -> str:
    return what if isinstance(what, str) else what()


class GroupCalls:
    """The plain calls of :class:`~machinlike.distributed.RpcGroup` (a mixin it inherits).

    Holds no state of its own: what these methods use (``_name``, ``_members``) is
    initialised in ``RpcGroup.__init__``, which owns it; ``_timeout`` and
    ``_check_usable`` come from the group too.
    """

    # ------------------------------------------------------------------ the call
    def _sync(self, worker: str, entry: Any, args: Tuple, timeout: float, what: Union[str, Callable[[], str]],
              stated: Optional[float] = None) -> Any:
        """One blocking call.

        Args:
            what: The call, for messages; a callable makes it only when needed (a small
                call should not pay for formatting it).
            stated: The caller's timeout to quote (None: ``timeout``).
        """
        membership = require_world().membership
        members, waits = membership.roster, membership.waits
        if members.transport_gone(worker):
            raise PeerLostError(members.member_of(worker), f"{_text(what)}: it left or was lost")
        try:
            if members.on_this_host(worker):
                # A dead process here closes its sockets: the call fails at once by itself.
                return rpc.rpc_sync(worker, entry, args=args, timeout=timeout)
            # Another host may vanish without a word: the liveness monitor ends the wait.
            return waits.wait_call(rpc.rpc_async(worker, entry, args=args, timeout=timeout), worker, _text(what))
        except RuntimeError as err:
            raise translate_error(err, members.member_of(worker), _text(what),
                                  timeout if stated is None else stated) from err

    # ---------------------------------------------------------------- plain calls
    def _target(self, to: str) -> str:
        """The RPC worker of member ``to``; refuses non-members, fails fast for the gone."""
        world = require_world()
        if not isinstance(to, str):
            raise TypeError(f"to must be a member name (str), not {type(to).__name__} ({to!r})")
        if self._members is not None and to not in self._members:
            raise ValueError(f"{to!r} is not a member of RpcGroup {self._name!r} (members: {list(self._members)})")
        return world.membership.transport_of(to)

    def _prepare(self, func: Callable[..., Any], args: Sequence[Any], kwargs: Optional[Dict[str, Any]]) -> Tuple:
        if not callable(func):
            raise TypeError(f"func must be callable, not {type(func).__name__}")
        return (ship_function(func),) + _checks.call_args(args, kwargs)

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
        wait = self._timeout(self._check_usable(need_member=False), timeout)
        call = self._prepare(func, args, kwargs)
        entry = _calls._run_async if is_async(func) else _calls._run
        worker = self._target(to)
        return unwrap(self._sync(worker, entry, _samehost.outgoing(worker, call), wait,  # [shm hook]
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
        wait = self._timeout(self._check_usable(need_member=False), timeout)
        call = self._prepare(func, args, kwargs)
        entry = _calls._run_async if is_async(func) else _calls._run
        worker = self._target(to)
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
        wait = self._timeout(self._check_usable(need_member=False), timeout)
        call = self._prepare(func, args, kwargs)
        entry = _calls._run_bare_async if is_async(func) else _calls._run_bare
        worker = self._target(to)
        return rpc.remote(worker, entry, args=_samehost.outgoing(worker, call), timeout=wait)  # [shm hook]
