"""The shared memory of a hosted model chain, reused from superseded states.

Why: a model server's host copies each pushed state into shared memory of its own, so that
the pulls of this host read it in place. Fresh memory for each push was most of a push
(see ``_shm._recycled``); the memory of a state that nothing holds any more (not the chain,
whose newest two versions it keeps, nor a reply being sent, nor a checkpoint being
written) is rewritten instead::

    push ─► adopt(key, state) ─► per large tensor, the slot (key, name, bytes):
              fewer than KEEP storages ─► make one (shared, seqlock header)
              else a storage of the slot that only the slot holds, least recently written
                  first ─► rewrite it under its seqlock ─► the state's tensor views it
              KEEP of them, all held ─► fresh memory, not kept (as before)
    pull on this host ─► the reply names the storage and its sequence; the puller's
              load_state_dict copies it, then checks that the sequence did not move
              (PushPullModelServer retries a pull whose state was rewritten meanwhile)

Each kept storage holds an open file and stays in /dev/shm while the pool lives: a pool
keeps at most an eighth of the process's allowance of open files (``ulimit -n``) and a
quarter of /dev/shm, and a slot it has no room for gets fresh memory each time.

A reader is only ever overtaken when KEEP - 2 newer versions were made while it read: a
slot's storages are reused in turn, and the chain holds the newest two. Other readers of
the hosted chain (its ordered server's ``pull``) get the same memory unchecked: the chain's
values are the model server's, read through its ``pull``.

A state's CUDA tensors (of ``SHARE_FROM`` bytes or more on a device) are copied into a
pinned slab of the CUDA IPC path instead (``distributed._calls.cuda_ipc_pin``): same-host
pulls read them in place, and the host's GPU memory is those slabs, however many pull.

A gradient server's primary publishes each step's parameters through :meth:`StatePool.snapshot`
(a CPU copy of live tensors, on any device, into the same kind of slots), so that its pulls
too read the host's memory in place; :func:`load_whole` is the pullers' side of both servers.
"""

from __future__ import annotations

import resource
import threading
from typing import Any, Callable, Dict, Hashable, List, Mapping, Optional, Tuple

import torch

from .. import _shm
from .._reductions import shm_space
from ..distributed._calls import PinnedStates
from ._budget import CallBudget

__all__ = ["StatePool", "SHARE_FROM", "kept_most", "load_whole", "unchanged"]

# Not World's shm_threshold: each storage a pool keeps holds an open file (see kept_most),
# and a model's many small tensors would each hold one.
SHARE_FROM = 1 << 20
KEEP = 4  # storages per slot: the chain's two, one being written, one a late reader may still read
_SLOTS_MAX = 1024  # slots are per key and tensor name: a model has a fixed set of them
_KEPT_MOST = 4096  # storages a pool keeps at most where open files are unlimited


