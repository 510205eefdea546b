"""Functions and objects the pool tests send to workers.

They live here, not in the test modules, so that a worker imports only this light module
(a test module imports pytest). Crashes can be triggered in three phases of a task:
while its arguments are unpickled in the worker (:class:`CrashOnLoad`), while it runs
(:func:`crash`), and while its result is pickled in the worker (:class:`CrashOnDump`).
"""

from __future__ import annotations

import ctypes
import os
import select
import signal
import struct
import sys
import threading
import time

import torch

BLOCK_SECONDS = 120.0  # a task told to wait for a kill never outlives this


def square(x):
    return x * x


def identity(x):
    return x


def pid_of(_=None):
    return os.getpid()


def add(a, b):
    return a + b


def keyword_call(a, b=0, *, c=0):
    return (a, b, c)


def raise_value_error(message="boom from the task"):
    raise ValueError(message)


def fail_on_three(x):
    if x == 3:
        raise ValueError("three is not allowed")
    return x


def ctx_raise(context):
    raise ValueError("boom from the task")


def ctx_fail_on_three(context, x):
    return fail_on_three(x)


def announce(fifo: str) -> None:
    """Write this process's pid into a FIFO the test reads (no polling on either side)."""
    with open(fifo, "w") as stream:
        stream.write(str(os.getpid()))


def crash(kind: str, fifo: str = "") -> None:
    """Fail in the way ``kind`` names, in the calling process."""
    if kind == "exception":
        raise ValueError(f"crash marker: {kind}")
    if kind == "sys.exit":
        sys.exit(3)
    if kind == "os._exit":
        os._exit(5)
    if kind == "segfault":
        ctypes.string_at(0)
    if kind == "sigkill":
        announce(fifo)
        threading.Event().wait(BLOCK_SECONDS)  # until the test kills this process
        os._exit(99)
    raise AssertionError(f"unknown crash kind {kind!r}")


def free_counter(handle: bytes, offset: int) -> int:
    """Take one off slot ``offset`` of a torch reference counted shared-memory file, as a
    CUDA IPC receiver's free does (a stand-in on a box without a GPU); returns ``offset``."""
    fd = os.open("/dev/shm/" + handle.decode().lstrip("/"), os.O_RDWR)
    try:
        where = 64 + 8 * offset  # (after torch's 64-byte header)
        value = struct.unpack("=q", os.pread(fd, 8, where))[0]
        os.pwrite(fd, struct.pack("=q", value - 1), where)
    finally:
        os.close(fd)
    return offset


def announce_then_block(fifo: str, _held=None) -> None:
    """Say 'started' through ``fifo``, then block until killed (holding ``_held``)."""
    crash("sigkill", fifo)


def crash_then_return(kind: str, fifo: str) -> int:
    crash(kind, fifo)
    return 0


class CrashOnLoad:
    """An argument whose unpickling (in the worker) crashes."""

    def __init__(self, kind: str, fifo: str = "") -> None:
        self.kind, self.fifo = kind, fifo

    def __reduce__(self):
        return (crash_then_return, (self.kind, self.fifo))


class CrashOnDump:
    """A result whose pickling (in the worker) crashes."""

    def __init__(self, kind: str, fifo: str = "") -> None:
        self.kind, self.fifo = kind, fifo

    def __reduce__(self):
        crash(self.kind, self.fifo)
        return (CrashOnDump, (self.kind, self.fifo))


def return_crash_on_dump(kind: str, fifo: str = "") -> CrashOnDump:
    return CrashOnDump(kind, fifo)


def take_anything(_argument) -> int:
    return os.getpid()


class Unpicklable:
    def __reduce__(self):
        raise TypeError("Unpicklable objects refuse to be pickled")


def make_generator(_=None):
    return (i for i in range(3))


def generator_at(x):
    return (i for i in range(3)) if x == 2 else x


