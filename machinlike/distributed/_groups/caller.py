"""Caller: every call an RpcGroup sends, to a named member or to the owner of a key.

Owns no state of its own: it holds the group's identity and the parts a call needs, handed
over when the group's parts are built. Arguments arrive checked (``RpcGroup`` is the
public entrance); what leaves goes through ``_calls.samehost.outgoing`` (large CPU tensors of a
same-host call travel through shared memory: the ``[shm hook]`` lines) and, for a
blocking call, through ``_calls.send.sync_call`` (a gone member fails at once, a silent host
is ended by the liveness monitor), and an asynchronous one through ``_calls.send.send_call``
(both send again what this process's agent could not send at all, e.g. while it renews)::

    service_*(key)  OwnerCache.service(key) ──► call the owner
                    answer "missing" (the cache was stale) ──► look the key up again and
                    call once more, within the same deadline (async: wait() does it)
    paired(key)     OwnerCache.value(key) ──► the owner says it holds the key ──► a
                    handle naming the owner (_calls.refs.PairedRef)
    *_remote        the owner makes and keeps the result ──► a handle (_calls.refs.ResultRef)
    run_*(to)       Roster.worker_of(to) ──► call that member's RPC worker

Why one object for both kinds of call: the retry-once policy, the same-host hook and
the error translation are the group's whole outgoing path, and they read best in one
place. The hot path (a cached ``service_sync``) is a dict look-up, one ``sync_call`` and
a message that is formatted only if the call fails.
"""

from __future__ import annotations

import difflib
import time
from typing import Any, Callable, Dict, List, Sequence, Tuple


from .._calls import context as _context, ref_owner as _ref_owner, refs as _refs, samehost as _samehost
from .._calls import serve as _serve
from .._calls import RpcFuture, carry, is_async, is_missing, send_async, send_call, sync_call, unwrap
from .owners import OwnerCache
from .._calls import PairedRef, ResultRef, settled

from .._membership import Roster
from .._membership import Waits
from ..._deadline import deadline_left
from ...exception import PeerLostError

__all__ = ["Caller"]

#: ``(args, kwargs)`` of a call, as ``_checks.call_args`` returns them.
CallArgs = Tuple[Tuple[Any, ...], Dict[str, Any]]

# The cached owner first, then one fresh look-up.
_CACHED_THEN_FRESH = (False, True)
_FRESH = (True,)
# A missing key's KeyError lists at most _SHOWN of the group's keys, read from the claim
# lists of at most _READ_MOST live members (a look at the store, on the error path only).
_SHOWN = 10
_READ_MOST = 64
_HELD_FRESH = 1.0  # seconds a read of the group's keys serves the next KeyErrors
_LOST_LATELY = 300.0  # seconds a member's loss is named in the KeyError of a key nobody holds


def _named(result: RpcFuture, member: str) -> RpcFuture:
    """``result``, told the member its call goes to (a resend may go to another worker)."""
    result.member = member
    return result


def _not_found(what: str, key: str, group: str, verb: str) -> str:
    """machin's words (callers match them), then why and the fix."""
    wait = f"group.wait_paired({key!r})" if verb == "pair" else f"group.wait_registered({key!r})"
    return (f"{what} [{key}] not found on Group [{group}]: no live member has {verb}ed it (yet: members start "
            f"at their own pace); {verb} it on its member, then meet at group.barrier() before the first "
            f"call (a group with a member list), or wait for it with {wait}")


