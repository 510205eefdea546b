"""Which RPC calls carry their tensors through shared memory, and the hooks that do it.

A World binds one :class:`SameHost` for its life. Around every RpcGroup call::

    caller                                          callee
    outgoing(member, (what, args, kwargs))
      peer on this host (same boot id and PID
      namespace, /proc reachable)?
        yes: large CPU tensors -> placeholders ───► unpickling rebuilds them (machinlike._shm)
             + reply terms (threshold, caller,      result = reply(value, terms):
               deadline)                            large CPU tensors -> placeholders
        no:  unchanged + reply 0                      (none once the deadline passed)
      a list, tuple or dict of thousands of plain items: pickled once, as bytes
        (``_shm._blob``), both ways, instead of walked
    unpickling the response rebuilds them ◄──────── (only when the callee's World allows it)

In a process that initialised CUDA, the same two hooks also move CUDA tensors, in the same
walk: through CUDA IPC to a peer on this host that uses the same GPUs (``_cuda_ipc``), else
staged through pinned CPU memory (``_cuda_stage``).

Nothing is decided by pickling hooks of torch's: a call to another host, or with the path
turned off, sends exactly what it sent before. Each side names the process a message goes
to (``_shm.guard``): segments lent for a receiver that dies before it takes them come
back to their owner (a caller SIGKILLed while its service ran kept the reply's lent).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ... import _pids, _shm
from ..._shm import _blob, _receive
from . import cuda_ipc as _cuda_ipc, cuda_ipc_peers as _cuda_ipc_peers, cuda_stage as _cuda_stage
from .._membership import pid_in, process_identity
from .. import _transport

__all__ = ["SameHost", "bind", "outgoing", "reply", "check_settings", "check_cuda_ipc", "share", "stats", "VERDICTS_KEPT"]

#: Verdicts kept at most, by worker and by process identity each: an elastic world's churn
#: brings new worker names and processes without end. Past it a map is emptied and its
#: verdicts asked again (a dict lookup and one ``/proc`` readlink each), so a call's own
#: lookup stays one dict read.
VERDICTS_KEPT = 4096


def check_settings(enabled: Any, threshold: Any, cache_bytes: Any) -> None:
    """Raise ValueError / TypeError naming a bad World keyword."""
    if not isinstance(enabled, bool):
        raise TypeError(f"same_host_shm must be a bool, not {type(enabled).__name__}")
    for name, value, least in (("shm_threshold", threshold, 1), ("shm_cache_bytes", cache_bytes, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{name}={value!r} must be an int >= {least} (bytes)")


def check_cuda_ipc(cache_bytes: Any) -> None:
    """Raise ValueError naming a bad ``cuda_ipc_cache_bytes``."""
    if isinstance(cache_bytes, bool) or not isinstance(cache_bytes, int) or cache_bytes < 0:
        raise ValueError(f"cuda_ipc_cache_bytes={cache_bytes!r} must be an int >= 0 (bytes; 0 stages CUDA "
                         f"tensors through the CPU)")


class SameHost:
    """One World's same-host settings and its verdict per peer process.

    Args:
        enabled: Use shared memory at all.
        threshold: Tensors of at least this many bytes take it.
        cache_bytes: Bound of this process's segment cache and of its cache of peers'
            mappings, each, in bytes.
        identity_of: A member's published ``process_identity``, None when unknown.
        cuda_ipc_bytes: Bound of this process's CUDA export slabs and of its openings of
            peers' slabs, each, in bytes; 0: CUDA tensors are staged (``_cuda_ipc``).
    """

    def __init__(self, enabled: bool, threshold: int, cache_bytes: int,
                 identity_of: Callable[[str], Optional[str]], cuda_ipc_bytes: int = 0) -> None:
        self.enabled = enabled
        self.threshold = threshold
        self._identity_of = identity_of
        self._space = process_identity().rpartition("/")[0]
        self._verdicts: Dict[str, bool] = {}  # by process identity
        # By RPC worker: a worker name is never reused and its process never changes, so
        # a call asks one dict instead of the membership tables (small calls pay for it).
        self._by_worker: Dict[str, bool] = {}
        self._words: Dict[str, int] = {}  # by RPC worker: its process's identity word (``word_of``)
        if enabled:
            _shm.cache().set_limit(cache_bytes)
            _receive.set_limit(cache_bytes)
        _cuda_ipc.configure(cuda_ipc_bytes if enabled else 0)  # [cuda ipc hook] (touches no CUDA)

    def local(self, member: str) -> bool:
        """Whether ``member``'s process shares this host's memory and ``/proc`` with us."""
        verdict = self._by_worker.get(member)
        if verdict is not None:
            return verdict
        identity = self._identity_of(member)
        if identity is None:
            return False  # not known yet: asked again next time
        verdict = self._verdicts.get(identity)
        if verdict is None:
            space, pid = identity.rpartition("/")[0], pid_in(identity)
            verdict = space == self._space and "?" not in space and pid > 0 and _shm.reachable(pid)
            if len(self._verdicts) >= VERDICTS_KEPT:
                self._verdicts.clear()
            self._verdicts[identity] = verdict
        if len(self._by_worker) >= VERDICTS_KEPT:
            self._by_worker.clear()
        self._by_worker[member] = verdict
        return verdict

    def word_of(self, member: str) -> int:
        """The identity word (``machinlike._pids``) of local ``member``'s process, read once
        per worker; 0 while its process identity is unknown."""
        word = self._words.get(member)
        if word is None:
            identity = self._identity_of(member)
            pid = pid_in(identity) if identity is not None else 0
            if pid <= 0:
                return 0  # (asked again next time)
            word = _pids.identity(pid)
            if len(self._words) >= VERDICTS_KEPT:
                self._words.clear()
            self._words[member] = word
        return word

    def cuda_target(self, member: str, deadline: Optional[float] = None) -> Optional[Tuple[int, int]]:
        """``(device key, pid)`` to send ``member`` CUDA tensors through IPC; None: stage.
        Asked only of a local ``member``, by a process that initialised CUDA; a first
        call's probe ends by ``deadline`` (``time.monotonic()``; None: its own bound)."""
        if not _cuda_ipc.enabled():
            return None
        identity = self._identity_of(member)
        if identity is None:
            return None
        return _cuda_ipc_peers.peer_target(member, pid_in(identity), deadline)

    def close(self) -> None:
        """Release this process's segments and cached mappings (World stop)."""
        if self.enabled:
            _shm.cache().close()
            _receive.forget_all()
        _cuda_ipc.close()  # [cuda ipc hook] retires this process's slabs, drops its openings
        _cuda_ipc.configure(0)