def wait_on_fifo(fifo: str) -> int:
    """Block until the test writes a line into ``fifo``; return this process's pid."""
    fd = os.open(fifo, os.O_RDONLY)
    try:
        os.read(fd, 3)  # exactly one b"go\n": several workers may wait on one FIFO
    finally:
        os.close(fd)
    return os.getpid()


def announce_then_wait(announce_fifo: str, release_fifo: str) -> int:
    """Say 'started' (pid) through one FIFO, then wait for the test's go on another."""
    announce(announce_fifo)
    return wait_on_fifo(release_fifo)


# ----------------------------------------------------------------------- tensors


def add_one_(tensor: torch.Tensor) -> torch.Tensor:
    tensor.add_(1)
    return tensor


def add_one_at_(tensor: torch.Tensor, index: int) -> None:
    tensor[index] += 1


def add_one_return_sum(tensor: torch.Tensor) -> float:
    tensor.add_(1)
    return float(tensor.sum())


def tensor_sum(tensor) -> float:
    """The sum of a tensor, or of a list of tensors."""
    return sum(float(t.sum()) for t in tensor) if isinstance(tensor, list) else float(tensor.sum())


_kept = {}


def keep_and_return(numel: int) -> torch.Tensor:
    """Return a tensor this worker also keeps (and later edits, see edit_kept)."""
    tensor = torch.zeros(numel)
    _kept["t"] = tensor
    return tensor


def edit_kept(_=None) -> float:
    _kept["t"].add_(7)
    return float(_kept["t"][0])


def storage_is_shared(tensor: torch.Tensor) -> bool:
    return tensor.is_shared()


def make_tensor(numel: int, value: float) -> torch.Tensor:
    return torch.full((numel,), value)


def make_cuda_tensor(numel: int, value: float) -> torch.Tensor:
    return torch.full((numel,), value, device="cuda")


# ----------------------------------------------------------------------- contexts, init

_state = {}


def remember(value) -> None:
    _state["init"] = value


def recall(_=None):
    return _state.get("init")


def failing_initializer():
    raise KeyError("the initializer failed on purpose")


def ctx_and_pid(context, x=None):
    return context, os.getpid(), x


def ctx_add(context, x):
    return context + x


def torch_work(n: int) -> float:
    a = torch.ones(n, n)
    return float((a @ a).sum())


class Counter:
    """A context object with state (edited in place by tasks)."""

    def __init__(self) -> None:
        self.calls = 0


def count_call(counter: Counter, _=None) -> int:
    counter.calls += 1
    return counter.calls


# ----------------------------------------------------------------------- test-side FIFOs


class AnnounceFifo:
    """A FIFO a worker writes its pid into (:func:`announce`); the test reads it.

    Opened for reading before any writer exists, so the writer never blocks and the
    reader waits in select(), bounded by a timeout.
    """

    def __init__(self, path) -> None:
        self.path = str(path)
        os.mkfifo(self.path)
        self._fd = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)

    def read_pid(self, timeout: float = 60.0) -> int:
        """The pid a process wrote, waiting up to ``timeout`` seconds in all.

        ``select`` may call the FIFO readable with nothing to read: once a writer has come
        and gone it reports end of file (``read`` then returns b""), and a writer that
        opens between the two calls turns that into EAGAIN. Both only mean "not yet".
        """
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([self._fd], [], [], remaining)[0]:
                raise TimeoutError(f"no process announced itself on {self.path} within {timeout} s")
            try:
                data = os.read(self._fd, 64)
            except BlockingIOError:  # a writer is there, it has not written yet
                continue
            if data:
                return int(data)  # one short write: atomic on a pipe
            # End of file: a writer left without writing. The FIFO stays "readable" until
            # it is opened afresh (the new descriptor comes first, so a reader always exists).
            fresh = os.open(self.path, os.O_RDONLY | os.O_NONBLOCK)
            os.close(self._fd)
            self._fd = fresh

    def close(self) -> None:
        os.close(self._fd)


