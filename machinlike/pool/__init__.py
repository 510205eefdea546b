"""Process and thread pools for PyTorch: lambdas, tensor policies, crash-proof workers.

Five configurations of one engine (``_core`` for processes, ``_thread`` for threads)
behind the standard pool API (``_api``)::

    Pool           processes, stdlib-like scheduling (a short per-worker window for calls)
    P2PPool        processes, deep private channels + work stealing
    CtxPool        Pool whose worker i calls func(context_i, ...)
    ThreadPool     threads; nothing is serialised
    CtxThreadPool  ThreadPool whose thread i calls func(context_i, ...)

Every call of the standard ``multiprocessing.Pool`` works (``apply``, ``apply_async``
with ``callback``/``error_callback``, ``map``, ``map_async``, ``imap``, ``imap_unordered``,
``starmap``, ``starmap_async``, ``close``, ``terminate``, ``join``, context manager), plus
``size()``. ``imap`` is lazy for every chunk size.

Process pools
-------------
* Start: the warm forkserver by default (torch preloaded, ~30-70 ms per worker, as safe as
  spawn: workers never fork a threaded or CUDA-initialised parent). ``ctx=`` picks another
  multiprocessing context.
* Functions: lambdas, local functions and closures travel by value (dill;
  ``is_recursive=True`` for closures over unpicklable module globals). A map's function
  is pickled once per call and installed once per worker, not sent with every item.
* Tensors, for arguments, results and worker contexts alike:

  - ``is_copy_tensor=True`` (default): the other side gets a copy; in-place edits never
    travel. CPU tensors of 1 MiB or more are copied once into a recycled, pre-faulted
    shared-memory segment lent to the receiver (``machinlike._shm``), so a 256 MB
    tensor costs one memcpy at warm-memory speed.
  - ``is_copy_tensor=False, share_method="cpu"``: CPU tensors are passed by reference
    through shared memory (moved there on their first trip; no copy afterwards). The
    same tensor can be sent any number of times; each worker maps it once.
  - ``share_method="cuda"``: CUDA tensors through CUDA IPC handles; a result arrives as a
    device copy the caller owns, and the GPU memory of arguments nobody loaded or a dead
    worker held is given back (``_cuda_shares``).

* Crashes: a worker that dies (``sys.exit``, ``os._exit``, a segfault, SIGKILL from
  outside...) fails only the task it had started, with
  :class:`~machinlike.exception.WorkerLostError` naming its exit code or signal and what
  it was doing (loading the task, running it, pickling its result); tasks it had queued
  but not started run elsewhere, and a replacement worker (with the same context) takes
  its place: **the pool keeps serving**. An exception in a task (or while unpickling its
  arguments or pickling its result) fails that task with the original exception and the
  worker's traceback as ``__cause__``. The pool is *broken* only when it cannot run
  anything: the initializer raised (pending and new tasks then fail with
  :class:`BrokenPoolError`, caused by the initializer's exception), a worker slot
  died three times in a row while starting, or a worker was stopped because the script
  makes pools or processes at import time (``machinlike._mainguard``: the error says so).
* Shutdown: ``terminate()``, garbage collection of the pool and interpreter exit end the
  workers (SIGTERM, a 1 s grace period, SIGKILL); a worker also dies with its parent.
  Pools refuse to be pickled.

Scheduling (process pools). Each worker has a private task pipe and result pipe, so the
pool knows at every moment which tasks a worker holds. A worker's channel holds at most a
*window* of unfinished tasks; the rest wait, oldest first, in the pool and go to the
least-loaded worker with room. When nothing waits in the pool and a worker is idle, it
takes back the newest unstarted half of the busiest worker's channel (atomically: a task
is either claimed by its worker or taken back, never both). Hence a worker is never idle
while another holds a task it has not started.

* :class:`Pool`: window of 2 for single calls (the running task and the next), close to
  the standard pool's shared queue: they start in submission order. A map's chunks get
  a window of 32: a map of small chunks would otherwise wait for the parent between
  chunks (``imap`` at chunksize 64 ran at 0.42 of the standard spawn pool's rate).
* :class:`P2PPool`: window of 32 for every task: each worker's private channel is kept
  full, so that workers never wait for the parent between short tasks; the price of
  binding tasks to a worker early is paid back by stealing.

Thread pools share the caller's objects: nothing is pickled, a closure over a tensor edits
that tensor, exceptions keep their own traceback. ``is_recursive``, ``is_copy_tensor`` and
``share_method`` are accepted for machin compatibility and have no effect there.
"""