_current: Optional[SameHost] = None


def bind(settings: Optional[SameHost]) -> None:
    """Make ``settings`` what calls of this process use (None: no World, path off)."""
    global _current
    _current = settings


def outgoing(member: str, call: Tuple[Any, Any, Any], deadline: Optional[float] = None) -> Tuple[Any, ...]:
    """``(what, args, kwargs, reply terms)`` for a call to ``member`` that ends by
    ``deadline`` (``time.monotonic()``: bounds the probe of a first call from a process that
    uses CUDA, ``_cuda_ipc_peers``, and travels in the terms: a reply made after it lends
    nothing, see :func:`reply`; None: the probe's own bound, none sent)."""
    settings = _current
    if settings is None or not settings.enabled or not settings.local(member):
        if _cuda_stage.active():  # [cuda hook] CUDA tensors staged through the CPU
            return _cuda_stage.outgoing(call, 0)
        return (*call, 0)
    threshold = settings.threshold
    receiver = settings.word_of(member)
    if _cuda_stage.active():  # [cuda hook] one walk: CUDA tensors through IPC or staged, large CPU ones as here
        return _cuda_stage.outgoing(call, threshold, settings.cuda_target(member, deadline), receiver, deadline)
    what, args, kwargs = call
    pickled = None if kwargs else _blob.whole(args)  # a long list of numbers: pickled once, not walked
    if pickled is not None:
        return (what, pickled, kwargs, _shm.terms(threshold, due=deadline))
    if kwargs:  # one walk: a tensor in both args and kwargs arrives as one, as pickle gives
        args, kwargs = _shm.encode_parts((args, kwargs), threshold, receiver)
    elif args:
        args, = _shm.encode_parts((args,), threshold, receiver)
    return (what, args, kwargs, _shm.terms(threshold, due=deadline))


_SCALARS = (bool, int, float, str, bytes)
#: Replies of this process sent plainly because their caller's deadline had passed.
_counts = {"overdue": 0}
_counts_lock = threading.Lock()