class Caller:
    """The outgoing calls of one group incarnation.

    Args:
        group: The group's name (for messages).
        sid: The group's service-id prefix, ``"<group>/<epoch>/"``.
        roster: Who is live, and each member's RPC worker.
        waits: Ends a call to another host when its member is lost.
        owners: The group's owner cache.
    """

    def __init__(self, group: str, sid: str, roster: Roster, waits: Waits, owners: OwnerCache) -> None:
        self._group = group
        self._sid = sid
        self._roster = roster
        self._waits = waits
        self._owners = owners
        # (kind -> (time.monotonic(), keys held, some unread)): a loop that polls for a key
        # to appear meets a KeyError per try, and each would read every member's claim list
        self._held_seen: Dict[str, Tuple[float, List[str], bool]] = {}

    # ------------------------------------------------------------------- services
    def _service_target(self, key: str, refresh: bool, deadline: float) -> Tuple[str, Callable[..., Any]]:
        # A look-up in the store counts against the call's own time (a silent store).
        owner = self._owners.service(key, refresh, max(0.001, deadline - time.monotonic()))
        if owner is None:
            raise self._nobody("s", key)
        return owner.worker, _serve._call_async_service if owner.is_async else _serve._call_service

    def service_sync(self, key: str, call_args: CallArgs, wait: float) -> Any:
        """What service ``key`` returns (see ``RpcGroup.registered_sync``); ``wait`` in seconds."""
        # A retry after a stale owner shares the deadline.
        return self._service_until(key, (self._sid + key,) + call_args, time.monotonic() + wait, wait,
                                   _CACHED_THEN_FRESH)

    def _service_until(self, key: str, call: Tuple[Any, ...], deadline: float, stated: float,
                       refreshes: Sequence[bool]) -> Any:
        """Call service ``key`` once per entry of ``refreshes`` (True: look its owner up
        first) until an owner holds it, all within ``deadline``; quote ``stated``."""
        for refresh in refreshes:
            worker, entry = self._service_target(key, refresh, deadline)
            sent = _samehost.outgoing(worker, call, deadline)  # [shm hook]
            left = deadline - time.monotonic()
            value = sync_call(self._roster, self._waits, worker, entry, sent,
                              left if left > 0.001 else 0.001, lambda: f"service {key!r} of group {self._group!r}",
                              stated)
            if not is_missing(value):
                return settled(unwrap(value))
        raise self._nobody("s", key)

    def service_async(self, key: str, call_args: CallArgs, wait: float) -> RpcFuture:
        """Service ``key``'s pending result (see ``RpcGroup.registered_async``).

        Raises:
            KeyError: nobody serves ``key`` (here, not from ``wait()``).
        """
        call = (self._sid + key,) + call_args
        deadline = time.monotonic() + wait
        worker, entry = self._service_target(key, False, deadline)
        # The owner answered "missing" (a stale cache): look it up again and call the new
        # one with what is left of this call's timeout, not a fresh one.
        what = f"service {key!r} of group {self._group!r}"
        result = RpcFuture(None, "", what, wait, retry=lambda: self._service_until(key, call, deadline, wait, _FRESH))
        sent_to, fut = send_call(self._roster, worker, max(0.001, deadline - time.monotonic()), what,
                                 lambda to, left: send_async(self._roster, to, entry,
                                                             _samehost.outgoing(to, call, deadline),  # [shm hook]
                                                             left, _named(result, self._roster.member_of(to))))
        return carry(result, fut, sent_to, self._roster, self._waits)

    def service_remote(self, key: str, call_args: CallArgs, wait: float) -> ResultRef:
        """A handle to service ``key``'s result, kept by its owner (see ``RpcGroup.registered_remote``).

        Raises:
            KeyError: nobody serves ``key``.
        """
        deadline = time.monotonic() + wait
        worker, _ = self._service_target(key, False, deadline)
        # _keep_service has the key's new owner run it if it moved meanwhile.
        sid = self._sid + key
        return _refs.new_result(_context.require(), self._roster.member_of(worker), worker,
                                f"registered_remote of service {key!r} of group {self._group!r}",
                                max(0.001, deadline - time.monotonic()),
                                lambda head: (_ref_owner._keep_service, (head + (sid,),) + call_args),
                                sent_to_owner=False)

    # --------------------------------------------------------------------- values
    def paired(self, key: str, wait: float) -> PairedRef:
        """A handle to the value paired under ``key`` (see ``RpcGroup.get_paired``).

        Raises:
            KeyError: nothing is paired under ``key``.
            TimeoutError, PeerLostError: the owner did not answer / is gone (named).
        """
        deadline = time.monotonic() + wait
        sid = self._sid + key
        for refresh in _CACHED_THEN_FRESH:
            worker = self._owners.value(key, refresh, max(0.001, deadline_left(deadline)))
            if worker is None:
                break
            value = sync_call(self._roster, self._waits, worker, _ref_owner._is_paired, (sid,),
                              max(0.001, deadline_left(deadline)), f"value {key!r} of group {self._group!r}", wait)
            if not is_missing(value):  # the owner's (member, incarnation)
                return PairedRef(value[0], value[1], sid)
        raise self._nobody("v", key)

    def _nobody(self, kind: str, key: str) -> Exception:
        """The error for a service (``kind`` "s") or value ("v") ``key`` that nobody holds.

        PeerLostError naming the owner when this process last found it held by a member
        since lost (the call would have failed so a moment earlier, before the liveness
        monitor withdrew the dead member's keys), else KeyError.
        """
        what, verb = ("Service", "register") if kind == "s" else ("Value with key", "pair")
        last = self._owners.last_owner(kind, key)
        if last is None:
            return KeyError(_not_found(what, key, self._group, verb) + self._lost_words(verb)
                            + self._held_words(kind, key))
        lost, worker = last
        why = self._roster.gone(lost)
        if why == "lost":
            noun = "service" if kind == "s" else "value"
            return PeerLostError(lost, f"{noun} {key!r} of group {self._group!r}: its owner was lost, and no live "
                                       f"member has {verb}ed it since; {verb} it again on a live member (a "
                                       f"restarted one does so itself) and retry")
        since = ("left the world" if why == "left" else "was lost and is back as a new process"
                 if self._roster.worker_gone(worker) else f"{'de' if kind == 's' else 'un'}{verb}ed it")
        return KeyError(f"{what} [{key}] not found on Group [{self._group}]: its owner, member {lost!r}, "
                        f"{since}, and no live member has {verb}ed it since")

    def _lost_words(self, verb: str) -> str:
        """The members lost lately, for a KeyError: a key this process never saw held may
        have gone with one of them (cold trial 29: an inference host's death read as
        "not paired yet"); "" when none was."""
        lost = self._roster.lost_lately(_LOST_LATELY)
        if not lost:
            return ""
        names = ", ".join(f"{m!r} ({ago:.0f} s ago)" for m, ago in lost)
        return f". Lost lately: member {names}; what a lost member {verb}ed went with it"

    def _held_words(self, kind: str, key: str) -> str:
        """What the group holds instead of ``key``, for its KeyError: the close match and
        the keys (at most ``_SHOWN``); "" when the store cannot tell."""
        seen = self._held_seen.get(kind)
        if seen is not None and time.monotonic() - seen[0] < _HELD_FRESH:
            _, held, more = seen
        else:
            try:
                held, more = self._owners.held(kind, _READ_MOST)
            except (PeerLostError, TimeoutError):
                return ""
            self._held_seen[kind] = (time.monotonic(), held, more)
        noun = "services" if kind == "s" else "values"
        close = difflib.get_close_matches(key, held, n=1)
        words = f". Did you mean {close[0]!r}?" if close else "."
        words += f" The group's {noun}: {held[:_SHOWN]}"
        if len(held) > _SHOWN:
            words += f" and {len(held) - _SHOWN} more"
        return words + (f" (of the first {_READ_MOST} live members)" if more else "")

    # ---------------------------------------------------------------- plain calls
    def run_sync(self, to: str, func: Callable[..., Any], call: Tuple[Any, ...], wait: float) -> Any:
        """What ``func`` returns on member ``to`` (see ``RpcGroup.rpc_sync``).

        ``call`` is ``_calls.shipping.prepare_call``'s; ``to`` a member of the group.
        """
        entry = _serve._run_async if is_async(func) else _serve._run
        worker = self._roster.worker_of(to)
        deadline = time.monotonic() + wait
        sent = _samehost.outgoing(worker, call, deadline)  # [shm hook]
        return settled(unwrap(sync_call(self._roster, self._waits, worker, entry, sent,
                                        max(0.001, deadline - time.monotonic()), f"rpc_sync of {func!r}", wait)))

    def run_async(self, to: str, func: Callable[..., Any], call: Tuple[Any, ...], wait: float) -> RpcFuture:
        """``func``'s pending result on member ``to`` (see ``RpcGroup.rpc_async``)."""
        entry = _serve._run_async if is_async(func) else _serve._run
        what = f"rpc_async of {func!r}"
        result = RpcFuture(None, to, what, wait)
        sent_to, fut = send_call(self._roster, self._roster.worker_of(to), wait, what,
                                 lambda worker, left: send_async(
                                     self._roster, worker, entry,
                                     _samehost.outgoing(worker, call, time.monotonic() + left),  # [shm hook]
                                     left, result))
        return carry(result, fut, sent_to, self._roster, self._waits)

    def run_remote(self, to: str, func: Callable[..., Any], call: Tuple[Any, ...], wait: float) -> ResultRef:
        """A handle to ``func``'s result, kept by member ``to`` (see ``RpcGroup.remote``).

        ``call`` is ``_calls.shipping.prepare_call``'s: ``(shipped func, args, kwargs)``.
        """
        return _refs.new_result(_context.require(), to, self._roster.worker_of(to), f"remote of {func!r}", wait,
                                lambda head: (_ref_owner._keep_run, (head + (call[0],),) + tuple(call[1:])))