from __future__ import annotations

from multiprocessing.context import BaseContext
from typing import Any, Callable, Iterable, Optional, Sequence, Union

from .. import _descriptors, _mainguard
from .._warm import resolve_context
from ..exception import WorkerLostError
from ._api import PoolBase
from ._args import as_args, check_bool, check_callable, check_contexts, check_maxtasks, check_processes
from ._core import ProcessCore
from ._errors import BrokenPoolError, PoolTerminatedError, PoolTimeoutError
from ._policy import LARGE_TENSOR_BYTES, Codec
from ._imap import IMapIterator, IMapUnorderedIterator
from ._result import ApplyResult, AsyncResult, MapResult
from ._thread import ThreadCore

__all__ = [
    "Pool",
    "P2PPool",
    "CtxPool",
    "ThreadPool",
    "CtxThreadPool",
    "AsyncResult",
    "ApplyResult",
    "MapResult",
    "IMapIterator",
    "IMapUnorderedIterator",
    "BrokenPoolError",
    "PoolTerminatedError",
    "PoolTimeoutError",
    "WorkerLostError",
    "LARGE_TENSOR_BYTES",
]

ShareMethod = Union[None, str, Sequence[str]]
_SHARE_METHODS = ("cpu", "cuda")
_POOL_BASE = 40  # a pool owner's own descriptors before any worker (measured 12-30)


def _check_policy(is_copy_tensor: Any, share_method: Any) -> frozenset:
    check_bool(is_copy_tensor, "is_copy_tensor")
    if share_method is None:
        methods: frozenset = frozenset()
    elif isinstance(share_method, str):
        methods = frozenset([share_method])
    elif isinstance(share_method, (tuple, list, set, frozenset)) and all(isinstance(m, str) for m in share_method):
        methods = frozenset(share_method)
    else:
        raise TypeError(f"share_method must be None, 'cpu', 'cuda' or a tuple of them, not {type(share_method).__name__}")
    unknown = sorted(methods.difference(_SHARE_METHODS))
    if unknown:
        raise ValueError(
            f"share_method={share_method!r} names unknown method(s) {unknown}: use 'cpu' (CPU tensors "
            f"through shared memory) or 'cuda' (CUDA tensors through CUDA IPC)"
        )
    if not is_copy_tensor and not methods:
        raise ValueError(
            "is_copy_tensor=False needs share_method='cpu' (share CPU tensors through shared memory) "
            "or share_method='cuda' (share CUDA tensors through CUDA IPC); or keep is_copy_tensor=True"
        )
    return methods


