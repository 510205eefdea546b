"""Inter-process queues whose items travel through :mod:`machinlike.pickle`.

* :class:`SimpleQueue`: many producers and many consumers, a pipe guarded by a write lock
  and a read lock (no feeder thread: ``put`` writes in the caller's thread, so a returned
  ``put`` means the bytes are in the pipe).
* :class:`SimpleP2PQueue`: exactly one writing and one reading process, a bare pipe.
* :class:`MultiP2PQueue`: N point-to-point channels, addressed by index, with
  :meth:`MultiP2PQueue.get_any` waiting on all of them at once.

Each queue pickles items with ``copy_tensor`` as given: False (default) shares tensors
(CPU shared memory, CUDA IPC), True copies them. Queues are handed to child processes as
process arguments (pickling them any other way raises ``RuntimeError``).

``put`` writes in the caller's thread, so an item larger than the pipe's buffer (64 KiB
on Linux) returns only once a reader has taken most of it. Two processes that both put
large items to each other before reading would wait on each other forever: read results
in another thread than the one that puts work (as ``multiprocessing.Pool`` does).

Timeouts bound the wait for an item to *begin* arriving; an item whose bytes are already
flowing is read to its end (abandoning it half-read would corrupt the pipe for everyone).
A process killed in the middle of ``put`` or ``get`` therefore breaks the queue (a torn
item, or a lock never released), as with any pipe-based queue; pools and launchers watch
process sentinels for that.

Items that are put but never read keep their shared tensors' memory alive until the
process tree exits (torch's shared-memory manager then cleans up).
"""

from __future__ import annotations

import builtins
import multiprocessing
import time
from multiprocessing import connection, context
from multiprocessing.context import BaseContext
from typing import Any, Dict, Optional, Tuple, Union

from . import _checks
from ._warm import resolve_context
from .pickle import dumps, loads

__all__ = ["SimpleQueue", "SimpleP2PQueue", "MultiP2PQueue", "TimeoutError"]

_NO_OBJECT: Any = object()  # MultiP2PQueue.put without obj: machin's put(obj), told apart


class TimeoutError(multiprocessing.TimeoutError, builtins.TimeoutError):  # noqa: A001 - machin's name
    """No item (or no lock) within the timeout.

    Both ``multiprocessing.TimeoutError`` (what machin's ``machin.parallel.queue.TimeoutError``
    was) and the built-in ``TimeoutError``, so code written for either catches it.
    """


def _check_copy_tensor(copy_tensor: Any) -> bool:
    if not isinstance(copy_tensor, bool):
        raise TypeError(f"copy_tensor must be a bool, not {type(copy_tensor).__name__}")
    return copy_tensor


def _timeout_error(what: str, timeout: float) -> TimeoutError:
    return TimeoutError(f"{what} timed out after waiting {timeout:g} s for an item")


def _discard(data: bytes, copy_tensor: bool) -> None:
    """Release what an undelivered share-mode payload holds (loading it drops the refs)."""
    if copy_tensor:
        return
    try:
        loads(data)
    except Exception:  # best effort: the caller reports its own error
        pass


def _recv(reader: connection.Connection, timeout: Optional[float], what: str) -> bytes:
    if timeout is not None and not reader.poll(timeout):
        raise _timeout_error(what, timeout)
    return reader.recv_bytes()


class _PipeQueue:
    """What the pipe-backed queues share: their two pipe ends, and passing them to a child."""

    _reader: connection.Connection
    _writer: connection.Connection

    def empty(self) -> bool:
        """Whether no item is waiting (a snapshot: another consumer may take it first)."""
        return not self._reader.poll()

    def close(self) -> None:
        """Close this process's ends of the pipe; idempotent."""
        self._reader.close()
        self._writer.close()

    def __getstate__(self) -> Dict[str, Any]:
        context.assert_spawning(self)  # only to a child being started, like multiprocessing's
        return self.__dict__.copy()

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)


