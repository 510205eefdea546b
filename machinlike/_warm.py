"""Warm process start: a private forkserver that has torch imported already.

Spawn is the safe way to start a process from a parent that runs threads or has
initialised CUDA, but each spawned child imports torch again (1-2 s here). A forkserver is
as safe — children are forked from a small single-threaded server process, never from the
parent — and when that server has imported torch once, every later child starts in about
20 ms.

This module keeps its *own* forkserver (not the one behind
``multiprocessing.get_context("forkserver")``), so it changes no process-wide setting: a
program that uses the standard forkserver with its own preload list is unaffected. The
server starts lazily on the first process start, never at import.
"""

from __future__ import annotations

import io
import logging
import multiprocessing
import os
import select
import shutil
import socket
import sys
import tempfile
import threading
from multiprocessing import context as _context
from multiprocessing import forkserver as _forkserver
from multiprocessing import process as _process
from multiprocessing import reduction as _reduction
from multiprocessing import resource_tracker as _resource_tracker
from multiprocessing import spawn as _spawn
from multiprocessing import util as _util
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

__all__ = ["WarmContext", "warm_context", "resolve_context", "WARM_AVAILABLE", "server_died", "server_of_died"]

log = logging.getLogger(__name__)

#: Whether this platform can run a forkserver (it needs fd passing over Unix sockets).
WARM_AVAILABLE: bool = bool(getattr(_reduction, "HAVE_SEND_HANDLE", False)) and os.name == "posix"

# Imported once in a server; '__main__' is deliberately absent so that a user's script
# is imported by each child (as with spawn), not frozen into the server at first use.
# Two profiles, each with its own server, started on first use:
# - "light" (processes, pools, queues): torch and machinlike, about 2 s to start here;
# - "train" (the ranks of launch()): also torch._dynamo, which torch imports lazily when
#   the first optimizer is built (another ~2 s here) and which every trainer or
#   parameter-server rank does. A pool worker rarely builds an optimizer, so a program's
#   first pool does not pay for it.
_PRELOADS: Dict[str, list] = {
    "light": ["torch", "torch.distributed.rpc", "dill", "machinlike"],
    "train": ["torch", "torch.distributed.rpc", "torch._dynamo", "dill", "machinlike"],
}


#: The server's SIGTERM ends its loop like its last client's exit does, so that it removes
#: its socket folder (a scheduler signals the whole job, the server too). Installed only
#: over the default disposition, unblocked. A child must die of a SIGTERM from its very
#: fork (its parent may terminate it as it starts): with the handler inherited, a signal
#: arriving before the interpreter's after-fork code was dropped (that code clears caught
#: signals), and one arriving later raised in the child the SystemExit meant for the
#: server. So the fork happens with SIGTERM blocked (the kernel keeps it pending), and the
#: child puts the default back before it unblocks.
_SERVER_END = (
    "_server_pid = os.getpid()\n"
    "def _server_end(signum, frame):\n"
    "    raise SystemExit(0)\n"
    "def _term_blocked():\n"
    "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
    "def _term_unblocked():\n"
    "    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})\n"
    "def _term_default():\n"
    "    signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
    "    _term_unblocked()\n"
    "if (signal.getsignal(signal.SIGTERM) == signal.SIG_DFL\n"
    "        and signal.SIGTERM not in signal.pthread_sigmask(signal.SIG_BLOCK, ())):\n"
    "    signal.signal(signal.SIGTERM, _server_end)\n"
    "    os.register_at_fork(before=_term_blocked, after_in_parent=_term_unblocked,\n"
    "                        after_in_child=_term_default)\n"
)


