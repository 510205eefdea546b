"""The caller's side of a call: sending within one deadline, its retry, and error translation.

    sync_call / send_call ──► _until_sent: wait out an agent swap, send, and on an error
        _Attempts decides: a pipe reset or a renewed worker ─► send again (same deadline)
                           anything else                   ─► translate_error: the member
                                                               and the caller's timeout named
    sync_call then waits on the reply together with the member's departure (Waits), so a
    member that dies while the call is pending fails it at once, not at its timeout.

    A call to a process on this host goes through its lane (``_transport.lane``) when the
    lane takes it; what the lane refuses (before sending anything) goes through torch RPC.
"""

from __future__ import annotations

import pickle
import time
from typing import Any, Callable, Optional, Tuple, TypeVar, Union

import torch
from torch.distributed import rpc

from ...exception import PeerLostError
from .. import _transport
from .._store import forked as _forked
from .._membership import Roster, Waits
from . import context as _context
from .coroutines import blocking_error, on_loop_thread

__all__ = ["translate_error", "sync_call", "send_call", "send_async"]


# ------------------------------------------------------------------- error translation
_LOST_MARKERS = (
    "eof", "closed under the call", "pipe closed", "connection refused", "econnrefused", "connection reset",
    "econnreset", "broken pipe", "epipe", "shut down", "shutdown", "no route to host",
    "unknown destination worker", "could not find destination",
    # tensorpipe's CMA channel reading a same-host sender's memory after it died (ESRCH)
    "process_vm_readv: no such process",
)


# The callee could not pickle its reply: the lane says so, torch's RPC in the C++ frame
# that failed (its message carries a C++ stack, whose words must not read as a loss), or,
# torch 2.9, in the Python frame of its pickler ("At: .../rpc/internal.py(136): serialize").
_REPLY_UNPICKLABLE = ("the reply could not be pickled", "serializepyobject", "): serialize")


# What a pickler raises for an object it cannot pickle (a lock, a socket, a local function):
# TypeError ("cannot pickle"), AttributeError ("Can't pickle local object", Python <= 3.13)
# or PicklingError.
_PICKLING_ERRORS = (TypeError, AttributeError, pickle.PicklingError)


def translate_error(err: BaseException, member: str, what: str, timeout: float) -> BaseException:
    """Turn torch's text-only RPC errors into a TimeoutError / PeerLostError naming ``member``
    (a TypeError for a call this process could not pickle, or a result the callee could not)."""
    if isinstance(err, PeerLostError):
        return err  # named already (Waits ended the call: see RpcFuture.end_unanswered)
    text = str(err).lower()
    if isinstance(err, _PICKLING_ERRORS):  # raised here, while pickling the call (_until_sent)
        return TypeError(f"{what} on member {member!r} was not sent: an argument (or the function) "
                         f"cannot be pickled ({type(err).__name__}: {err}); send tensors, numbers, strings, containers "
                         f"of them and module-level functions and classes, and make anything else "
                         f"on the member (a service it registers, or a function it runs)")
    if isinstance(err, RuntimeError) and "found tensor on device: meta" in text:
        return ValueError(f"{what} on member {member!r} was not sent: an argument is a tensor on the 'meta' device, "
                          f"which has no data to send; send its shape and dtype (or a real tensor, e.g. "
                          f"torch.empty_like(t, device='cpu')) and make the meta tensor on the member")
    if isinstance(err, RuntimeError) and any(marker in text for marker in _REPLY_UNPICKLABLE):
        cause = str(err).split("\n", 1)[0]
        return TypeError(f"{what} on member {member!r}: its result cannot be pickled to be sent back "
                         f"({cause}); return tensors, numbers, strings or containers of them")
    if "timeout" in text or "timed out" in text:
        context = _context.current()
        if context is not None and context.timed_out is not None:
            context.timed_out(member)  # (returns at once: the monitor acts on its next tick)
        return TimeoutError(f"{what} on member {member!r} did not answer within {timeout:g} s")
    if any(marker in text for marker in _LOST_MARKERS):
        return PeerLostError(member, f"{what} failed: {err}")
    if _transport.closed_agent_error(err):
        return RuntimeError(f"{what} on member {member!r} was not sent: this process's RPC agent was shut down "
                            f"(its World stopped, or a renewal of its agent failed): {err}")
    return err


# ------------------------------------------------------------------ the blocking call
def _text(what: Union[str, Callable[[], str]]) -> str:
    return what if isinstance(what, str) else what()


