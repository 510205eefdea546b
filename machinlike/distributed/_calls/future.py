"""RpcFuture: the pending result of an asynchronous call, settled as a synchronous one is."""

from __future__ import annotations

import threading
from typing import Any, Callable, Optional

import torch

from .. import _transport
from .send import translate_error
from .serve import is_missing, unwrap

__all__ = ["RpcFuture"]


class RpcFuture:
    """The pending result of an asynchronous call.

    ``wait()`` returns the value, or raises the remote exception (original type, remote
    traceback as ``__cause__``), ``TimeoutError`` or :class:`~machinlike.exception.PeerLostError`.
    """

    __slots__ = ("_fut", "_member", "_what", "_timeout", "_retry")

    def __init__(
        self,
        fut: torch.futures.Future,
        member: str,
        what: str,
        timeout: float,
        retry: Optional[Callable[[], Any]] = None,
    ) -> None:
        self._fut = fut
        self._member = member
        self._what = what
        self._timeout = timeout
        self._retry = retry

    def wait(self) -> Any:
        """Block until the call finished (at most its RPC timeout) and return its value.

        Raises:
            TimeoutError: the member (named) did not answer within the call's timeout.
            PeerLostError: the member is gone.
            Exception: what the remote function raised (original type, remote traceback
                as ``__cause__``).
        """
        fut = self._fut
        if not fut.done():
            # Waited for on an Event, not in torch's C++ wait, which holds the thread until
            # the call ended (up to its whole timeout) whatever signal comes: a Ctrl-C now
            # raises at once. A lane call's Future has its own sentinel; another's gets an
            # Event from a done-callback (40 us more a call), on the main thread only, the
            # one signals reach. Bounded: torch completes the future at the call's timeout.
            if isinstance(fut, _transport.lane.LaneFuture):
                fut.wait_arrived()
            elif threading.current_thread() is threading.main_thread():
                arrived = threading.Event()
                fut.add_done_callback(lambda _: arrived.set())
                arrived.wait()
        try:
            value = fut.wait()
        except RuntimeError as err:
            raise translate_error(err, self._member, self._what, self._timeout) from err
        if is_missing(value) and self._retry is not None:
            return self._retry()
        return unwrap(value)

    def done(self) -> bool:
        """Whether the result (or error) has arrived."""
        return self._fut.done()

    def add_done_callback(self, callback: Callable[[], None]) -> None:
        """Call ``callback()`` once the result (or error) has arrived (at once if it has)."""
        self._fut.add_done_callback(lambda _: callback())

    def __repr__(self) -> str:
        state = "done" if self._fut.done() else "pending"
        return f"<RpcFuture {self._what} on {self._member!r} {state}>"