class SimpleQueue(_PipeQueue):
    """A queue between processes: many producers, many consumers.

    Args:
        ctx: Multiprocessing context for the locks: None for the warm forkserver (spawn
            where unavailable), a start method name or a context.
        copy_tensor: False shares tensors by reference (CPU shared memory, CUDA IPC);
            True copies their data into each item.

    Raises:
        TypeError: ``copy_tensor`` is not a bool or ``ctx`` has a wrong type.
        ValueError: ``ctx`` names an unknown start method.
    """

    def __init__(self, *, ctx: Union[None, str, BaseContext] = None, copy_tensor: bool = False) -> None:
        ctx = resolve_context(ctx)
        self._copy_tensor = _check_copy_tensor(copy_tensor)
        self._reader, self._writer = ctx.Pipe(duplex=False)
        self._rlock = ctx.Lock()
        self._wlock = ctx.Lock()

    @property
    def copy_tensor(self) -> bool:
        """Whether tensors are copied (True) or shared (False)."""
        return self._copy_tensor

    def put(self, obj: Any, timeout: Optional[float] = None) -> None:
        """Append ``obj``.

        Args:
            obj: Anything :func:`machinlike.pickle.dumps` pickles.
            timeout: Seconds to wait for the write lock (another producer may be writing
                a large item); None waits as long as that takes.

        Raises:
            TimeoutError: the write lock was not free within ``timeout``.
            pickle.PicklingError, TypeError: ``obj`` cannot be pickled (nothing is sent).
        """
        timeout = _checks.seconds_or_none("timeout", timeout, allow_zero=True)
        data = dumps(obj, copy_tensor=self._copy_tensor)
        if not self._wlock.acquire(True, timeout):
            _discard(data, self._copy_tensor)
            raise TimeoutError(f"SimpleQueue.put() timed out after waiting {timeout:g} s for the write lock")
        try:
            self._writer.send_bytes(data)
        except BaseException:
            _discard(data, self._copy_tensor)
            raise
        finally:
            self._wlock.release()

    def get(self, timeout: Optional[float] = None) -> Any:
        """Remove and return the oldest item.

        Args:
            timeout: Seconds to wait for an item to begin arriving; None waits
                indefinitely. An item whose bytes began to arrive is read to its end
                (see the module doc: a writer killed or stopped in the middle of a
                large ``put`` holds this read until it goes on, or for good).

        Raises:
            TimeoutError: no item arrived within ``timeout``.
            EOFError: every writing end of the queue was closed.
        """
        timeout = _checks.seconds_or_none("timeout", timeout, allow_zero=True)
        if timeout is None:
            with self._rlock:
                data = self._reader.recv_bytes()
        else:
            deadline = time.monotonic() + timeout
            if not self._rlock.acquire(True, timeout):
                raise _timeout_error("SimpleQueue.get()", timeout)
            try:
                if not self._reader.poll(max(0.0, deadline - time.monotonic())):
                    raise _timeout_error("SimpleQueue.get()", timeout)
                data = self._reader.recv_bytes()
            finally:
                self._rlock.release()
        return loads(data)


    def quick_put(self, obj: Any) -> None:
        """machin's lock-free ``put`` for a single producer thread: :meth:`put` here (its
        lock costs microseconds, and two producers cannot corrupt the queue)."""
        self.put(obj)

    def quick_get(self, timeout: Optional[float] = None) -> Any:
        """machin's lock-free ``get`` for a single consumer thread: :meth:`get` here."""
        return self.get(timeout)


class SimpleP2PQueue(_PipeQueue):
    """A queue between exactly one writing and one reading process; no locks.

    Two writers (or two readers) at the same time corrupt it; use :class:`SimpleQueue`
    for that.

    Args:
        ctx: Multiprocessing context (see :class:`SimpleQueue`); only its ``Pipe`` is used.
        copy_tensor: See :class:`SimpleQueue`.

    Raises:
        TypeError: ``copy_tensor`` is not a bool or ``ctx`` has a wrong type.
        ValueError: ``ctx`` names an unknown start method.
    """

    def __init__(self, *, ctx: Union[None, str, BaseContext] = None, copy_tensor: bool = False) -> None:
        ctx = resolve_context(ctx)
        self._copy_tensor = _check_copy_tensor(copy_tensor)
        self._reader, self._writer = ctx.Pipe(duplex=False)

    @property
    def copy_tensor(self) -> bool:
        """Whether tensors are copied (True) or shared (False)."""
        return self._copy_tensor

    @property
    def reader(self) -> connection.Connection:
        """The reading end, for ``multiprocessing.connection.wait``."""
        return self._reader

    def put(self, obj: Any) -> None:
        """Append ``obj``.

        Args:
            obj: Anything :func:`machinlike.pickle.dumps` pickles.

        Raises:
            pickle.PicklingError, TypeError: ``obj`` cannot be pickled (nothing is sent).
        """
        data = dumps(obj, copy_tensor=self._copy_tensor)
        try:
            self._writer.send_bytes(data)
        except BaseException:
            _discard(data, self._copy_tensor)
            raise

    def get(self, timeout: Optional[float] = None) -> Any:
        """Remove and return the oldest item.

        Args:
            timeout: Seconds to wait for an item to begin arriving; None waits
                indefinitely. An item whose bytes began to arrive is read to its end
                (see the module doc: a writer killed or stopped in the middle of a
                large ``put`` holds this read until it goes on, or for good).

        Raises:
            TimeoutError: no item arrived within ``timeout``.
            EOFError: the writing end was closed.
        """
        return loads(_recv(self._reader, _checks.seconds_or_none("timeout", timeout, allow_zero=True), "SimpleP2PQueue.get()"))