class _WarmForkServer(_forkserver.ForkServer):
    """The standard forkserver, started with the parent's ``sys.path`` before preloading.

    (The standard server preloads with the default path of ``python -c``, i.e. the current
    directory first, so it may import another copy of a package than the parent uses.)
    """

    #: Set in a child of the server: it talks to its parent's server (which lives at least
    #: as long as this child, since the child holds one of its "alive" fds).
    borrowed = False

    # The standard ForkServer's private fields this subclass drives (CPython's
    # multiprocessing/forkserver.py; typeshed leaves them out).
    _lock: threading.Lock
    _forkserver_address: Optional[str]
    _forkserver_alive_fd: Optional[int]
    _forkserver_pid: Optional[int]
    _preload_modules: List[str]
    #: Removes the running server's socket folder (at this process's exit, or when the
    #: server died and another takes its place); None before the first start.
    _folder_gone: Optional[Callable[[], Any]] = None

    def __init__(self) -> None:
        super().__init__()
        #: Servers whose socket went, with this process's "alive" fd of each (None once
        #: closed); each is dropped once it has ended and been reaped.
        self._retired: List[Tuple[int, Optional[int]]] = []

    def _let_retired_go(self) -> None:
        kept = []
        for pid, alive_fd in self._retired:
            if alive_fd is not None and _childless(pid):
                os.close(alive_fd)  # (the server ends now)
                alive_fd = None
            if alive_fd is None and _reaped(pid):
                continue
            kept.append((pid, alive_fd))
        self._retired = kept

    def ensure_running(self) -> None:
        with self._lock:
            _resource_tracker.ensure_running()
            if self.borrowed:
                return
            self._let_retired_go()
            if self._forkserver_pid is not None:
                if os.waitpid(self._forkserver_pid, os.WNOHANG)[0] == 0:
                    if self._forkserver_address is not None and os.path.exists(self._forkserver_address):
                        return  # still serving
                    # Its socket was removed under it (a /tmp cleaner, a user's rm): it can
                    # serve no one again, and one more start must not fail. It still owes
                    # its live children their exit codes, and it ends (without writing the
                    # last one) when its last client goes: the last child, unless this
                    # process keeps its end open until the server has no children left.
                    log.warning("the socket %s of this process's warm forkserver (pid %d) was removed; starting "
                                "another server", self._forkserver_address, self._forkserver_pid)
                    self._retired.append((self._forkserver_pid, self._forkserver_alive_fd))
                elif self._forkserver_alive_fd is not None:
                    os.close(self._forkserver_alive_fd)
                self._forkserver_address = None
                self._forkserver_alive_fd = None
                self._forkserver_pid = None
            if self._folder_gone is not None:
                self._folder_gone()  # the dead server's (it could not remove it itself)
            # Its socket goes in a folder of its own that the server removes when it ends
            # (see _SERVER_END), not in multiprocessing's temporary folder: that one is
            # removed by an exit handler of this process, which a launcher ended by a
            # signal or os._exit never runs (a suite run left about ten of them in /tmp).
            folder = tempfile.mkdtemp(prefix="machinlike-warm-")
            self._folder_gone = _util.Finalize(None, shutil.rmtree, (folder, True),
                                               exitpriority=-100)
            address = os.path.join(folder, "server")
            with socket.socket(socket.AF_UNIX) as listener:
                listener.bind(address)
                os.chmod(address, 0o600)
                listener.listen()
                # Every client keeps the write end; EOF on the read end stops the server.
                alive_r, alive_w = os.pipe()
                try:
                    # The server leaves with os._exit once its last client is gone (the
                    # stdlib main raises SystemExit then): finalising an interpreter that
                    # imported torch._dynamo takes seconds, and the server holds the
                    # caller's stdout, so a caller reading it to EOF would wait them out.
                    # It preloads with Ctrl-C ignored: the terminal sends it to the whole
                    # process group, and a server importing torch printed a page of
                    # KeyboardInterrupt traceback that was the parent's to handle. Its
                    # children get the default handler back (main restores what it found).
                    command = (
                        f"import os, signal, sys; sys.path[:] = {sys.path!r}\n"
                        f"signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                        f"for name in {self._preload_modules!r}:\n"
                        f"    try:\n"
                        f"        __import__(name)\n"
                        f"    except ImportError:\n"
                        f"        pass\n"
                        f"signal.signal(signal.SIGINT, signal.default_int_handler)\n"
                        f"{_SERVER_END}"
                        f"from multiprocessing.forkserver import main\n"
                        f"try:\n"
                        f"    main({listener.fileno()}, {alive_r}, {self._preload_modules!r})\n"
                        f"except SystemExit:\n"
                        f"    if os.getpid() == _server_pid:  # (not a child that left the loop)\n"
                        f"        import shutil; shutil.rmtree({folder!r}, ignore_errors=True)\n"
                        f"    sys.stdout.flush(); sys.stderr.flush(); os._exit(0)\n"
                    )
                    exe = _spawn.get_executable()
                    argv = [exe, *_util._args_from_interpreter_flags(), "-c", command]  # type: ignore[attr-defined]
                    # typeshed wants bytes; CPython's own forkserver passes this str path
                    pid = _util.spawnv_passfds(exe, argv, [listener.fileno(), alive_r])  # type: ignore[arg-type]
                except BaseException:
                    os.close(alive_w)
                    raise
                finally:
                    os.close(alive_r)
            self._forkserver_address = address
            self._forkserver_alive_fd = alive_w
            self._forkserver_pid = pid


