"""CUDA tensors between the processes of one host through CUDA IPC, at device speed.

In a call's arguments, a service's result, a paired value or a remote result, a CUDA
tensor bound for a process on this host that uses the same GPUs crosses as a slab of the
sender's export area (``_cuda_ipc_area``) instead of being staged through pinned CPU
memory (``_cuda_stage``)::

    sender                                         receiver (same host, same GPUs)
    walk (``_cuda_stage.encode``): cuda:i tensors
      of the message ─► Batch, by device
    commit: lease one slab per device,             unpickling: _receive_group(...)
      copy each tensor into it (device to            map the sender's control page and open
      device), record the slab's IPC event           the slab and its event (all cached),
      ``ready`` (no wait) ───────────────────────►   check the lease, wait until ``ready``
    pickled: the lease, the slab's handles,          completed (CPU polls: usually done),
      each tensor's offset, shape, dtype             copy each tensor out into memory of
                                                     its own on cuda:i, record an event:
                                                     lease FREE once it completed
                                                     (``cuda_ipc_release``, a thread)

Why nobody waits for the GPU on a message's path: on a GPU time-sliced between processes,
each wait for the other process's copies costs a switch of contexts (about 150 us). The
sender's copies run while the message travels; the receiver's copies out are ordered on
the unpickling thread's current stream (the default one), and the caller's current
stream is ordered after it when the result reaches the caller (``cuda_settle``): what it
received is ready on its stream as any torch op's result is.

The receiver owns what it gets (its own allocation, sendable on); the sender's tensor is
never shared: its copy into the slab is ordered on the sender's current stream, so it may
be reused or freed once the call returned (work on another stream waits for that one).

When IPC is used (else staging, as before, counted in ``stats``):
  - the World allows it (``same_host_shm`` and ``cuda_ipc_cache_bytes`` > 0), the peer
    shares this host (``_samehost``) and is another process;
  - requests: the callee proved it once (``cuda_ipc_peers.peer_target``): it answers its *device key*
    (a digest of its visible GPUs' UUIDs, in order; 0 without CUDA) equal to ours, then a
    probe tensor crosses both ways. A callee that had not initialised CUDA is asked again
    after ``cuda_ipc_peers._RETRY_S`` (CUDA is never initialised in it for our sake), one that did not
    answer after ``cuda_ipc_peers._UNANSWERED_RETRY_S``; a failed probe stages for good;
  - replies: the caller put its key and pid into the call's reply terms (``terms``), which
    it does only for a callee that passed the probe; the callee checks the key is its own.
Anything else (no room in the area, a tensor that is sparse or quantized, an export that
fails) stages that device's tensors of the message instead; nothing raises.

Limits: tensors are found where the staging walk finds them (``_shm._walk``); views of one
storage arrive as separate tensors; processes that see different GPUs, or the same GPUs
in a different order (``CUDA_VISIBLE_DEVICES``), stage. Between hosts nothing changes.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import os
import sys
import threading
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .cuda_ipc_area import FREE, UNSETTLED, ExportArea, Lease
from .cuda_ipc_claim import take
from .cuda_ipc_open import Opened, OpenCache, forget_frames
from .cuda_ipc_outliving import Outliving
from .cuda_ipc_refs import Group as _Group, Ref as _Ref
from .cuda_ipc_release import Releaser, await_ready
from . import cuda_ipc_ops as ops
from .cuda_settle import noted
from .strides import kept_strides
from ..._pids import pid_of
from ..._shm import TERMS_MASK, lending_give_up, split_terms as _shm_split_terms, terms as _shm_terms
from ..._tally import Tally

__all__ = ["configure", "close", "released", "before_call", "enabled", "stats", "local_key", "terms", "split_terms",
           "reply_target", "Batch", "eligible", "unsent_release", "forget_dead", "TERMS_MASK", "export_area"]

_ALIGN = 512  # each tensor's offset in a slab: any dtype's alignment, and the copy kernels'
_PEERS_KEPT = 4096
_READY_WAIT_S = 120.0  # a receiver waits this long at most for a live sender's copies
_CLOSE_DRAIN_S = 5.0  # World stop: seconds at most for this process's pending releases
# World stop: seconds at most for peers to end what they were lent (copying out takes
# milliseconds; a lease whose message was lost stays lent, so not longer).
_CLOSE_LENT_S = 0.5

_lock = threading.Lock()
_limit = 0
_area: Optional[ExportArea] = None
_outliving = Outliving()  # closed areas whose slabs are still lent to live receivers
_exit_hook = False
_opened: Optional[OpenCache] = None
_releaser = Releaser()
_key: Optional[int] = None
_counts = Tally()
# By RPC worker name: (its key, or 0 for "stage", retry time or None for "final").
_peers: "OrderedDict[str, Tuple[int, Optional[float]]]" = OrderedDict()


def configure(limit: int) -> None:
    """Set the bound, in bytes, of the export area and of the openings cache (0: IPC off)."""
    global _limit
    _limit = limit
    if _area is not None:
        _area.limit = limit
    if _opened is not None:
        _opened.limit = limit
    _outliving.sweep()  # (a World starts here again: what its predecessor still lent may have come back)


def enabled() -> bool:
    """Whether this process may send CUDA tensors through IPC at all."""
    return _limit > 0


def close() -> None:
    """Retire this process's slabs (one still lent to a live receiver once it comes back:
    ``cuda_ipc_outliving``) and drop its openings and peer verdicts (World stop); the path
    stays off until the next ``configure``."""
    global _area, _limit
    with _lock:
        _limit = 0  # (a send still in flight stages: no new area is made after this one)
        area, _area = _area, None
        _peers.clear()
    _releaser.close(_CLOSE_DRAIN_S)  # (leases this process still reads end before its openings go)
    _outliving.close(area, _CLOSE_LENT_S, _counts)
    if _opened is not None:
        _opened.forget_all()


def released(timeout: float) -> bool:
    """Wait, ``timeout`` seconds at most, until every lease this process received is FREE
    again (each ends once its copies out completed, in a thread of its own)."""
    return _releaser.drain(timeout)


def before_call(pid: int) -> None:
    """End this process's leases of process ``pid``'s slabs before calling it (bounded:
    ``cuda_ipc_release.FLUSH_S``), so that its reply finds the last one FREE."""
    _releaser.flush(pid)


def export_area() -> ExportArea:
    """This process's export area (made at its first use).

    Raises:
        RuntimeError: the path is off (``configure(0)``, or closed by a World's stop).
    """
    global _area, _exit_hook
    with _lock:
        if _area is None:
            if _limit <= 0:
                raise RuntimeError("the CUDA IPC path is off in this process (its World stopped, or "
                                   "cuda_ipc_cache_bytes=0)")
            _area = ExportArea(_limit, lambda: _outliving.outside())  # (read at each use: forks swap it)
            if not _exit_hook:  # once, lazily: a process that exits without stopping its World
                _exit_hook = True  # retires its slabs itself (torch would report them as leaked)
                atexit.register(_close_at_exit)
        return _area


def _close_at_exit() -> None:
    try:
        close()
        _outliving.sweep(force=True)  # (the process ends: its memory goes with it, lent or not)
    except Exception:  # interpreter exit: CUDA may already be torn down
        pass


def _open_cache() -> OpenCache:
    global _opened
    with _lock:
        if _opened is None:
            _opened = OpenCache(_limit)
        return _opened


def forget_dead() -> int:
    """Drop openings of slabs whose owner died or retired them; how many went."""
    return 0 if _opened is None else _opened.forget_dead()


def stats() -> Dict[str, int]:
    """Counters of this process: tensors and bytes sent and received through IPC, and
    each reason a CUDA tensor was staged through the CPU instead (``staged_*``)."""
    out = _counts.snapshot()
    if _area is not None:
        lent = _area.lent()  # (first: counting reclaims, and what it reclaims is counted below)
        out.update({f"area_{k}": v for k, v in _area.stats.items()})
        out["area_held_bytes"] = _area.held_bytes()
        out["area_lent"] = lent
    out["outliving_bytes"] = _outliving.held_bytes()  # (closed areas' slabs still lent)
    out.update(_releaser.stats)
    out["release_pending"] = _releaser.pending()
    if _opened is not None:
        out.update({f"opened_{k}": v for k, v in _opened.stats.items()})
        out["opened_held_bytes"] = _opened.held_bytes()
        out["opened_slabs"] = len(_opened)
    return out


# ------------------------------------------------------------------------- peers
def local_key() -> int:
    """This process's device key: a digest of its visible GPUs' UUIDs; 0 before CUDA."""
    global _key
    if _key is not None:
        return _key
    if not torch.cuda.is_initialized():
        return 0
    names = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        # A torch without device UUIDs: names and sizes (the probe still proves each peer).
        names.append(str(getattr(props, "uuid", None) or f"{props.name}/{props.total_memory}/{i}"))
    digest = hashlib.blake2b("|".join(names).encode(), digest_size=5).digest()
    _key = int.from_bytes(digest, "little") | 1
    return _key


def terms(threshold: int, target: Optional[Tuple[int, int]], due: Optional[float] = None) -> int:
    """The reply terms of a call (``_shm._terms``): the shm ``threshold``, this process's
    identity, the call's deadline ``due`` (``time.monotonic()``; None: none) and, when the
    callee may reply through IPC (``target`` known), its key."""
    return _shm_terms(threshold, local_key() if target is not None else 0, due)


def split_terms(reply: int) -> Tuple[int, int, int]:
    """``(threshold, caller pid, caller key)`` of reply terms (pid and key 0 when absent)."""
    threshold, who, key = _shm_split_terms(reply)
    return threshold, pid_of(who), key


def reply_target(reply: int) -> Optional[Tuple[int, int]]:
    """``(key, pid)`` to reply to through IPC, or None (stage)."""
    if _limit <= 0:
        return None
    _, pid, key = split_terms(reply)
    if not key or key != local_key() or pid == os.getpid():
        return None
    return key, pid


# ----------------------------------------------------------------------- sender
def eligible(tensor: torch.Tensor) -> bool:
    """Whether a CUDA tensor may cross through a slab (else it is staged)."""
    return tensor.layout == torch.strided and not tensor.is_quantized and not tensor.is_nested


class Batch:
    """The CUDA tensors of one message bound for ``target`` (``(key, pid)``)."""

    __slots__ = ("target", "groups")

    def __init__(self, target: Tuple[int, int]) -> None:
        self.target = target
        self.groups: Dict[int, _Group] = {}

    def add(self, tensor: torch.Tensor) -> _Ref:
        index = tensor.device.index
        group = self.groups.get(index) or self.groups.setdefault(index, _Group(index))
        group.tensors.append(tensor)
        return _Ref(group, len(group.tensors) - 1)

    def commit(self, refs: List[_Ref], stage: Any, pending: List[torch.device]) -> List[Lease]:
        """Copy each group into a leased slab; a group without one is staged (``stage(tensor,
        pending)``, counted). ``pending`` gets each device to synchronise before sending
        (staged copies; a slab's copies only where it has no IPC event)."""
        leases: List[Lease] = []
        try:
            for group in self.groups.values():
                lease = self._fill(group)
                if lease is None:
                    for ref in refs:
                        if ref.group is group:
                            ref.staged = stage(group.tensors[ref.i], pending)
                    continue
                leases.append(lease)
                if lease.slab.ready is None:  # no IPC event: the copies complete before sending
                    device = ops.device(group.index)
                    if device not in pending:
                        pending.append(device)
        except BaseException:  # a later device's staging failed: this message never leaves,
            for lease in leases:  # and the slabs it leased would stay lent until World stop
                lease.area.release(lease)
            raise
        return leases

    def _fill(self, group: _Group) -> Optional[Lease]:
        layout = []
        offset = 0
        for tensor in group.tensors:
            layout.append(offset)
            offset += -(-tensor.nbytes // _ALIGN) * _ALIGN
        try:
            area = export_area()
            # A state kept in a pinned slab (a model server's version) is read in place.
            give_up = lending_give_up()  # (a reply carried by torch RPC: abandoned if lost, ``cuda_ipc_claim``)
            found = area.in_place(group.tensors, self.target[1], give_up)
            lease: Optional[Lease] = found[0] if found else area.lease(group.index, max(offset, 1), self.target[1],
                                                                       give_up)
            layout = found[1] if found else layout
        except Exception as exc:  # allocation or export refused: this message stages
            _counts.add("staged_export_failed", 1, f"staged_export_failed:{type(exc).__name__}")
            return None
        if lease is None:
            _counts.add("staged_no_room", len(group.tensors))
            return None
        slab = lease.slab
        copy = found is None
        try:
            if copy and area.unsettled(slab):  # copies of a message whose lease ended early may be queued
                ops.after_writes(slab)
            items = []
            for start, tensor in zip(layout, group.tensors):
                shape, strides = tuple(tensor.shape), kept_strides(tensor)
                if tensor.nbytes and copy:  # (in the tensor's own layout: a plain copy of its bytes)
                    ops.view(slab.views, slab.storage, group.index, start, tensor.dtype, shape, strides).copy_(
                        tensor.detach() if tensor.requires_grad else tensor)
                items.append((start, shape, tensor.dtype, tensor.requires_grad, type(tensor) is torch.nn.Parameter,
                              strides))
            if copy:
                ops.copied_here(group.tensors, group.index)  # (the message lets them go below)
                if area.pinned_among(group.tensors):
                    # A pinned state copied rather than read in place (no reader row was free):
                    # record_stream does nothing for exported memory, and a push on another
                    # thread's stream may rewrite the slab once the message lets it go.
                    ops.synchronize(ops.device(group.index))
            if slab.ready is not None and copy:
                ops.mark_ready(slab)
        except BaseException as exc:
            if copy:  # some copies may be queued on this thread's stream: they end first
                with contextlib.suppress(Exception):
                    ops.synchronize(ops.device(group.index))
            area.release(lease)  # (not yet in ``commit``'s leases: it would stay lent to a live receiver)
            if not isinstance(exc, Exception):  # Ctrl-C and the like: the message never leaves
                raise
            _counts.add("staged_export_failed", 1, f"staged_export_failed:{type(exc).__name__}")
            return None
        finally:
            if copy:  # (written, or given up: a dead taker's lease may be reclaimed from now on)
                area.filled(lease)
        _counts.add("sent_tensors", len(group.tensors), "sent_bytes", offset)
        group.tensors = []  # copied: the message no longer holds the sender's tensors
        group.reduced = (_receive_group, (os.getpid(), area.fd, area.inode, slab.slot, slab.ident, lease.ident,
                                          group.index, slab.handle, slab.ready_handle, slab.offset, slab.capacity,
                                          slab.mapped, tuple(items), -1 if copy else lease.row, lease.give_up))
        return lease


def unsent_release(lease: Lease) -> Callable[[], None]:
    """What ends ``lease`` if its message is never pickled whole (``_shm.guard`` calls it
    then, from a garbage collection): it comes FREE again instead of staying lent to a
    receiver that will never take it (until that receiver died or this World stopped)."""
    return functools.partial(lease.area.release_unsent, lease)


# --------------------------------------------------------------------- receiver
def _receive_group(pid: int, fd: int, inode: int, slot: int, slab_id: int, lease: int, index: int, handle: bytes,
                   ready: bytes, offset: int, capacity: int, mapped: int, items: Tuple[Tuple[Any, ...], ...],
                   lease_row: int = -1, give_up: float = 0.0) -> List[torch.Tensor]:
    """(Unpickling) copy a leased slab's tensors into this process's memory on ``cuda:index``;
    they are ready on this thread's current stream of ``cuda:index`` and, once the result
    reaches the caller, on the caller's (``cuda_settle``); the lease (in the slab's own row,
    or in reader row ``lease_row`` of a pinned slab) ends once the copies completed, in the
    releaser's thread. ``give_up`` > 0: the lease is taken under its claim (``cuda_ipc_claim``)."""
    if not ops.cuda_ready():  # the sender checked; never initialise CUDA for it
        raise RuntimeError(
            f"process {pid} sent CUDA tensors through CUDA IPC to this process, which has not "
            f"initialised CUDA (a stale verdict of the sender's); nothing was received"
        )
    cache = _open_cache()
    words = cache.control(pid, fd, inode)
    at = slot if lease_row < 0 else lease_row
    row, slab_row = words[at], words[slot]
    take(pid, fd, inode, words, at, slot, slab_id, lease, give_up)
    handed = False
    copying = False
    opened: Optional[Opened] = None
    try:
        opened = _opening(cache, pid, words, slot, slab_id, index, handle, ready, offset, capacity, mapped)
        if ready and await_ready(opened.ready, pid, slab_row, slab_id, _READY_WAIT_S,
                                 lambda sender: cache.alive(sender, inode)):
            _counts.add("ready_waits")
        # (No device guard: each op below runs on its tensors' device by itself.)
        out: List[torch.Tensor] = []
        total, copying = 0, True
        for start, shape, dtype, requires_grad, parameter, strides in items:
            own = _own_copy(ops.view(opened.views, opened.storage, index, start, dtype, shape, strides))
            total += own.nbytes
            if parameter:
                own = torch.nn.Parameter(own, requires_grad=requires_grad)
            elif requires_grad:
                own.requires_grad_(True)
            out.append(own)
        _releaser.put(ops.copies_done(opened, index), row, lease, pid)
        noted(index)  # (the caller's stream waits for these copies: cuda_settle)
        handed = True
    finally:
        if not handed:
            if copying:  # copies may be queued: they end before the slab is lent again
                try:
                    ops.synchronize(ops.device(index))
                except Exception:
                    pass
            # The raised error's traceback keeps this frame and those it called: their
            # references to the opening would keep the handle open after the lease ends
            # (the sender may retire the slab then, and new memory come behind the same
            # handle bytes), and let it go later from any thread, on the default stream.
            opened = None
            forget_frames(sys.exc_info()[1])
            if int(row[0]) == lease:
                if lease_row < 0 and not copying:  # the sender's copies in were not seen to run: its next writer waits
                    slab_row[3] = UNSETTLED
                row[0] = FREE  # the sender may lend the slab again
    _counts.add("received_tensors", len(out), "received_bytes", total)
    return out


def _own_copy(view: torch.Tensor) -> torch.Tensor:
    """``view`` (over a peer's slab) cloned into this process's memory, one call (allocation
    and copy), in the sender's layout (clone keeps a dense tensor's strides).

    A function of its own so that no local of the receiving frame holds a view of the
    opening once its copies are queued: were the cache to evict it and the releaser let it
    go meanwhile, the frame's end would free the peer's memory from the receiving thread,
    on its default stream (``Opened.__del__`` frees it on an idle one)."""
    return view.clone() if view.nbytes else torch.empty(view.shape, dtype=view.dtype, device=view.device)


def _opening(cache: OpenCache, pid: int, words: Any, slot: int, slab_id: int, index: int, handle: bytes,
             ready: bytes, offset: int, capacity: int, mapped: int) -> Opened:
    """The sender's slab opened here (cached), its event opened too when it has one.

    Raises:
        RuntimeError: the memory or the event cannot be opened (named, with the fix).
    """
    try:
        opened = cache.open((pid, handle, offset), capacity, words, slot, slab_id,
                            lambda: ops.open_shared(index, handle, capacity, offset), index, mapped)
        if ready and opened.ready is None:
            opened.ready = ops.open_event(index, ready)
        return opened
    except Exception as exc:  # the probe opened this sender's memory once; now it cannot
        _counts.add("open_failed")
        raise RuntimeError(
            f"cannot open the CUDA memory process {pid} exported for this call (cuda:{index}, "
            f"{capacity} bytes): {type(exc).__name__}: {exc}. World(cuda_ipc_cache_bytes=0) stages "
            f"CUDA tensors through the CPU instead"
        ) from exc


# What a forked child inherited of its parent's CUDA IPC state, kept alive and never used.
_inherited: List[Any] = []


def _after_fork_in_child() -> None:
    """The parent's slabs and openings are not this process's, and CUDA is unusable in a
    forked child: start afresh. Why the old objects are kept (``_inherited``) rather than
    dropped: the last reference to an opened slab runs torch's deleter, which synchronises a
    stream and closes the IPC handle through CUDA calls that fail in a forked child, inside
    a destructor that may not throw (``std::terminate``: a DataLoader worker forked by a
    learner that had received CUDA tensors would abort at once)."""
    global _lock, _area, _opened, _key, _releaser, _counts, _outliving
    _inherited.append((_area, _opened, _releaser, _outliving))
    _outliving = Outliving()
    _lock = threading.Lock()
    _releaser = Releaser()  # (the parent's thread is not running here)
    _area = None
    _opened = None
    _key = None
    _counts = Tally()
    _peers.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