class MultiP2PQueue:
    """``queue_num`` point-to-point channels: ``put(i, obj)``, ``get(i)``, ``get_any()``.

    Channel ``i`` has one writer and one reader (e.g. the pool and its worker ``i``).
    :meth:`get_any` blocks on all channels at once (``multiprocessing.connection.wait``)
    and serves ready channels in turn, so a busy channel cannot starve the others.

    Args:
        queue_num: Number of channels (>= 1).
        ctx: See :class:`SimpleQueue`.
        copy_tensor: See :class:`SimpleQueue`.

    Raises:
        TypeError: ``queue_num`` is not an int, ``copy_tensor`` not a bool, ``ctx`` of a
            wrong type.
        ValueError: ``queue_num`` < 1, or ``ctx`` names an unknown start method.
    """

    def __init__(
        self, queue_num: int, *, ctx: Union[None, str, BaseContext] = None, copy_tensor: bool = False
    ) -> None:
        if isinstance(queue_num, bool) or not isinstance(queue_num, int):
            raise TypeError(f"queue_num must be an int, not {type(queue_num).__name__}")
        if queue_num < 1:
            raise ValueError(f"queue_num must be >= 1, got {queue_num}")
        ctx = resolve_context(ctx)
        self._queues = [SimpleP2PQueue(ctx=ctx, copy_tensor=copy_tensor) for _ in range(queue_num)]
        self._next = 0  # the channel get_any serves first
        self._next_put = 0  # the channel quick_put fills next

    def __len__(self) -> int:
        return len(self._queues)

    def __getitem__(self, index: int) -> SimpleP2PQueue:
        return self._queues[index]

    def get_sub_queue(self, index: int) -> SimpleP2PQueue:
        """Channel ``index`` (machin's name for ``self[index]``).

        Args:
            index: Channel number, ``0 <= index < len(self)``.
        """
        return self._queues[index]

    def put(self, index: int, obj: Any = _NO_OBJECT) -> None:
        """Append ``obj`` to channel ``index``.

        Args:
            index: Channel number.
            obj: Anything :func:`machinlike.pickle.dumps` pickles.

        Raises:
            IndexError: no such channel.
            TypeError: ``obj`` is missing (machin's ``put(obj)`` is :meth:`quick_put`).
        """
        if obj is _NO_OBJECT:
            raise TypeError(f"MultiP2PQueue.put(index, obj) takes the channel first, and got only "
                            f"{type(index).__name__} {index!r}: pass put(channel, obj), or quick_put(obj) to "
                            f"spread items over the channels in turn (machin's put)")
        self._channel(index).put(obj)

    def quick_put(self, obj: Any) -> None:
        """Append ``obj`` to the next channel in turn (machin's ``quick_put``: round robin)."""
        index = self._next_put
        self._next_put = (index + 1) % len(self._queues)
        self._queues[index].put(obj)

    def quick_get(self, timeout: Optional[float] = None) -> Any:
        """The oldest item of any channel that has one (machin's ``quick_get``):
        :meth:`get_any` without the channel number.

        Raises:
            TimeoutError: no channel had an item within ``timeout`` seconds.
        """
        return self.get_any(timeout)[1]

    def get(self, index: int, timeout: Optional[float] = None) -> Any:
        """Remove and return the oldest item of channel ``index``.

        Args:
            index: Channel number.
            timeout: Seconds to wait for an item to begin arriving; None waits
                indefinitely. An item whose bytes began to arrive is read to its end
                (see the module doc: a writer killed or stopped in the middle of a
                large ``put`` holds this read until it goes on, or for good).

        Raises:
            IndexError: no such channel.
            TimeoutError: nothing arrived on it within ``timeout`` seconds.
        """
        return self._channel(index).get(timeout)

    def get_any(self, timeout: Optional[float] = None) -> Tuple[int, Any]:
        """Wait for an item on any channel.

        Args:
            timeout: Seconds to wait; None waits indefinitely.

        Returns:
            ``(index, item)``, which channel answered and its oldest item.

        Raises:
            TimeoutError: no channel had an item within ``timeout``.
        """
        timeout = _checks.seconds_or_none("timeout", timeout, allow_zero=True)
        readers = [q.reader for q in self._queues]
        ready = connection.wait(readers, timeout)
        if not ready:
            raise _timeout_error("MultiP2PQueue.get_any()", timeout or 0.0)
        ready_ids = {id(r) for r in ready}
        count = len(readers)
        for offset in range(count):
            index = (self._next + offset) % count
            if id(readers[index]) in ready_ids:
                self._next = (index + 1) % count
                return index, loads(readers[index].recv_bytes())
        raise AssertionError("unreachable: wait() returned a reader that is not ours")  # pragma: no cover

    def close(self) -> None:
        """Close this process's ends of every channel; idempotent."""
        for queue in self._queues:
            queue.close()

    def _channel(self, index: int) -> SimpleP2PQueue:
        if isinstance(index, bool) or not isinstance(index, int):
            raise TypeError(f"index must be an int, not {type(index).__name__}")
        if not 0 <= index < len(self._queues):
            raise IndexError(f"index {index} is out of range for {len(self._queues)} channels")
        return self._queues[index]

    def __getstate__(self) -> Dict[str, Any]:
        context.assert_spawning(self)
        return {"_queues": self._queues, "_next": 0, "_next_put": 0}

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)