def _childless(pid: int) -> bool:
    """Whether process ``pid`` has no child left, reaped or not (False when unknown)."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as listing:
            return not listing.read().split()
    except OSError:
        return False


def _reaped(pid: int) -> bool:
    """Reap ``pid`` (a child of this process) if it ended; True when it is gone."""
    try:
        return os.waitpid(pid, os.WNOHANG)[0] != 0
    except ChildProcessError:
        return True


_servers: Dict[str, _WarmForkServer] = {}
_server_lock = threading.Lock()


def _get_server(profile: str) -> _WarmForkServer:
    with _server_lock:
        server = _servers.get(profile)
        if server is None:
            server = _servers[profile] = _WarmForkServer()
            server.set_forkserver_preload(list(_PRELOADS[profile]))
        return server


_DEATH_WAIT_S = 1.0  # seconds server_died waits for a server whose pipes closed to be seen ended


def server_died(profile: str) -> Optional[int]:
    """The pid of this process's warm server of ``profile`` once it has died; None while it
    serves (or was never started here, or is a parent's).

    Why: its children's sentinels are its pipes, so its death reads as every child ending
    with status 255, although they may run on; whoever names a child's end asks first.
    """
    with _server_lock:
        server = _servers.get(profile)
    pid = None if server is None or server.borrowed else server._forkserver_pid
    return None if pid is None else _died(pid)


def _died(pid: int) -> Optional[int]:
    """``pid`` (a warm server this process started) once it has died, else None."""
    try:
        # A dying process closes its pipes before it can be waited for: its children's
        # sentinels may say so first, so wait that long (a pidfd is readable once it ended).
        fd = os.pidfd_open(pid)
    except (OSError, AttributeError):  # reaped already, or no pidfds here: look once
        fd = None
    if fd is not None:
        try:
            select.select([fd], [], [], _DEATH_WAIT_S)
        finally:
            os.close(fd)
    try:  # (WNOWAIT: not reaped, so that ensure_running still sees it gone and starts another)
        ended = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already: gone
        return pid
    return pid if ended is not None else None


def server_of_died(process: _process.BaseProcess) -> Optional[int]:
    """:func:`server_died` for the warm server that started ``process``; None when it
    serves, or when a warm server did not start ``process`` (another context's)."""
    popen = getattr(process, "_popen", None)  # (multiprocessing's, private: its class says who started it)
    # (the server that started it: another may serve the profile now, see ensure_running)
    pid = getattr(popen, "server_pid", None) if WARM_AVAILABLE and isinstance(popen, _WarmPopen) else None
    return None if pid is None else _died(pid)


def _borrow_parent_server() -> None:
    # In a child forked by a warm server, the standard forkserver module's globals hold
    # that server's address (set by its main loop) and an "alive" fd (set for the child):
    # reuse them for every profile, so that a child starting processes of its own does
    # not pay for another server importing torch again.
    stdlib: Any = _forkserver._forkserver  # its fields are private (typeshed leaves them out)
    if stdlib._forkserver_address is None or stdlib._forkserver_alive_fd is None:
        return
    server = _WarmForkServer()
    server._forkserver_address = stdlib._forkserver_address
    server._forkserver_alive_fd = stdlib._forkserver_alive_fd
    server.borrowed = True
    with _server_lock:
        for profile in _PRELOADS:
            _servers[profile] = server


if WARM_AVAILABLE:
    from multiprocessing import popen_forkserver as _popen_forkserver

    class _WarmPopen(_popen_forkserver.Popen):
        """A forkserver Popen that talks to our private server instead of the global one."""

        _profile = "light"
        #: The server that started this child; None for a parent's (borrowed) one.
        server_pid: Optional[int] = None
        _fds: List[int]  # the stdlib Popen's private list of fds to pass (typeshed leaves it out)

        def _launch(self, process_obj: _process.BaseProcess) -> None:
            payload = io.BytesIO()
            # A forked child would write to the server's stdout/stderr and see its
            # environment (both fixed when the server started); hand it the parent's
            # current ones, as spawn does (a variable set after the first start reaches it).
            setattr(process_obj, "_stdio_slots", tuple(self.duplicate_for_child(fd) for fd in (1, 2)))
            setattr(process_obj, "_environ", dict(os.environ))
            _context.set_spawning_popen(self)
            try:
                _reduction.dump(_spawn.get_preparation_data(process_obj.name), payload)
                _reduction.dump(process_obj, payload)
            finally:
                _context.set_spawning_popen(None)
            server = _get_server(self._profile)
            self.sentinel, data_w = server.connect_to_new_process(self._fds)
            self.server_pid = None if server.borrowed else server._forkserver_pid
            # The child watches this pipe as its parent sentinel, so one copy of the write
            # end stays open for as long as this Popen lives.
            parent_keep = os.dup(data_w)
            self.finalizer = _util.Finalize(self, _util.close_fds,  # type: ignore[attr-defined]  # stdlib private
                                            (parent_keep, self.sentinel))
            with open(data_w, "wb", closefd=True) as stream:
                stream.write(payload.getbuffer())
            self.pid = _forkserver.read_signed(self.sentinel)

    class _WarmTrainPopen(_WarmPopen):
        _profile = "train"


def _fresh_seeds() -> None:
    """Seed torch's and numpy's global generators from the OS, as a spawned child's are.

    Why: a forked child starts with its server's generator states, the same in every
    child, so every pool worker, process and launched rank drew the same ``torch.rand``
    (every actor the same "random" exploration). ``random`` reseeds itself after a fork.
    """
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()  # (CUDA's generators are seeded lazily: no CUDA context is made here)
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _thread_count_of_now(server_value: Optional[str]) -> None:
    """Apply ``OMP_NUM_THREADS`` as the parent has it now (``server_value``: the server's).

    Why: torch read it when the server imported torch, so a value the parent set since
    (``os.environ["OMP_NUM_THREADS"] = "1"`` before starting actors, a common habit) was
    ignored here, while a spawned child's torch reads it. A value the parent removed keeps
    the server's count.
    """
    value = os.environ.get("OMP_NUM_THREADS")
    torch = sys.modules.get("torch")
    if value is None or value == server_value or torch is None:
        return
    try:
        count = int(value)
    except ValueError:  # torch ignores a malformed value too
        return
    if count > 0:
        torch.set_num_threads(count)


def child_setup(process_obj: _process.BaseProcess) -> None:
    """In a child of a warm server: fresh random seeds, the parent's stdout/stderr and
    environment (as they were when it started this child), borrow its server.

    For process classes that start through a warm context's ``Process._Popen`` without
    deriving from its Process class (:class:`machinlike.process.Process`); a no-op in a
    child started any other way.
    """
    _fresh_seeds()
    environ = getattr(process_obj, "_environ", None)
    if environ is not None:
        # (Before the target runs; the main module was imported with the server's.)
        server_threads = os.environ.get("OMP_NUM_THREADS")
        os.environ.clear()
        os.environ.update(environ)
        _thread_count_of_now(server_threads)
    slots = getattr(process_obj, "_stdio_slots", ())
    if slots:
        inherited = _forkserver.get_inherited_fds() or []
        for target, slot in zip((1, 2), slots):
            fd = inherited[slot]
            os.dup2(fd, target)
            os.close(fd)
    _borrow_parent_server()


class _WarmProcess(_process.BaseProcess):
    _start_method = "forkserver"
    _stdio_slots: tuple = ()

    def _bootstrap(self, parent_sentinel: Optional[int] = None) -> int:
        child_setup(self)
        return super()._bootstrap(parent_sentinel)  # type: ignore[misc]  # stdlib private, absent from typeshed

    @staticmethod
    def _Popen(process_obj: _process.BaseProcess) -> "_WarmPopen":
        return _WarmPopen(process_obj)


class _WarmTrainProcess(_WarmProcess):
    @staticmethod
    def _Popen(process_obj: _process.BaseProcess) -> "_WarmPopen":
        return _WarmTrainPopen(process_obj)


class WarmContext(_context.BaseContext):
    """A ``multiprocessing`` context whose processes come from a torch-preloaded forkserver.

    It behaves like ``multiprocessing.get_context("forkserver")`` (queues, locks, pipes and
    tensor sharing work the same way); only the server is private and warm.
    """

    _name = "forkserver"
    Process = _WarmProcess

    def _check_available(self) -> None:
        if not WARM_AVAILABLE:
            raise ValueError("the warm forkserver start method is not available on this platform")


class _WarmTrainContext(WarmContext):
    """The warm context of launch()'s ranks: its server has torch._dynamo imported too."""

    Process = _WarmTrainProcess


_warm_contexts: Dict[str, WarmContext] = {}


def warm_context(profile: str = "light") -> _context.BaseContext:
    """The warm context where the platform supports it, else the plain spawn context.

    Args:
        profile: ``"light"`` (processes, pools, queues) or ``"train"`` (launched ranks:
            the server also imports ``torch._dynamo``, which building an optimizer needs).
    """
    if not WARM_AVAILABLE:
        return multiprocessing.get_context("spawn")
    with _server_lock:
        context = _warm_contexts.get(profile)
        if context is None:
            context = _warm_contexts[profile] = WarmContext() if profile == "light" else _WarmTrainContext()
        return context


def resolve_context(
    ctx: Union[None, str, _context.BaseContext], param: str = "ctx", profile: str = "light"
) -> _context.BaseContext:
    """Turn a user's ``ctx`` argument into a multiprocessing context.

    Args:
        ctx: None or ``"warm"`` for the warm forkserver (spawn where unavailable); a start
            method name (``"spawn"``, ``"forkserver"``, ``"fork"``); or a context object.
        param: Parameter name to cite in the error message.
        profile: The warm server to use for None / ``"warm"`` (see :func:`warm_context`).

    Raises:
        TypeError: ``ctx`` is of another type.
        ValueError: ``ctx`` names an unknown start method.
    """
    if ctx is None or ctx == "warm":
        return warm_context(profile)
    if isinstance(ctx, str):
        try:
            return multiprocessing.get_context(ctx)
        except ValueError:
            raise ValueError(
                f"{param}={ctx!r} is not a start method; use None (warm forkserver), "
                f"'spawn', 'forkserver' or 'fork'"
            ) from None
    if isinstance(ctx, _context.BaseContext):
        return ctx
    raise TypeError(
        f"{param} must be None, a start method name or a multiprocessing context, "
        f"not {type(ctx).__name__}"
    )