class Pool(PoolBase):
    """A process pool for PyTorch code (see the module docstring for the guarantees).

    Args:
        processes: Number of workers; None for the number of usable CPUs.
        initializer: Called as ``initializer(*initargs)`` in each worker (and each
            replacement) before its first task. If it raises, the pool is broken.
        initargs: Arguments for ``initializer``.
        maxtasksperchild: Tasks (chunks of a map count as one) a worker runs before it
            is replaced by a fresh one; None: no limit.
        is_recursive: Pickle by-value functions with dill's ``recurse``: only the
            globals they use travel, by value (for closures over unpicklable globals).
        is_daemon: Whether workers are daemon processes (daemons cannot start
            processes of their own; set False to nest pools).
        is_copy_tensor: Copy tensors (True) or share them (False, with ``share_method``).
        share_method: With ``is_copy_tensor=False``: ``"cpu"`` (shared memory) or
            ``"cuda"`` (CUDA IPC), or both as a tuple; ignored when copying.
        ctx: Multiprocessing context (keyword only): None for the warm forkserver
            (spawn where unavailable), a start method name, or a context object; not
            ``"fork"`` with ``share_method="cuda"``.

    Raises:
        TypeError, ValueError: a bad argument (the message names it).
        pickle.PicklingError: the initializer or its arguments cannot be pickled.
    """

    _window = 2
    _map_window = 32  # a map's chunks (``Dispatcher`` says why)
    _label = "pool"

    def __init__(
        self,
        processes: Optional[int] = None,
        initializer: Optional[Callable[..., Any]] = None,
        initargs: Iterable[Any] = (),
        maxtasksperchild: Optional[int] = None,
        is_recursive: bool = False,
        is_daemon: bool = True,
        is_copy_tensor: bool = True,
        share_method: ShareMethod = None,
        *,
        ctx: Union[None, str, BaseContext] = None,
    ) -> None:
        self._start_processes(
            processes, initializer, initargs, maxtasksperchild, None, False,
            is_recursive, is_daemon, is_copy_tensor, share_method, ctx,
        )

    def _start_processes(
        self, processes: Any, initializer: Any, initargs: Any, maxtasks: Any, worker_contexts: Any,
        has_context: bool, is_recursive: Any, is_daemon: Any, is_copy_tensor: Any, share_method: Any, ctx: Any,
        required: bool = False,
    ) -> None:
        _mainguard.check(f"{type(self).__name__}(...)")
        processes = check_processes(processes, required)
        check_callable(initializer, "initializer", optional=True)
        initargs = as_args(initargs, "initargs")
        maxtasks = check_maxtasks(maxtasks)
        contexts = check_contexts(worker_contexts, processes)
        check_bool(is_recursive, "is_recursive")
        check_bool(is_daemon, "is_daemon")
        methods = _check_policy(is_copy_tensor, share_method)
        # Before the first process or pipe (``_descriptors`` says why): a pool of hundreds
        # of workers (environments stepped in parallel) outgrows a soft limit of 1,024.
        _descriptors.raise_limit()
        budget = _descriptors.Budget(f"{type(self).__name__}(processes={processes})", _descriptors.PER_POOL_WORKER,
                                     base=_POOL_BASE, role="it keeps pipes to each", unit="workers",
                                     outcome="starting a worker fails (OSError: Too many open files)")
        budget.refuse_beyond_hard(processes, "processes")
        budget.check(processes)
        context = resolve_context(ctx)
        if not is_copy_tensor and "cuda" in methods and context.get_start_method() == "fork":
            # Sharing a CUDA tensor initialises CUDA here, and a process forked after that
            # cannot use CUDA: a replacement worker (after a crash or maxtasksperchild) fails.
            raise ValueError(
                f"share_method={share_method!r} with ctx={ctx!r}: a worker forked after this process "
                f"shared a CUDA tensor (which initialises CUDA here) cannot use CUDA. Use ctx=None (the "
                f"warm forkserver), 'forkserver' or 'spawn'"
            )
        _mainguard.check_main_file(f"{type(self).__name__}(...)", context.get_start_method())
        codec = Codec(is_copy_tensor, methods, is_recursive)
        core = ProcessCore(
            processes=processes, initializer=initializer, initargs=initargs, contexts=contexts,
            has_context=has_context, maxtasks=maxtasks, daemon=is_daemon, codec=codec, ctx=context,
            window=self._window, map_window=self._map_window, label=self._label,
        )
        self._setup(core)


class P2PPool(Pool):
    """A process pool that keeps each worker's private channel full (window of 32) and
    rebalances by work stealing: the highest throughput for many short tasks, and no
    worker idles while another holds unstarted tasks. Arguments as :class:`Pool`."""

    _window = 32
    _label = "p2ppool"


