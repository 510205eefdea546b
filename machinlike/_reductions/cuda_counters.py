"""torch's CUDA IPC reference counters, read and given back for a receiver that never will.

torch keeps a shared CUDA tensor's memory in the sending process until a reference
counter in shared memory drops to zero (torch's note "CUDA IPC Refcounting implementation
explained")::

    sender                                           receiver
    reduce: new counter = 1 ──── payload names it ──> load: opens the memory
    memory held while the counter is above 0         its tensor freed: counter -= 1
                    <──── torch.cuda.ipc_collect() frees what reads 0

Only a receiver's free gives the reference back, so memory leaks in the sender for good
when nobody ever loads the payload, and when its receiver dies holding it (SIGKILL, or an
exit that skipped its deleters). Whoever knows that neither can happen any more (a pool
whose worker ended, a ``Process`` whose child ended) gives back what is still counted::

    never delivered                       ─┐
    delivered to a receiver that has ended ─┴─> counter still above 0? -1, then ipc_collect

Reading the counter first keeps that exact: a receiver that did free it already is not
counted twice (a count below zero would keep the memory for good). Callers read only after
every process that could still free it has ended, so nothing races the read.

:func:`collecting` gathers the counters one pickling hands out (``reduce_tensor_share``
notes each); the process pool tracks its own through its codec.

The counter's layout (an ``int64`` array after the 64-byte header of torch's reference
counted shared memory, ``map_alloc_alignment``) is torch's, not a promise: the first
counter this process reads must say 1 (what a fresh share sets), or nothing is ever
released but those never delivered, which need no read (``disabled()``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
import threading
from typing import Any, Callable, Dict, Iterable, Iterator, List, NamedTuple, Optional, Tuple

import torch
from torch.multiprocessing import reductions as _torch_red

__all__ = [
    "CudaCounter", "counter_of", "counters_of", "counters_in", "read_counter", "release_unheld", "disabled", "stats",
    "collecting", "note", "record", "give_back",
]

log = logging.getLogger(__name__)

# torch's RefcountedMapAllocator keeps a header (the mappers' count) this long before the
# data, and CUDA IPC counters are the data's int64s.
_HEADER = 64
_SHM_DIR = "/dev/shm"
# A counter above this is not a count of receivers: the layout is not the one assumed.
_SANE = 1 << 20


class CudaCounter(NamedTuple):
    """One CUDA IPC reference of a payload: torch's counter file and slot."""

    handle: bytes
    offset: int


def counter_of(reduced: Tuple[Any, ...]) -> Optional[CudaCounter]:
    """The counter a CUDA tensor's reduction (``(rebuild_cuda_tensor, args)``) names; None
    for an empty tensor (nothing shared) or another reduction."""
    func, args = reduced[0], reduced[1]
    if func is not _torch_red.rebuild_cuda_tensor or args[7] is None or not args[8]:
        return None
    handle, offset = args[11], args[12]
    if not isinstance(handle, bytes) or not handle:
        return None
    counter = CudaCounter(handle, int(offset))
    _verify_layout(counter)
    return counter


def counters_of(reduced: Tuple[Any, ...]) -> List[CudaCounter]:
    """The counters a tensor's reduction names: its own (a dense CUDA tensor), or its
    parts' (torch reduces a sparse or nested tensor's parts inside its own reducer and
    lists each as ``rebuild_cuda_tensor, args`` among its arguments)."""
    counter = counter_of(reduced)
    if counter is not None:
        return [counter]
    args = reduced[1] if len(reduced) > 1 and isinstance(reduced[1], tuple) else ()
    found = []
    for func, part in zip(args, args[1:]):
        if func is _torch_red.rebuild_cuda_tensor and isinstance(part, tuple):
            counter = counter_of((func, part))
            if counter is not None:
                found.append(counter)
    return found


def counters_in(kept: Iterable[Any]) -> Tuple[CudaCounter, ...]:
    """The CUDA counters among what a pickling tracked."""
    return tuple(k for k in kept if isinstance(k, CudaCounter))


def read_counter(counter: CudaCounter) -> Optional[int]:
    """The counter's value; None when its file is gone (its sender let go of it)."""
    name = counter.handle.decode("ascii", "replace").lstrip("/")
    try:
        fd = os.open(os.path.join(_SHM_DIR, name), os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, 8, _HEADER + 8 * counter.offset)
    finally:
        os.close(fd)
    if len(raw) != 8:
        return None
    return struct.unpack("=q", raw)[0]


