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

A ``get`` timeout bounds the whole read: an item whose writer is slow, stopped or was killed
in the middle of it raises ``TimeoutError`` in time, and what arrived is kept, so the next
``get`` of this process goes on with the same item (abandoning it half-read would corrupt
the pipe for everyone; ``_pipe_read``). Meanwhile this process keeps the read lock: other
consumers wait (their own timeouts bound that). A writer killed in the middle of ``put``
still leaves its item torn and the write lock taken (later ``put(timeout=)`` calls time
out), as with any pipe-based queue; pools and launchers watch process sentinels for that.
So does a consumer killed in the middle of ``get``: the read lock stays taken, and a later
``get`` says so when an item is waiting (a consumer that may be killed reads its own
:class:`SimpleP2PQueue`).

Items that are put but never read keep their shared tensors' memory alive until the
process tree exits (torch's shared-memory manager then cleans up).
"""

from __future__ import annotations

import builtins
import multiprocessing
import threading
import time
from multiprocessing import connection, context
from multiprocessing.context import BaseContext
from typing import Any, Dict, Optional, Tuple, Union

from . import _checks
from ._pipe_read import PartialItem, read_item
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


def _read(reader: connection.Connection, item: PartialItem, timeout: Optional[float], what: str,
          stated: Optional[float] = None) -> bytearray:
    """The next item's bytes within ``timeout`` (None: no bound); one that began arriving
    and did not end stays in ``item``, and the next read goes on with it. ``stated``: the
    caller's timeout, for messages (None: ``timeout``)."""
    stated = timeout if stated is None else stated
    started = item.pending
    data = read_item(reader.fileno(), None if timeout is None else time.monotonic() + timeout, item)
    if data is not None:
        return data
    if not item.pending:
        raise _timeout_error(what, stated or 0.0)
    raise TimeoutError(f"{what} timed out after {stated or 0.0:g} s in the middle of an item ({item.describe()} "
                       f"arrived{' by now' if started else ''}): its writer is slow, stopped or was killed; the "
                       f"next get() goes on with it")


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
        state = self.__dict__.copy()
        for mine in ("_item", "_reading"):  # (this process's read in progress)
            state.pop(mine, None)
        return state

    def _partial(self) -> PartialItem:
        """This process's item in progress (made on first use: a child starts with none)."""
        item = self.__dict__.get("_item")
        if item is None:
            item = self.__dict__.setdefault("_item", PartialItem())
        return item

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
            timeout: Seconds to wait for an item, its bytes included; None waits
                indefinitely. An item cut short by the timeout is kept and the next
                ``get`` goes on with it (see the module doc).

        Raises:
            TimeoutError: no item arrived within ``timeout``.
            EOFError: every writing end of the queue was closed.
        """
        timeout = _checks.seconds_or_none("timeout", timeout, allow_zero=True)
        deadline = None if timeout is None else time.monotonic() + timeout
        reading = self.__dict__.get("_reading") or self.__dict__.setdefault("_reading", threading.Lock())
        if not reading.acquire(True, -1 if timeout is None else timeout):
            raise _timeout_error("SimpleQueue.get()", timeout or 0.0)
        try:
            item = self._partial()
            # An item this process began to read holds the read lock until it is whole.
            if not item.pending and not self._rlock.acquire(True, None if deadline is None
                                                            else max(0.0, deadline - time.monotonic())):
                raise self._lock_held(timeout or 0.0)
            try:
                data = _read(self._reader, item, None if deadline is None else max(0.0, deadline - time.monotonic()),
                             "SimpleQueue.get()", timeout)
            except BaseException:
                if not item.pending:
                    self._rlock.release()
                raise
            self._rlock.release()
        finally:
            reading.release()
        return loads(data)


    def _lock_held(self, timeout: float) -> TimeoutError:
        """The timeout of a ``get`` that never had the read lock: "no item" only when none
        is waiting (cold trial 30: a consumer SIGKILLed in ``get`` kept the lock for good,
        and every later ``get`` said it waited for an item while one was there)."""
        try:
            waiting = self._reader.poll(0)
        except (OSError, EOFError):
            waiting = False
        if not waiting:
            return _timeout_error("SimpleQueue.get()", timeout)
        return TimeoutError(f"SimpleQueue.get() timed out after waiting {timeout:g} s for the read lock while an "
                            f"item is waiting: another consumer holds the lock (it reads a large item from a slow "
                            f"writer, or it died while reading, which leaves the queue unreadable for good: make a "
                            f"new queue)")

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
            timeout: Seconds to wait for an item, its bytes included; None waits
                indefinitely. An item cut short by the timeout is kept and the next
                ``get`` goes on with it (see the module doc).

        Raises:
            TimeoutError: no item arrived within ``timeout``.
            EOFError: the writing end was closed.
        """
        return loads(_read(self._reader, self._partial(), _checks.seconds_or_none("timeout", timeout, allow_zero=True),
                           "SimpleP2PQueue.get()"))


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
            timeout: Seconds to wait for an item, its bytes included; None waits
                indefinitely. An item cut short by the timeout is kept and the next
                ``get`` goes on with it (see the module doc).

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
        deadline = None if timeout is None else time.monotonic() + timeout
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
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                return index, self._queues[index].get(left)  # (its bytes within the same deadline)
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