class CtxPool(Pool):
    """A process pool whose worker ``i`` calls ``func(worker_contexts[i], *args)``.

    A replacement worker (after a crash or ``maxtasksperchild``) gets the context of the
    worker it replaces, pickled afresh from the pool's own object (state a dead worker
    added to its copy is lost with it). Contexts follow the tensor policy.

    Args:
        processes: Number of workers (required).
        worker_contexts: One context per worker, given to it (pickled under the tensor
            policy) when it starts; None gives every worker None.
        initializer: As for :class:`Pool`.
        initargs: As for :class:`Pool`.
        maxtasksperchild: As for :class:`Pool`.
        is_recursive: As for :class:`Pool`.
        is_daemon: As for :class:`Pool`.
        is_copy_tensor: As for :class:`Pool`; also decides whether the contexts are
            copied or shared.
        share_method: As for :class:`Pool`.
        ctx: As for :class:`Pool`.

    Raises:
        TypeError: a bad argument type (the message names it).
        ValueError: ``worker_contexts`` does not hold exactly ``processes`` contexts.
    """

    _label = "ctxpool"

    def __init__(
        self,
        processes: int,
        initializer: Optional[Callable[..., Any]] = None,
        initargs: Iterable[Any] = (),
        maxtasksperchild: Optional[int] = None,
        worker_contexts: Optional[Sequence[Any]] = None,
        is_recursive: bool = False,
        is_daemon: bool = True,
        is_copy_tensor: bool = True,
        share_method: ShareMethod = None,
        *,
        ctx: Union[None, str, BaseContext] = None,
    ) -> None:
        self._start_processes(
            processes, initializer, initargs, maxtasksperchild, worker_contexts, True,
            is_recursive, is_daemon, is_copy_tensor, share_method, ctx, required=True,
        )


class ThreadPool(PoolBase):
    """A pool of threads with the same API; nothing is pickled (see the module docstring).

    Args:
        processes: Number of threads; None for the number of usable CPUs.
        initializer: Called as ``initializer(*initargs)`` in each thread first; if it
            raises, the pool is broken.
        initargs: Arguments for ``initializer``.
        maxtasksperchild: Tasks a thread runs before a fresh thread replaces it.
        is_recursive, is_copy_tensor, share_method: Accepted for machin compatibility;
            no effect (threads share objects).
        is_daemon: Whether the threads are daemon threads.

    Raises:
        TypeError, ValueError: a bad argument (the message names it).
    """

    _label = "threadpool"

    def __init__(
        self,
        processes: Optional[int] = None,
        initializer: Optional[Callable[..., Any]] = None,
        initargs: Iterable[Any] = (),
        maxtasksperchild: Optional[int] = None,
        is_recursive: bool = False,
        is_daemon: bool = True,
        is_copy_tensor: bool = True,
        share_method: ShareMethod = None,
    ) -> None:
        check_bool(is_recursive, "is_recursive")
        check_bool(is_copy_tensor, "is_copy_tensor")
        self._start_threads(processes, initializer, initargs, maxtasksperchild, None, False, is_daemon)

    def _start_threads(
        self, processes: Any, initializer: Any, initargs: Any, maxtasks: Any, worker_contexts: Any,
        has_context: bool, is_daemon: Any, required: bool = False,
    ) -> None:
        processes = check_processes(processes, required)
        check_callable(initializer, "initializer", optional=True)
        initargs = as_args(initargs, "initargs")
        maxtasks = check_maxtasks(maxtasks)
        contexts = check_contexts(worker_contexts, processes)
        check_bool(is_daemon, "is_daemon")
        core = ThreadCore(
            processes=processes, initializer=initializer, initargs=initargs, contexts=contexts,
            has_context=has_context, maxtasks=maxtasks, daemon=is_daemon, label=self._label,
        )
        self._setup(core)


class CtxThreadPool(ThreadPool):
    """A thread pool whose thread ``i`` calls ``func(worker_contexts[i], *args)``.

    Args:
        processes: Number of threads (required).
        initializer: Called in each thread first.
        initargs: Arguments for ``initializer``.
        worker_contexts: One context per thread (the objects themselves, not copies);
            None gives every thread None.

    Raises:
        TypeError: a bad argument type (the message names it).
        ValueError: ``worker_contexts`` does not hold exactly ``processes`` contexts.
    """

    _label = "ctxthreadpool"

    def __init__(
        self,
        processes: int,
        initializer: Optional[Callable[..., Any]] = None,
        initargs: Iterable[Any] = (),
        worker_contexts: Optional[Sequence[Any]] = None,
    ) -> None:
        self._start_threads(processes, initializer, initargs, None, worker_contexts, True, True, required=True)