class _State:
    """What this process learned and did: the layout check and the counts."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.checked = False
        self.disabled = False
        self.counts: Dict[str, int] = {"released": 0, "already_freed": 0, "unreadable": 0}


_state = _State()


def _verify_layout(counter: CudaCounter) -> None:
    if _state.checked:
        return
    value = read_counter(counter)  # a fresh share: torch set it to 1
    with _state.lock:
        if _state.checked:
            return
        _state.checked = True
        if value != 1:
            _state.disabled = True
            log.warning(
                "CUDA IPC reference counters are not laid out as this machinlike expects (a fresh "
                "share reads %r, not 1): the pool and Process cannot give back the GPU memory that "
                "workers or children held when they died; upgrade machinlike for this torch %s",
                value, torch.__version__,
            )


def disabled() -> bool:
    """Whether the layout check failed (then only references never delivered are given
    back: the others would need a read)."""
    return _state.disabled


def stats() -> Dict[str, int]:
    """Counts of this process: ``released`` (references given back for a receiver that
    never will), ``already_freed`` (its receiver had), ``unreadable`` (skipped: the
    counter read out of range, or the layout check failed and it may have been delivered)."""
    with _state.lock:
        return dict(_state.counts)


def _torch_release(counter: CudaCounter) -> None:  # (looked up per call: tests stand in for it)
    # Torch internal (CUDA builds); what a receiver's free calls.
    torch.UntypedStorage._release_ipc_counter_cuda(counter.handle, counter.offset)


def give_back(counter: CudaCounter) -> None:
    """Take one reference off ``counter`` now, as a receiver's free does (for a receiver
    that knows it holds one it will not free: a second reduction of a storage it has)."""
    _torch_release(counter)


def release_unheld(
    counters: Iterable[CudaCounter], release: Optional[Callable[[CudaCounter], None]] = None,
    *, delivered: bool = True,
) -> int:
    """Give back each reference still counted. Call it only once no process that loaded
    the payloads can free them any more (never delivered, or their receiver has ended).

    Args:
        counters: The references.
        release: What takes one off (None: torch's).
        delivered: Whether a receiver may have had them. False (never sent, or sent and
            dropped unread): each still holds exactly its one reference, so it is given
            back even where the layout check failed and the counters cannot be read.

    Returns:
        How many were given back; then torch frees what nobody holds any more.
    """
    torch_release = release is None
    take_off = _torch_release if release is None else release
    released = 0
    for counter in counters:
        if _state.disabled:
            value = None if delivered else 1  # (unread: nobody else could have taken it off)
        else:
            value = read_counter(counter)
        if value is None or value == 0:
            _count("already_freed" if value == 0 else "unreadable")
            continue
        if not 0 < value < _SANE:
            _count("unreadable")
            continue
        try:
            take_off(counter)  # (one payload, one receiver: it reads 1)
        except RuntimeError:
            _count("unreadable")
            continue
        released += 1
        _count("released")
    if released and torch_release and torch.cuda.is_initialized():
        torch.cuda.ipc_collect()  # free what reads 0 now, not at the next share
    return released


def _count(what: str) -> None:
    with _state.lock:
        _state.counts[what] += 1


class _Collector(threading.local):
    def __init__(self) -> None:
        self.counters: Optional[List[CudaCounter]] = None


_collector = _Collector()


@contextlib.contextmanager
def collecting() -> Iterator[List[CudaCounter]]:
    """Gather the counters of what is pickled in this thread meanwhile (the list yielded;
    an outer collection sees none of them)."""
    outer = _collector.counters
    counters: List[CudaCounter] = []
    _collector.counters = counters
    try:
        yield counters
    finally:
        _collector.counters = outer


def note(reduced: Tuple[Any, ...]) -> None:
    """(a reducer) Record the counter a CUDA tensor's reduction names, if collecting."""
    if _collector.counters is not None:
        _collector.counters.extend(counters_of(reduced))


def record(counter: CudaCounter) -> None:
    """Record ``counter``, if collecting."""
    if _collector.counters is not None:
        _collector.counters.append(counter)
