"""Which same-host peers receive CUDA tensors through IPC: asked once, proved by a probe.

The first call from a process that uses CUDA to a same-host peer asks it (``_describe``)
for its *device key* (a digest of the GPUs it sees: two processes that see the same GPUs
have the same key) and the devices it made a context on, and sends a 16-element probe
there and back through IPC (``_probe``) on a device both made one on::

    peer_target(member, pid)    verdict kept? ──► (key, pid) or None (stage)
      ask _describe ── no answer ───────────────► stage; ask again after _UNANSWERED_RETRY_S
                    ── -1 (path off there) ─────► stage for good
                    ── 0 (no CUDA there yet) ───► stage; ask again after _RETRY_S, doubling
                    ── another key ─────────────► stage for good (other GPUs)
                    ── our key, no device both ─► stage; ask again after _RETRY_S, doubling
                       made a context on
                    ── our key ── probe there and back ── equal ──► IPC for good
                                  │                   ├─ no answer in time ──► stage; ask
                                  │                   │                  again after _UNANSWERED_RETRY_S
                                  │                   │                  (not while its probe is unread)
                                  │                   ├─ staged on the way back ──► as not exported
                                  │                   └─ not equal, or an error ──► stage for good
                                  └─ not exported here (staged, or out of memory) ──► stage;
                                                                    ask again after _UNANSWERED_RETRY_S

Both round trips share one bound (``_PROBE_TIMEOUT_S``). The probe never makes a context:
a tensor-free call from a process on ``cuda:0`` to one on ``cuda:1`` would otherwise give
the callee a context on ``cuda:0`` (hundreds of MiB), and every rank of a host one on each
GPU. A peer staged meanwhile gets a context where a tensor lands, and is asked again.

Why a probe and not the key alone: the key says that both processes see the same GPUs,
not that the driver lets one open the other's handles (two containers, for one); the probe
proves that it does. The verdicts
live in ``cuda_ipc._peers`` (bounded; cleared with the path's state).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Dict, List, Optional, Set, Tuple

import torch
from torch.distributed import rpc

from . import cuda_ipc as _ipc
from .cuda_ipc_area import Lease
from .staging import stage_tensor

log = logging.getLogger(__name__)

__all__ = ["peer_target", "export"]

_RETRY_S = 2.0  # a peer without CUDA (yet) or a shared device is asked again after this many seconds,
_RETRY_MOST_S = 60.0  # doubling each time up to this (a CPU-only actor: one question a minute)
_PROBE_TIMEOUT_S = 5.0
_UNANSWERED_RETRY_S = 30.0  # a peer that did not answer the first question is asked again after this
# By (member, pid): the lease of a probe that ran out of time, still lent (the peer may be
# copying out of it). A peer that never reads it is not probed again meanwhile: each probe
# would leave one more slab lent, until every slot of the area was.
_late: Dict[Tuple[str, int], Lease] = {}
# (Callee) by caller pid: the lease of the last probe answered. A caller probes a member
# once at a time (``_probing``), after its last probe's call ended; an answer it has not
# read by then never will be (torch drops a reply past its call's timeout), and would stay
# lent to it: one slab a probe of a peer always late.
_answers: Dict[int, Lease] = {}
_probing: Set[str] = set()  # (caller) members probed now, by any thread
_waits: Dict[str, float] = {}  # (caller) by member: its last wait to be asked again (doubling)
# What a forked child inherited of its parent's probes: kept, never used (as ``cuda_ipc._inherited``;
# a list of its own, so that each module's record of what it inherited stays in one place).
_inherited: List[Tuple[Dict[Tuple[str, int], Lease], Dict[int, Lease]]] = []


def export(tensors: List[torch.Tensor], target: Tuple[int, int]) -> Tuple[List[Any], List[Any]]:
    """``tensors`` (CUDA) as picklable references through IPC, committed (the receiver
    waits for the copies); and their leases. Used by the probe (calls go through ``_cuda_stage.encode``)."""
    batch = _ipc.Batch(target)
    refs = [batch.add(tensor) for tensor in tensors]
    pending: List[torch.device] = []
    leases = batch.commit(refs, stage_tensor, pending)
    try:
        for device in pending:
            _ipc.ops.synchronize(device)
    except BaseException:  # the probe's reply never leaves: its lease ends here
        for lease in leases:
            lease.area.release(lease)
        raise
    return refs, leases


def _describe() -> Tuple[int, int]:
    """(Remote) this process's key when it may receive through IPC, and the devices it made
    a context on (bits, ``ops.context_mask``); key 0: not yet (no CUDA initialised); -1:
    never (the path is off here)."""
    if _ipc._limit <= 0:
        return -1, 0
    key = _ipc.local_key()
    return key, (_ipc.ops.context_mask() if key else 0)


def _probe(tensors: List[torch.Tensor], caller: int) -> Tuple[Any, bool]:
    """(Remote) the probe's second half: check what arrived, send it back through IPC;
    and whether it went back through IPC (an export that failed stages it, and a staged
    probe proves nothing)."""
    probe = tensors[0]
    expected = torch.arange(16, device=probe.device)
    if probe.device != _ipc.ops.device(probe.device.index) or not bool((probe == expected).all()):
        raise RuntimeError(f"the CUDA IPC probe arrived as {probe!r}")
    with _ipc._lock:
        last = _answers.pop(caller, None)
    if last is not None:  # (ended by the caller already, where it read it: the ids are checked)
        last.area.release(last)
    refs, leases = export([probe], (_ipc.local_key(), caller))
    if leases:
        _keep(_answers, caller, leases[0])
    return refs, bool(leases)


def peer_target(member: str, pid: int, deadline: Optional[float] = None) -> Optional[Tuple[int, int]]:
    """``(key, pid)`` to send CUDA tensors to ``member`` through IPC, or None (stage).

    The first time, asks ``member`` for its key and sends a probe both ways (one round
    trip each, ``_PROBE_TIMEOUT_S`` at most for both, and ending by ``deadline``, the
    call's, ``time.monotonic()``; None: no other bound); the verdict is kept.
    """
    if _ipc._limit <= 0 or pid == os.getpid():
        return None
    found = _ipc._peers.get(member)
    if found is not None:
        key, retry = found
        if retry is None or time.monotonic() < retry:
            return (key, pid) if key else None
    mine = _ipc.local_key()
    if not mine:
        return None
    now = time.monotonic()
    deadline = now + _PROBE_TIMEOUT_S if deadline is None else min(now + _PROBE_TIMEOUT_S, deadline)
    if deadline - now < 1e-3:  # no time to ask: this call stages, a later one asks
        return None
    try:
        theirs, devices = rpc.rpc_sync(member, _describe, timeout=deadline - now)
    except Exception:  # not answered (busy, or going): this call stages, a later one asks again
        _note_peer(member, 0, time.monotonic() + _UNANSWERED_RETRY_S)
        _ipc._counts.add("staged_probe_unanswered")
        return None
    if theirs < 0:
        _note_peer(member, 0, None)
        _ipc._counts.add("staged_peer_ipc_off")
        return None
    if theirs == 0:  # no CUDA there yet
        _ask_later(member, "staged_peer_without_cuda")
        return None
    if theirs != mine:
        _note_peer(member, 0, None)
        _ipc._counts.add("staged_peer_other_gpus")
        return None
    index = _shared_device(devices)
    if index is None:  # no device with a context on both sides: none is made for a probe
        _ask_later(member, "staged_peer_on_other_devices")
        return None
    with _ipc._lock:
        held = _late.pop((member, pid), None)
    # (its last probe still unread; one lent by a stopped World's area was lost with it)
    if held is not None and held.area is _ipc._area and held.area.holds(held):
        _keep(_late, (member, pid), held)
        _note_peer(member, 0, time.monotonic() + _UNANSWERED_RETRY_S)
        _ipc._counts.add("staged_probe_unread")
        return None
    with _ipc._lock:
        found = _ipc._peers.get(member)  # (another thread's probe may have ended since)
        if found is not None and (found[1] is None or time.monotonic() < found[1]):
            return (found[0], pid) if found[0] else None
        busy = member in _probing
        _probing.add(member)
    if busy:  # another thread probes it now: this call stages, and asks again once that one ended
        _ipc._counts.add("staged_probe_in_flight")
        return None
    try:
        return _prove(member, pid, mine, index, deadline)
    finally:
        with _ipc._lock:
            _probing.discard(member)


def _shared_device(devices: int) -> Optional[int]:
    """A device both this process and a peer whose contexts are ``devices`` (bits) made a
    context on: this thread's where it is one; None: none."""
    shared = _ipc.ops.context_mask() & devices
    if not shared:
        return None
    current = _ipc.ops.current_index()
    return current if current is not None and shared >> current & 1 else (shared & -shared).bit_length() - 1


def _ask_later(member: str, counted: str) -> None:
    """Stage for ``member`` now and ask it again later, waiting twice as long each time."""
    with _ipc._lock:
        wait = min(2 * _waits.pop(member, _RETRY_S / 2), _RETRY_MOST_S)
    _keep(_waits, member, wait)
    _note_peer(member, 0, time.monotonic() + wait)
    _ipc._counts.add(counted)


def _prove(member: str, pid: int, mine: int, index: int, deadline: float) -> Optional[Tuple[int, int]]:
    """The probe there and back on ``cuda:index``, by ``deadline`` (see ``peer_target``);
    the verdict is kept."""
    try:
        refs, leases = export([torch.arange(16, device=_ipc.ops.device(index))], (mine, pid))
    except Exception:  # (its device is full, or a CUDA error: a call with no tensor must not fail of it)
        leases = []
    left = deadline - time.monotonic()
    if not leases or left < 1e-3:  # not exported here (staged, counted), or no time left: ask again later
        for lease in leases:
            lease.area.release(lease)
        _note_peer(member, 0, time.monotonic() + _UNANSWERED_RETRY_S)
        _ipc._counts.add("staged_probe_not_exported")
        return None
    late = staged = False
    error: Optional[BaseException] = None
    try:
        back, exported = rpc.rpc_sync(member, _probe, args=(refs, os.getpid()), timeout=left)
        staged = not exported  # (no room there, or its export failed: proves nothing either way)
        probe = back[0]
        if probe.is_cuda:  # (raw rpc: nothing ordered this thread's stream after the copy
            # that took the answer in on the default one: a caller on a side stream of its
            # own could read it unwritten, and the peer was staged for good)
            torch.cuda.current_stream(probe.device).wait_stream(torch.cuda.default_stream(probe.device))
        ok = exported and bool((probe.cpu() == torch.arange(16)).all())
    except Exception as exc:
        ok, error = False, exc
        # Out of time proves nothing about IPC (a peer busy starting up, a loaded host):
        # asked again later, as an unanswered question is. Any other failure is the probe's.
        late = time.monotonic() >= deadline
    if not ok:
        if not late:  # the call is over: nobody reads it any more
            for lease in leases:
                lease.area.release(lease)
        if staged:
            _note_peer(member, 0, time.monotonic() + _UNANSWERED_RETRY_S)
            _ipc._counts.add("staged_probe_not_exported")
            return None
        # Out of time, the peer may be copying out of it right now: ended here, the slab
        # could be written by the next message under those copies. It stays lent, ended
        # by the peer once read, or taken back at its death.
        if late:
            _keep(_late, (member, pid), leases[0])
            _note_peer(member, 0, time.monotonic() + _UNANSWERED_RETRY_S)
            _ipc._counts.add("staged_probe_unanswered")
            return None
        _note_peer(member, 0, None)
        why = "came back wrong" if error is None else f"failed: {type(error).__name__}: {error}"
        _ipc._counts.add("staged_probe_failed", 1, f"staged_probe_failed:{type(error).__name__}" if error else None)
        # Once a peer: a slower path for good, which the counters alone would leave unexplained.
        log.warning("CUDA tensors to %s (pid %d) are staged through the CPU from now on: the CUDA IPC probe on "
                    "cuda:%d %s. World(cuda_ipc_cache_bytes=0) stages every CUDA tensor, and says nothing.",
                    member, pid, index, why)
        return None
    _note_peer(member, mine, None)
    return mine, pid


def _note_peer(member: str, key: int, retry: Optional[float]) -> None:
    with _ipc._lock:
        if retry is None:
            _waits.pop(member, None)
        _ipc._peers[member] = (key, retry)
        _ipc._peers.move_to_end(member)
        while len(_ipc._peers) > _ipc._PEERS_KEPT:
            _ipc._peers.popitem(last=False)


def _keep(kept: Dict[Any, Any], key: Any, value: Any) -> None:
    """Keep ``value`` (a lease, a wait) in ``kept`` by ``key``, the oldest going past
    ``_PEERS_KEPT`` (bounded as the verdicts are; under ``cuda_ipc._lock``, as every change
    of ``kept`` is: RPC threads probe and answer at once)."""
    with _ipc._lock:
        kept[key] = value
        while len(kept) > _ipc._PEERS_KEPT:
            kept.pop(next(iter(kept)))


def _after_fork_in_child() -> None:
    """A forked child is not the caller nor the callee of its parent's probes; what they
    lent is kept, never used (``cuda_ipc._after_fork_in_child`` says why)."""
    if _late or _answers:
        _inherited.append((dict(_late), dict(_answers)))
    _late.clear()
    _answers.clear()
    _probing.clear()
    _waits.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