def sync_call(roster: "Roster", waits: "Waits", worker: str, entry: Any, args: Tuple, timeout: float,
              what: Union[str, Callable[[], str]], stated: Optional[float] = None) -> Any:
    """One blocking call of ``entry`` on RPC worker ``worker``, the way every group call makes it.

        worker gone in this view       -> PeerLostError at once
        worker on this host's lane     -> the lane's call: its death closes the socket,
                                          its loss (a stopped process) closes the lane
        otherwise                      -> rpc_async + Waits.wait_call: the liveness
                                          monitor ends the wait

    Args:
        timeout: Seconds for this call.
        what: The call, for messages; a callable makes it only when needed (a small
            call should not pay for formatting it).
        stated: The caller's timeout to quote (None: ``timeout``).

    Raises:
        PeerLostError, TimeoutError: the worker is gone / did not answer (its member named).
    """
    if on_loop_thread():
        raise blocking_error(_text(what))
    if roster.cut_off is not None:
        raise roster.cut_off
    if roster.resolve(worker) is None:
        raise PeerLostError(roster.member_of(worker), f"{_text(what)}: it left or was lost")

    def call(to: str, left: float) -> Any:
        carried = _by_lane(roster, to, lambda lane, pid: lane.call_sync(pid, entry, args, left))
        if carried is not _NOT_CARRIED:
            return carried
        # A dead process closes its sockets, but one of another host may vanish without a
        # word, and one here may be stopped by a signal: the liveness monitor's verdict
        # ends the wait.
        return waits.wait_call(rpc.rpc_async(to, entry, args=args, timeout=left), to, _text(what))

    return _until_sent(roster, worker, timeout, call, lambda err, to: translate_error(
        err, roster.member_of(to), _text(what), timeout if stated is None else stated))[1]


def send_async(roster: "Roster", to: str, entry: Any, args: Tuple, timeout: float,
               into: Optional["_transport.lane.LaneFuture"] = None) -> torch.futures.Future:
    """``rpc.rpc_async(to, entry, args, timeout)``, through the lane when ``to`` runs on this
    host and the lane takes the call (see ``sync_call``); for ``send_call``'s closures.
    ``into``: the future the lane completes when it carries the call (it is returned then)."""
    _forked.check("an RPC call")
    carried = _by_lane(roster, to, lambda lane, pid: lane.call_async(pid, entry, args, timeout, into))
    if carried is not _NOT_CARRIED:
        return carried
    return rpc.rpc_async(to, entry, args=args, timeout=timeout)


_NOT_CARRIED = object()


def _by_lane(roster: "Roster", to: str, carry: Callable[["_transport.lane.Lane", int], Any]) -> Any:
    """``carry(lane, pid)`` when worker ``to`` runs on this host and this process's lane
    takes the call; ``_NOT_CARRIED`` when it does not (nothing was sent: counted)."""
    pid = roster.pid_here(to)
    lane = _transport.lane.current() if pid else None
    if lane is None:
        return _NOT_CARRIED
    try:
        return carry(lane, pid)
    except _transport.lane.NotForLane:
        lane.not_carried += 1
        return _NOT_CARRIED


_Sent = TypeVar("_Sent")


def send_call(roster: "Roster", worker: str, timeout: float, what: str,
              send: Callable[[str, float], _Sent]) -> Tuple[str, _Sent]:
    """Hand a call to this process's agent without waiting for it: ``send(worker, seconds)``
    (an ``rpc.rpc_async`` or ``rpc.remote``), sent again when the agent could not send it at
    all (see ``_Attempts``), all within ``timeout`` seconds.

    Returns:
        The worker it went to (its member may have moved) and what ``send`` returned.

    Raises:
        PeerLostError, RuntimeError: it could not be sent (the member named).
    """
    return _until_sent(roster, worker, timeout, send,
                       lambda err, to: translate_error(err, roster.member_of(to), what, timeout))


def _until_sent(roster: "Roster", worker: str, timeout: float, send: Callable[[str, float], _Sent],
                fail: Callable[[BaseException, str], BaseException]) -> Tuple[str, _Sent]:
    """``send(worker, seconds left)``, again as ``_Attempts`` says, within ``timeout``
    seconds; ``fail(err, worker)`` is what to raise when an error stands."""
    _forked.check("an RPC call")
    deadline = time.monotonic() + timeout
    _transport.wait_steady(timeout)  # (an agent swap under way: see _transport._swap)
    attempt: Optional[_Attempts] = None  # made on the first error only (the hot path has none)
    to = worker
    while True:
        # A worker retired by its member's renewal since the caller picked it (this
        # process's own included): its successor (see Roster.resolve).
        to = roster.resolve(to) or to
        roster.pipes.called(to)
        try:
            return to, send(to, max(0.001, deadline - time.monotonic()))
        except _PICKLING_ERRORS as err:
            if "pickl" not in str(err).lower():
                raise
            # The caller's own pickler refused the call: nothing was sent, nothing to retry.
            raise fail(err, to) from err
        except (RuntimeError, ValueError) as err:
            attempt = attempt or _Attempts(to)
            if not attempt.again(roster, err, deadline):
                raise fail(err, attempt.worker) from err
            to = attempt.worker