class ReleaseFifo:
    """A FIFO a worker blocks on (:func:`wait_on_fifo`) until the test releases it.

    Opened read-write here, so the worker's open never waits for a writer and a release
    sent before the worker got there is not lost.
    """

    def __init__(self, path) -> None:
        self.path = str(path)
        os.mkfifo(self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_NONBLOCK)

    def release(self, times: int = 1) -> None:
        os.write(self._fd, b"go\n" * times)

    def close(self) -> None:
        os.close(self._fd)


class CountingCallable:
    """A callable that counts how often it was pickled (in the pickling process)."""

    pickles = 0

    def __call__(self, x):
        return x + 1

    def __reduce__(self):
        type(self).pickles += 1
        return (CountingCallable, ())


def make_nested_pool_and_map(n: int):
    from machinlike.pool import Pool

    with Pool(1) as inner:
        return inner.map(square, range(n))


# ----------------------------------------------------------------------- same-host shared memory


def shm_stats(_=None) -> dict:
    from machinlike import _shm

    return dict(_shm.cache().stats)


def mappings_of(_tensor: torch.Tensor) -> int:
    """How many mappings of shared storages this worker holds (cached: one per storage)."""
    with open("/proc/self/maps") as maps:
        return sum(1 for line in maps if "/dev/shm/torch_" in line)


def kill_self_holding(tensor) -> None:
    assert float((tensor[0] if isinstance(tensor, list) else tensor)[0]) == 5.0
    os.kill(os.getpid(), signal.SIGKILL)


def reverse_copy(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.flip(0).contiguous()


def cuda_views(tensor: torch.Tensor, param: torch.nn.Parameter):
    """Returns what it was given through CUDA IPC (the tensor, a view of it, the
    Parameter) next to a tensor it made itself."""
    tensor.add_(1)
    return tensor, tensor[2:6], param, tensor * 2


def add_one_to_each(items):
    """Edits each received tensor in place (its own copy) and returns them: a copy-mode
    pool's worker must not reach the caller's tensors."""
    for item in items:
        if isinstance(item, torch.Tensor):
            item.add_(1)
        else:
            item += 1
    return items


def frames_or_generator(i: int):
    """32 frames of 64 KB (packed into one segment), or for 2 something no pickler takes."""
    if i == 2:
        return (x for x in range(3))
    return [torch.full((16384,), float(i)) for _ in range(32)]


def lent_segments(_=None) -> int:
    from machinlike import _shm

    return _shm.cache().lent()


def layout_of(tensor: torch.Tensor):
    """What a worker got: strides, storage bytes, sum; and the tensor itself back."""
    return tuple(tensor.stride()), tensor.untyped_storage().nbytes(), float(tensor.sum()), tensor


def _claims_cuda(reduce):
    """``reduce`` (a tensor copy reducer), its tensors reduced as a CUDA tensor's are: to be
    rebuilt on cuda:0 (what a worker on a GPU sends; this box has none)."""
    from machinlike._reductions import copy as copy_reductions

    def claimed(tensor):
        rebuild, args = reduce(tensor)
        if rebuild is copy_reductions._rebuild_tensor_copy:
            args = args[:5] + ("cuda:0",) + args[6:]
        return rebuild, args

    return claimed


def raise_holding_a_cuda_tensor(_=None):
    """Raise an exception holding a tensor that this process pickles as a CUDA tensor: both
    the copy table and the reducer the report's CPU table defers to claim cuda:0."""
    from machinlike._reductions import copy as copy_reductions
    from machinlike.pickle import Pickler

    original = copy_reductions._reduce_tensor_copy
    Pickler._copy_table[torch.Tensor] = _claims_cuda(original)
    copy_reductions._reduce_tensor_copy = _claims_cuda(original)
    raise ValueError("a bad batch", torch.arange(3.0))


def raise_with_a_real_cuda_tensor(_=None):
    """Raise an exception holding a CUDA tensor made in this worker."""
    raise ValueError("a bad batch", torch.arange(3.0, device="cuda"))