def kept_most() -> int:
    """Storages a pool keeps at most: each holds an open file, and the process shares its
    allowance (``ulimit -n``) with torch's agent, the store and its peers: an eighth of it."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return _KEPT_MOST if soft == resource.RLIM_INFINITY else max(KEEP, min(_KEPT_MOST, soft // 8))

Slot = Tuple[Hashable, str, int]


def unchanged(state: Mapping[str, Any]) -> bool:
    """Whether every tensor of a pulled ``state`` still holds what was sent (see the module doc)."""
    return all(_shm.recycled.unchanged(value) for value in state.values() if isinstance(value, torch.Tensor))


def load_whole(pull: Callable[[], Optional[Tuple[Dict[str, Any], Any]]], load: Callable[[Dict[str, Any]], None],
               mark: Callable[[Any], None], budget: CallBudget) -> bool:
    """Pull and load states until one was loaded whole (a puller of a hosted chain).

    Args:
        pull: The newest state and its version; None when the puller has that version.
        load: Loads a pulled state into the puller's model (raising before it loads
            anything when the state does not fit).
        mark: Sets the model's version; None: it holds a mix of versions.
        budget: The pull's budget (its message says what happened when it runs out).

    Returns:
        True if a state was loaded, False if the puller had the newest version.
    """
    torn = False
    while True:
        got = pull()
        if got is None:
            return False
        state, version = got
        load(state)
        if unchanged(state):
            mark(version)
            return True
        # The host rewrote the memory of this state while it was read (newer versions were
        # made meanwhile): the model holds a mix, so it has no version until a whole newest
        # state is loaded (within the same budget).
        mark(None)
        if not torn:
            budget.then("the host rewrote the model's memory while this puller read it, newer versions "
                        "coming faster than it reads; the model holds a mix of versions and no version")
        torn = True


def _dense(tensor: torch.Tensor) -> bool:
    """Whether a live tensor may be copied into a slot (any device): strided, plain values."""
    return tensor.layout == torch.strided and not (tensor.is_quantized or tensor.is_nested or tensor.is_conj()
                                                   or tensor.is_neg())


def _gpu_index(tensor: torch.Tensor) -> Optional[int]:
    """The CUDA device index of a tensor a pinned slab may hold; None: any other."""
    if not tensor.is_cuda or tensor.layout != torch.strided or type(tensor) is not torch.Tensor \
            or tensor.requires_grad or tensor.is_quantized or tensor.is_nested or tensor.is_conj() or tensor.is_neg():
        return None
    return tensor.device.index


class StatePool:
    """The ``adopt`` hook of a hosted model chain (see the module doc); ``close()`` it with
    its host. Without recycling on this machine (``_shm.recycled.supported``), each push
    gets fresh memory.

    Args:
        most: Storages kept at most, all slots together (each holds an open file); past
            it a slot without storages gets fresh memory each time. None: :func:`kept_most`
            (read when the pool is made: the World raised the soft limit by then).
        most_bytes: Bytes of them at most; None: a quarter of /dev/shm (unbounded where
            its size cannot be read).
    """

    def __init__(self, most: Optional[int] = None, most_bytes: Optional[int] = None) -> None:
        self._lock = threading.Lock()
        self._most = kept_most() if most is None else most
        self._most_bytes = (shm_space.size() // 4 or None) if most_bytes is None else most_bytes
        self._kept = 0  # storages in all slots
        self._kept_bytes = 0
        self._slots: Dict[Slot, List[torch.UntypedStorage]] = {}  # least recently written first
        self._recycle = _shm.recycled.supported()
        self._cuda = PinnedStates()

    def close(self) -> None:
        """Stop reusing memory; tensors that view it keep it alive as long as they live."""
        with self._lock:
            slots, self._slots, self._recycle, self._kept, self._kept_bytes = self._slots, {}, False, 0, 0
        for storages in slots.values():
            for storage in storages:
                _shm.recycled.forget(storage)
        self._cuda.close()

    def __call__(self, key: Hashable, value: Any) -> Any:
        """A pushed state dict, its large CPU tensors copied into memory shared by reference
        and its CUDA ones (1 MiB or more on a device) into a pinned slab.

        A pushed state is never edited afterwards by anyone but this pool (once no one holds
        it), and a pull never hands the received tensors to the user.
        """
        if not isinstance(value, dict):
            return value
        adopted = {}
        on_gpus: Dict[int, List[str]] = {}
        for name, tensor in value.items():
            index = _gpu_index(tensor) if isinstance(tensor, torch.Tensor) else None
            if index is not None:
                on_gpus.setdefault(index, []).append(name)
            # (eligible first: a sparse tensor has no nbytes)
            elif isinstance(tensor, torch.Tensor) and _shm.shm_eligible(tensor) and tensor.nbytes >= SHARE_FROM \
                    and not tensor.requires_grad:
                copied = self._copy(key, name, tensor)
                if copied is not None:  # (else pulls copy it out of the pushed state)
                    tensor = copied
            adopted[name] = tensor
        for names in on_gpus.values():
            if sum(adopted[name].nbytes for name in names) >= SHARE_FROM:
                views = self._cuda.adopt(key, [adopted[name] for name in names])
                adopted.update(zip(names, views or ()))
        return adopted

    def snapshot(self, key: Hashable, tensors: Mapping[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """A CPU copy of live ``tensors`` (a managed model's parameters, on any device) for
        the chain under ``key``: each dense one of ``SHARE_FROM`` bytes or more copied into a
        slot's memory (reused as a pushed state's), the rest into fresh private memory (as
        without a pool: pulls copy it into their replies).

        The copy is the caller's to store; nothing here keeps ``tensors``.
        """
        out = {}
        for name, tensor in tensors.items():
            tensor = tensor.detach()
            copied = self._copy(key, name, tensor, fresh=False) if _dense(tensor) and tensor.nbytes >= SHARE_FROM \
                else None
            out[name] = copied if copied is not None else tensor.to("cpu", copy=True)
        return out

    def pinned(self) -> int:
        """Pinned CUDA slabs held (see the module doc)."""
        return self._cuda.held()

    def _copy(self, key: Hashable, name: str, tensor: torch.Tensor, fresh: bool = True) -> Optional[torch.Tensor]:
        """``tensor`` copied into shared memory (a slot's, else fresh unless not ``fresh``);
        None: not copied (no room, or no slot's memory and not ``fresh``)."""
        nbytes = tensor.nbytes
        with self._lock:  # (a storage is chosen and held by its view before another push looks)
            storage, made = self._take((key, name, nbytes))
            if storage is not None:
                view = self._view(storage, _shm.recycled.HEADER, tensor)
        if storage is None:
            if not fresh:
                return None
            if not shm_space.has_room(nbytes):
                shm_space.warn_by_value(nbytes, "a pushed model's tensor")
                return None
            view = self._view(torch.UntypedStorage._new_using_fd_cpu(nbytes), 0, tensor)  # (by descriptor: see make)
            view.copy_(tensor)
            return _shm.share(view)
        with _shm.recycled.rewrite(storage):
            view.copy_(tensor)
        return _shm.share(view) if made else view

    def _take(self, slot: Slot) -> Tuple[Any, bool]:
        """A storage of ``slot`` to write (and whether it is new), or None: make fresh memory."""
        if not self._recycle:
            return None, False
        storages = self._slots.get(slot)
        if storages is None:
            if len(self._slots) >= _SLOTS_MAX:
                return None, False
            storages = self._slots[slot] = []
        # KEEP of them first, then in turn: a state's memory is rewritten only after KEEP - 2
        # newer states were made (the chain holds two), which is a late reader's time.
        nbytes = slot[2] + _shm.recycled.HEADER
        within = self._kept < self._most and (self._most_bytes is None
                                               or self._kept_bytes + nbytes <= self._most_bytes)
        if len(storages) < KEEP and within and shm_space.has_room(nbytes):
            try:
                storage = _shm.recycled.make(slot[2])
            except RuntimeError:  # (out of open files or shared memory now: not kept)
                return None, False
            storages.append(storage)
            self._kept += 1
            self._kept_bytes += nbytes
            return storage, True
        for i, storage in enumerate(storages):
            if _shm.recycled.use_count(storage) == 1:  # only this list holds it: no state, reply or checkpoint
                storages.append(storages.pop(i))
                return storage, False
        return None, False

    @staticmethod
    def _view(storage: torch.UntypedStorage, offset: int, like: torch.Tensor) -> torch.Tensor:
        # torch's stubs lack the (UntypedStorage, offset, size) overload of set_
        return torch.empty(0, dtype=like.dtype).set_(  # type: ignore[call-overload]
            storage, offset // like.element_size(), like.shape)
