"""Reply leases of the CUDA export area that come back once their caller gave up on them.

Why: torch RPC drops a reply that arrives after its caller's deadline without unpickling
it, so nobody takes the slab (or pinned slab's reader row) the reply was lent, and it
stayed lent while that caller lived: a learner whose calls time out now and then filled
``cuda_ipc_cache_bytes`` with lost replies and staged through the CPU from then on. The
CPU path (``machinlike._shm._segments``) abandons such a lease ``ABANDON_AFTER_S`` after
the caller's deadline, under a claim its receiver takes it by. This is the same for the
rows of the control page, with one lock per row: an open-file-description (OFD) lock on
the row's bytes, which the receiver takes through a descriptor of its own, so that it
excludes the sender's, and which goes with the receiver's death::

    sender (``ExportArea``, under its lock)           receiver (``_receive_group``, give_up > 0)
    lease/share under ``_shm.lending_until``:         open /proc/<sender>/fd/<page> (its own)
      noted: row ─► (lease id, bare taker pid,        lock the row's bytes, non-blocking, retried
      give_up)                                          ``CLAIM_WAIT_S`` at most (the sender holds
    each reclaim past give_up, the row still            it for two reads and a write)
      (lease id, bare taker pid), not being          row[0] == lease id and the slab the one named?
      written: lock the row's bytes, non-blocking       yes: row[1] = its identity: taken
        held ─► skipped (its receiver takes it now)     no: TimeoutError (abandoned; past give_up)
        got ─► check again, row[0] = FREE, unlock;    close (unlocks)
        a slab row's next writer orders its copies
        after the lost message's (``Slab.unsent``)

Why the claim need not cover the receiver's copies out of the slab: only an untaken lease
is abandoned. Once its receiver wrote its identity the lease is the releaser's, as every
other: FREE once the copies out completed (``cuda_ipc_release``), or reclaimed at the
receiver's death. An untaken lease is told apart by its taker word: still the bare pid the
sender wrote, where a receiver writes its identity (pid and start time, ``machinlike._pids``);
a taker whose start time cannot be read (the two alike) is never abandoned.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct
import time
from typing import Container, Dict, List, Tuple

import numpy as np

from ..._pids import identity, own_identity
from ..._shm import ABANDON_AFTER_S
from ..._shm._peer_fd import open_peer_fd, retry_within
from .cuda_ipc_slab import Slab

__all__ = ["CLAIM_WAIT_S", "Claims", "take"]

#: Seconds a receiver retries at most for a row's claim (the sender holds it for two reads
#: and a write: a wait this long means the sender is stopped).
CLAIM_WAIT_S = 1.0
FREE = 0  # (``cuda_ipc_area.FREE``: that module imports this one)
_FLOCK = struct.Struct("hhqqi4x")  # struct flock: l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
_ROW_BYTES = 4 * 8  # (``cuda_ipc_area.WORDS`` int64 words)


def _lock(fd: int, row: int, on: bool = True) -> bool:
    """Take (``on``) or let go the OFD lock on ``row``'s bytes through ``fd``, without
    waiting; whether it was taken (False: another open description holds it)."""
    kind = fcntl.F_WRLCK if on else fcntl.F_UNLCK
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, row * _ROW_BYTES, _ROW_BYTES, 0))
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


class Claims:
    """The leases of one export area that may be abandoned (see the module docstring):
    row ─► (lease id, bare taker pid, give-up time). At most one per row of the page.
    Used under the area's lock; counts each lease it ends in ``stats["abandoned"]`` (the area's).
    """

    def __init__(self, stats: Dict[str, int]) -> None:
        self._rows: Dict[int, Tuple[int, int, float]] = {}
        self._stats = stats

    def __len__(self) -> int:
        return len(self._rows)

    def note(self, row: int, lease: int, taker: int, give_up: float) -> None:
        """Lease ``lease`` of ``row``, lent to process ``taker`` (a bare pid), is abandoned
        once ``give_up`` (``time.monotonic()`` s) passed with it untaken; 0: never."""
        if give_up:
            self._rows[row] = (lease, taker, give_up)
        else:
            self._rows.pop(row, None)

    def abandon(self, words: np.ndarray, fd: int, writing: Container[int], slabs: List[Slab]) -> bool:
        """End the noted leases whose give-up time passed while they stayed untaken, through
        the page ``words`` (descriptor ``fd``), except rows in ``writing`` (their sender still
        queues copies into them); whether any ended. Those whose receiver holds the claim now
        are left for a later call. A slab of ``slabs`` whose own lease ended is marked
        ``unsent``: the copies into it were never seen to run, so its next writer orders its
        own after them."""
        if not self._rows:
            return False
        now = time.monotonic()
        ended = []
        for row, (lease, taker, give_up) in list(self._rows.items()):
            if int(words[row, 0]) != lease or int(words[row, 1]) != taker:
                del self._rows[row]  # ended, reclaimed or taken: never abandoned
                continue
            if now < give_up or row in writing:
                continue
            if identity(taker) == taker:  # (its start time cannot be read: taken or not, the word is the same)
                del self._rows[row]
                continue
            if not _lock(fd, row):
                continue  # its receiver is taking it this very moment
            try:
                if int(words[row, 0]) == lease and int(words[row, 1]) == taker:
                    words[row, 0] = FREE
                    ended.append(row)
            finally:
                _lock(fd, row, on=False)
            del self._rows[row]
        for slab in slabs if ended else ():
            slab.unsent = slab.unsent or slab.slot in ended
        self._stats["abandoned"] += len(ended)
        return bool(ended)


def take(pid: int, fd: int, inode: int, words: np.ndarray, at: int, slot: int, slab_id: int, lease: int,
         give_up: float) -> None:
    """Name this process the taker of ``lease`` in row ``at`` of process ``pid``'s control
    page ``words`` (descriptor ``fd``, ``inode``), lent slab ``slot`` (``slab_id``); under
    the row's claim when the sender may abandon it (``give_up`` > 0: when it does).

    Raises:
        RuntimeError: the lease ended or its slab was retired (the sender's World stopped).
        TimeoutError: the sender abandoned the lease (this reply was loaded more than
            ``ABANDON_AFTER_S`` past its call's deadline), or held the claim past
            ``CLAIM_WAIT_S``.
    """
    handle = open_peer_fd(pid, fd, inode, "the CUDA export area") if give_up else -1
    try:
        if handle >= 0 and not retry_within(lambda: _lock(handle, at), CLAIM_WAIT_S):
            raise TimeoutError(f"process {pid} held the claim on row {at} of its CUDA export area for "
                               f"{CLAIM_WAIT_S} s (stopped?): the reply through it cannot be loaded")
        if int(words[slot, 2]) != slab_id or int(words[at, 0]) != lease:
            if give_up and time.monotonic() >= give_up:
                raise TimeoutError(
                    f"a reply was loaded more than {ABANDON_AFTER_S} s after its call's deadline, and its sender "
                    f"(process {pid}) had taken back the CUDA memory it lent for it: the call is lost. A process "
                    f"that loads its replies that late is stalled (its RPC threads wait for the GIL)")
            raise RuntimeError(
                f"the CUDA tensors process {pid} sent were released before this receiver loaded them "
                f"(slab {slot}: the lease ended or the sender's World stopped)")
        words[at, 1] = own_identity()  # (the sender wrote a bare pid: a pid reused once this process died is not it)
    finally:
        if handle >= 0:
            os.close(handle)  # (unlocks)