def reply(value: Any, terms: int) -> Any:
    """The callee's result, its large tensors as placeholders when the caller asked
    (``terms``: the call's reply terms, ``_shm.terms``; 0: it did not).

    A result made once the caller's deadline passed (``_shm.overdue``) lends nothing (its
    CUDA tensors are staged): torch RPC would drop it unread, and what it lent would stay
    lent while that caller lives. Counted as ``overdue``. One made before it and carried by
    torch RPC lends segments (and CUDA slabs: ``cuda_ipc_claim``) that come back
    ``_shm._segments.ABANDON_AFTER_S`` after that deadline when still untaken (counted as
    ``abandoned``)."""
    cuda = _cuda_stage.active()  # [cuda hook] (asked first: a CPU-only process's replies stay as fast)
    if (not terms and not cuda) or value is None or type(value) in _SCALARS:  # the common cases, at once
        return value
    if terms and _shm.overdue(terms):
        with _counts_lock:  # (rare: a late reply)
            _counts["overdue"] += 1
        return _cuda_stage.encode(value, 0) if cuda else value
    # Carried by torch RPC, a reply that arrives after the deadline is dropped unread: what
    # it lends is abandoned a while after it (``_shm._segments``). The lane's caller loads
    # a late reply itself.
    give_up = _shm.give_up_time(terms) if terms and not _transport.lane.serving() else 0.0
    if not give_up:
        return _encode_reply(value, terms, cuda)
    before = _shm.lending_until(give_up)
    try:
        return _encode_reply(value, terms, cuda)
    finally:
        _shm.lending_until(before)


def _encode_reply(value: Any, terms: int, cuda: bool) -> Any:
    if cuda:  # [cuda hook] CUDA tensors through IPC or staged; CPU ones as below, in the same walk
        return _cuda_stage.encode(value, _reply_threshold(terms), _cuda_ipc.reply_target(terms),
                                  _shm.split_terms(terms)[1])
    settings = _current
    if settings is None or not settings.enabled:
        return value
    pickled = _blob.whole(value)  # (see outgoing)
    if pickled is not None:
        return pickled
    threshold, caller, _ = _shm.split_terms(terms)
    return _shm.encode(value, max(threshold, settings.threshold), caller)


def _reply_threshold(asked: int) -> int:
    """Bytes from which a reply's CPU tensors go through shared memory; 0: none do."""
    settings = _current
    if not asked or settings is None or not settings.enabled:
        return 0
    return max(asked & _shm.TERMS_MASK, settings.threshold)


def stats() -> Dict[str, Dict[str, int]]:
    """This process's same-host counters: ``shm`` while its World sends through shared
    memory, ``cuda_ipc`` while CUDA tensors may cross through IPC (see
    ``World.transport_stats``)."""
    out: Dict[str, Dict[str, int]] = {}
    settings = _current
    if settings is not None and settings.enabled:
        segments = _shm.cache()
        lent = segments.lent()  # (first: counting may reclaim, and the counters then say so)
        out["shm"] = {**segments.stats, **_counts, "lent": lent, "held_bytes": segments.held_bytes()}
    if _cuda_ipc.enabled():
        out["cuda_ipc"] = _cuda_ipc.stats()
    return out


def _after_fork_in_child() -> None:
    global _current
    _current = None  # a forked child has no World


os.register_at_fork(after_in_child=_after_fork_in_child)


def share(tensor: torch.Tensor) -> torch.Tensor:
    """Let ``tensor`` travel by reference to RpcGroup members and pool workers on this host.

    Moves the tensor's memory into shared memory (in place, once; the tensor keeps
    working) and marks it: from then on, whenever it (or a view of it) is an argument or
    result of a call to a member on this host, or of a pool task, the receiver gets a
    tensor over the *same* memory: no copy, and in-place edits are seen by both sides. A
    tensor received that way travels on by reference too. Keep the tensor alive in the
    sender until the receivers have it. Other tensors are copied, as before.

    Args:
        tensor: A strided CPU tensor without autograd history.

    Returns:
        ``tensor`` itself.

    Raises:
        TypeError: ``tensor`` is not a tensor.
        ValueError: a CUDA, sparse or quantized tensor, one with autograd history, or
            one already shared by name (torch's ``file_system`` strategy).
    """
    return _shm.share(tensor)