class _Attempts:
    """Where one call goes next after an error that delivered nothing of it (so sending it
    again cannot run it twice), within the call's deadline:

        no current agent (this process swaps it: a renewal)      -> wait for the swap
        an agent shut down under the call (a failed renewal's)   -> wait, then the new one
        refused (its member renewed its agent or recycled)       -> the worker it moved to
        reset by a live process on this host (its listener       -> the worker it moved to
          closed under a new pipe)
        unknown to this agent ("could not find destination")     -> the worker it moved to,
                                                                    or introduce it once
    """

    __slots__ = ("worker", "_introduced", "_closed")

    # A closed agent that stays current (torch resets it just after its shutdown) is met
    # at most this often per call: the World itself is stopping then.
    _CLOSED_MAX = 3

    def __init__(self, worker: str) -> None:
        self.worker = worker
        self._introduced = False  # a worker is introduced to this process's agent once per call
        self._closed = 0

    def again(self, roster: "Roster", err: BaseException, deadline: float) -> bool:
        """Whether to send once more (to ``self.worker``, perhaps changed); False: ``err`` stands."""
        if time.monotonic() >= deadline:
            return False
        if _transport.closed_agent_error(err):
            self._closed += 1
            if self._closed > self._CLOSED_MAX:
                return False
            return _transport.wait_current(deadline - time.monotonic())
        if not isinstance(err, RuntimeError):
            return False
        if _transport.no_agent_error(err):
            return _transport.wait_current(deadline - time.monotonic())
        renewed = _renewed_worker(roster, self.worker, err, deadline, self._introduced)
        if renewed is None:
            return False
        self._introduced = self._introduced or renewed == self.worker
        self.worker = renewed
        return True


# How torch's TensorPipe words a pipe reset under a call (tcp and shm transports).
_RESET = ("connection reset", "econnreset", "broken pipe", "epipe")


# Seconds a reset call waits for its worker's member to move (a renewal: a monitor tick to
# notice the closed listener, and the new agent's join).
_RESET_WAIT = 10.0


def _renewed_worker(roster: "Roster", worker: str, err: RuntimeError, deadline: float,
                    introduced: bool = False) -> Optional[str]:
    """The worker to call instead of ``worker`` after ``err``, else None (the error stands).

    Refused: the worker its member moved to before ``deadline``. Unknown to this process's
    agent ("could not find destination"): the worker it moved to, or ``worker`` itself once
    introduced to the agent (not again when ``introduced``: this call did that already),
    or, when its address is gone too, the worker it moves to within ``_RESET_WAIT``.
    Reset by a live process on this host: the worker it moved to within ``_RESET_WAIT``.
    """
    text = str(err).lower()
    if "could not find destination" in text:
        # Nothing was sent: this process's agent does not know ``worker``. Either its
        # member moved to a new agent since this view's caller picked ``worker`` (this
        # process's own old agent included), or it joined while this process was renewing
        # its agent, so that its join told the agent being retired, not the new one.
        moved = roster.moved_from(worker, 0.0)
        if moved is not None:
            return moved
        if introduced or roster.worker_gone(worker):
            return None  # (introduced: this call told the agent once already; it stands)
        if not _transport.introduce_current(worker):
            # Its address is gone: a worker its member retired (renewals in a row), whose
            # move this view reads within a tick; a gone member's ends the wait at once.
            return roster.moved_from(worker, min(_RESET_WAIT, deadline - time.monotonic()))
        return worker
    if "connection refused" in text or "econnrefused" in text:
        return roster.moved_from(worker, deadline - time.monotonic())
    if any(word in text for word in _RESET) and roster.on_this_host(worker):
        # A new pipe to a process here whose listener closed as it connected (the kernel
        # took the connection, nobody accepted it: nothing of the call ran), this process's
        # own included: it renews its agent within a tick or two, and the call goes to the
        # new one. A dead process here resets too: moved_from says so at once and the
        # error stands; so it does when no move comes within _RESET_WAIT.
        return roster.moved_from(worker, min(_RESET_WAIT, deadline - time.monotonic()))
    return None
