"""Exceptions that cross process boundaries, and the errors machinlike raises.

An exception raised in a child process, a pool worker or on another RPC member reaches
the caller as an instance of its *original* type, with the remote traceback chained as
``__cause__`` (a :class:`RemoteTraceback` whose text names where it happened)::

    try:
        pool.apply(func)
    except ValueError as e:          # the worker raised ValueError
        print(e.__cause__)           # "Traceback (most recent call last) on worker ..."

An exception whose constructor does not accept its own ``args`` is rebuilt from its
state; one holding attributes that do not pickle arrives without them (a note names
them). When the type itself cannot be found on the receiving side, a :class:`RemoteError`
carrying the type's name and message is raised instead, an instance of the type's nearest
builtin base too; nothing is silently dropped.
"""

from __future__ import annotations

import builtins
import os
import pickle
import signal
import traceback
from typing import Any, Dict, List, Optional, Type, Union

from . import _mainguard

__all__ = [
    "RemoteTraceback",
    "RemoteError",
    "ExceptionWithTraceback",
    "ProcessExitedError",
    "WorkerLostError",
    "PeerLostError",
    "SilentStoreError",
    "NoCollectivesError",
    "describe_exitcode",
    "raised_remotely",
    "drop_frames",
    "freeze_traceback",
    "copy_to_raise",
]

#: Where :func:`freeze_traceback` keeps an exception's traceback, as text.
_FROZEN = "_machinlike_traceback_text"


class RemoteTraceback(Exception):
    """The formatted traceback of an exception raised in another process.

    It is chained as ``__cause__`` of the rebuilt exception, so the usual traceback
    printout shows the remote stack first, then the local one.
    """

    def __init__(self, tb_text: str) -> None:
        super().__init__(tb_text)
        self.tb_text = tb_text

    def __str__(self) -> str:
        return self.tb_text


class RemoteError(Exception):
    """Stands in for a remote exception whose type could not be rebuilt here.

    What :meth:`standing_in` makes is also an instance of the original's nearest builtin
    base (a ``RuntimeError`` subclass arrives as a RemoteError that is a RuntimeError), so
    that ``except RuntimeError`` catches it here as it would have caught the original.

    Attributes:
        type_name: Qualified name of the original exception type.
        message: ``str()`` of the original exception.
    """

    def __init__(self, type_name: str, message: str) -> None:
        super().__init__(type_name, message)
        self.type_name = type_name
        self.message = message

    def __str__(self) -> str:
        return f"{self.type_name}: {self.message}"

    def __reduce__(self) -> Any:
        base = next((cls for cls in type(self).__mro__[1:] if cls.__module__ == "builtins"), Exception)
        return _remote_error, (self.type_name, self.message, base.__name__)

    @staticmethod
    def standing_in(exc: BaseException) -> "RemoteError":
        """A RemoteError naming ``exc``'s type and message, an instance of its nearest
        builtin base too where that base allows it."""
        for cls in type(exc).__mro__:
            if cls.__module__ == "builtins":
                return _remote_error(_qualified_name(type(exc)), _text(exc), cls.__name__)
        return RemoteError(_qualified_name(type(exc)), _text(exc))  # (every exception has a builtin base)


_REMOTE_KINDS: Dict[str, type] = {}


def _remote_error(type_name: str, message: str, base: str) -> RemoteError:
    """A RemoteError that is also an instance of builtin exception ``base`` (by name),
    when that base can be mixed in (not one whose constructor wants other arguments,
    such as ``UnicodeDecodeError``); else a plain one."""
    kind = _REMOTE_KINDS.get(base)
    if kind is None:
        builtin = getattr(builtins, base, None)
        kind = RemoteError
        if isinstance(builtin, type) and issubclass(builtin, BaseException) and builtin not in (BaseException, Exception):
            try:
                mixed = type("RemoteError", (RemoteError, builtin), {"__module__": __name__})
                mixed("probe", "probe")
                kind = mixed
            except TypeError:
                pass
        _REMOTE_KINDS[base] = kind
    return kind(type_name, message)


def raised_remotely(exc: BaseException) -> bool:
    """Whether ``exc`` was raised in another process and carried here (its ``__cause__``
    is a :class:`RemoteTraceback`).

    A server's accessor tells so a ``KeyError`` of the host's own code (``fn`` of an
    inference server, an ``adopt`` hook) from the group's ``KeyError`` that no member
    serves the call, which it turns into "the host is gone" or "closed".
    """
    return isinstance(exc.__cause__, RemoteTraceback)


def _qualified_name(cls: type) -> str:
    module = cls.__module__
    return cls.__qualname__ if module == "builtins" else f"{module}.{cls.__qualname__}"


def _rebuild_exception(exc: BaseException, tb_text: str) -> BaseException:
    getattr(exc, "__dict__", {}).pop(_FROZEN, None)  # (the sender's record, carried as tb_text)
    exc.__cause__ = RemoteTraceback(tb_text)
    return exc


def drop_frames(error: BaseException) -> BaseException:
    """``error`` without a traceback, nor any error chained to it (``__cause__``,
    ``__context__``); see :func:`freeze_traceback` for why."""
    seen = set()
    pending: List[Optional[BaseException]] = [error]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = None
        pending += [current.__cause__, current.__context__]
    return error


def freeze_traceback(exc: BaseException) -> BaseException:
    """``exc`` with its traceback kept as text (what :class:`ExceptionWithTraceback` then
    carries to the caller) and its frames, and those of the errors chained to it, let go.

    Why: a torch Future keeps its error (or a result carrying one) in C++, where Python's
    collector cannot follow it. A frame of the error's traceback holding the future (the
    frames that complete it do) tied the two together for good: each failed request
    leaked its future, the error, the frames and everything they held (its inputs).
    """
    state = getattr(exc, "__dict__", None)
    if state is not None and _FROZEN not in state:
        state[_FROZEN] = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return drop_frames(exc) if state is not None else exc


def copy_to_raise(exc: BaseException) -> BaseException:
    """A copy of ``exc``, an error a future keeps that a read of it just raised, to raise
    in its stead: its type, ``args``, attributes (its notes a list of their own), cause and
    context, and no traceback; ``exc`` itself where no faithful copy can be made (its class
    refuses to be made without its ``__init__``, or the copy reads differently). The
    frames that raise wrote on ``exc`` are taken off it.

    Why: raising an exception writes onto it every frame it passes (``__traceback__``). An
    error a torch Future keeps (in C++, out of the collector's sight) and raises to each of
    its readers would keep the frames of the reader that caught it, and so the future
    those frames hold, for good: a failed call waited on in a function that kept its
    future leaked both, every time. From Python 3.12 the frames of two threads raising the
    one object at once even land on each other's traceback. A copy per read carries that
    reader's frames, and goes when the reader lets it go. (With readers in several threads
    each takes off what it wrote after it wrote it: the last write of all is a clear.)
    """
    exc.__traceback__ = None
    try:
        shipped = _by_state(exc)
        copy = _rebuild_by_state(shipped.cls, shipped.args, shipped.state)
        if str(copy) != str(exc):
            return exc
    except Exception:
        return exc
    notes = shipped.state.get("__notes__")
    if isinstance(notes, list):
        copy.__notes__ = list(notes)  # (a note added to the copy is not added to the kept error)
    copy.__cause__, copy.__context__ = exc.__cause__, exc.__context__
    copy.__suppress_context__ = exc.__suppress_context__
    return copy


_DAEMONIC = "daemonic processes are not allowed to have children"  # multiprocessing's assertion


def _note_daemonic(exc: BaseException) -> None:
    """Say the fix on multiprocessing's bare assertion in a daemon (a pool worker, by
    default) that tried to start a process: vectorised environments and DataLoader
    workers in actor tasks meet it first."""
    if isinstance(exc, AssertionError) and str(exc) == _DAEMONIC and not getattr(exc, "__notes__", None):
        exc.add_note("this process is a daemon, which multiprocessing lets start no process: a Pool's workers "
                     "are daemons unless the pool is made with is_daemon=False, a Process when daemon=True. "
                     "Use Pool(..., is_daemon=False) (or Process(daemon=False)) for tasks that start processes "
                     "(gymnasium's AsyncVectorEnv, a DataLoader with num_workers > 0, a nested pool)")


class ExceptionWithTraceback:
    """Picklable carrier of an exception together with its formatted traceback.

    Unpickling yields the exception itself (not this wrapper), of its original type, with
    a :class:`RemoteTraceback` as ``__cause__``. Pickle drops tracebacks and exception
    chains, which is why the text is captured here, at the raising side.

    Args:
        exc: The exception to carry.
        where: Who raised it, e.g. ``"pool worker 2"`` or ``"member 'learner'"``; the
            process id is appended. None means ``"process <name>"`` of the current process.
    """

    def __init__(self, exc: BaseException, where: Optional[str] = None) -> None:
        if where is None:
            import multiprocessing

            where = f"process {multiprocessing.current_process().name!r}"
        _mainguard.note_guarded_name(exc)  # a name the script defines under its main guard: say so
        _note_daemonic(exc)
        frozen = getattr(exc, "__dict__", {}).get(_FROZEN)
        text = frozen if frozen is not None else "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        head, sep, body = text.partition("\n")
        if head.startswith("Traceback (most recent call last)") and sep:
            text = f"Traceback (most recent call last) on {where}, pid {os.getpid()}:\n{body}"
        else:  # an exception that was never raised has no stack: say where anyway
            text = f"Exception on {where}, pid {os.getpid()}:\n{text}"
        shipped = _shippable(exc)
        #: What ``unwrap`` returns: ``exc``, or a RemoteError standing in for it.
        self.exc: BaseException = exc if isinstance(shipped, _ByState) else shipped
        self._shipped = shipped
        self.tb_text = text

    def __reduce__(self) -> Any:
        return _rebuild_exception, (self._shipped, self.tb_text)

    def unwrap(self) -> BaseException:
        """Return the carried exception with the traceback chained (no pickling needed)."""
        return _rebuild_exception(self.exc, self.tb_text)


class _ByState:
    """Ships an exception by its class, ``args`` and attributes; unpickled, it is that
    exception again, made without calling its ``__init__``."""

    __slots__ = ("cls", "args", "state")

    def __init__(self, cls: Type[BaseException], args: tuple, state: Dict[str, Any]) -> None:
        self.cls, self.args, self.state = cls, args, state

    def __reduce__(self) -> Any:
        return _rebuild_by_state, (self.cls, self.args, self.state)


# Attributes an OSError keeps outside its __dict__ (its __new__ fills them from args only
# when the class has no __init__ of its own).
_OS_ERROR_FIELDS = ("errno", "strerror", "filename", "filename2")


def _rebuild_by_state(cls: Type[BaseException], args: tuple, state: Dict[str, Any]) -> BaseException:
    exc = cls.__new__(cls)  # (its own __new__: OSError's refuses to make another's)
    exc.args = args
    for name, value in state.items():
        setattr(exc, name, value)
    return exc


def _by_state(exc: BaseException, picklable_only: bool = False) -> _ByState:
    """``exc`` by state; ``picklable_only``: without the attributes that do not pickle (a
    lock, a socket, an open environment), which a note on the shipped error names."""
    state = dict(getattr(exc, "__dict__", None) or {})
    state.pop(_FROZEN, None)
    if picklable_only:
        dropped = [name for name, value in state.items() if not _pickles(value)]
        for name in dropped:
            del state[name]
        if dropped:
            note = (f"(attributes {', '.join(dropped)} of this exception could not be pickled and were left "
                    f"behind in the process that raised it)")
            state["__notes__"] = [*state.get("__notes__", []), note]
    if isinstance(exc, OSError):
        # (only those set: one set to None, even, would show in its str)
        state.update((name, getattr(exc, name)) for name in _OS_ERROR_FIELDS if getattr(exc, name) is not None)
    return _ByState(type(exc), exc.args, state)


def _shippable(exc: BaseException) -> Union[BaseException, _ByState]:
    """``exc`` when a pickle round trip gives it back; else the same exception by state;
    else a RemoteError standing in (a class that is not importable by name, or an
    attribute that cannot be pickled).

    Why by state: pickle rebuilds an exception by calling its class with ``args``. One
    whose ``__init__`` takes other arguments (``def __init__(self, env_id, reason)``)
    then fails on the other side, where the error would be about the transport, not the
    user's exception; or, worse, it is rebuilt with its fields shuffled (an OSError
    subclass whose ``__init__(path, errno)`` passes ``(errno, text)`` on). The probe's
    ``str`` tells the second from a faithful copy.
    """
    for shipped in (exc, _by_state(exc), _by_state(exc, picklable_only=True)):
        try:
            again = pickle.loads(pickle.dumps(shipped))
            if type(again) is type(exc) and str(again) == str(exc):
                return shipped
        except Exception:
            pass
    return RemoteError.standing_in(exc)


def _pickles(value: Any) -> bool:
    try:
        pickle.dumps(value)
    except Exception:
        return False
    return True


def _text(exc: BaseException) -> str:
    try:
        return str(exc)
    except Exception as err:  # (a __str__ that fails: the type is still worth naming)
        return f"<str() of the exception failed: {type(err).__name__}: {err}>"


def describe_exitcode(exitcode: Optional[int]) -> str:
    """Say how a process ended, from a ``multiprocessing`` style exit code.

    Args:
        exitcode: ``Process.exitcode``: negative for a signal, None while still running.

    Returns:
        E.g. ``"killed by signal SIGKILL (9)"`` or ``"exited with code 3"``.
    """
    if exitcode is None:
        return "is still running"
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = "unknown signal"
        return f"killed by signal {name} ({-exitcode})"
    return f"exited with code {exitcode}"


class ProcessExitedError(RuntimeError):
    """A process ended (exit code or signal) while work depended on it.

    Attributes:
        name: The process's name (e.g. ``"rank 2"``).
        pid: Its process id, None if it never started.
        exitcode: ``multiprocessing`` style exit code (negative: killed by that signal).
    """

    def __init__(self, name: str, pid: Optional[int], exitcode: Optional[int], detail: str = "") -> None:
        self.name = name
        self.pid = pid
        self.exitcode = exitcode
        self.detail = detail
        message = f"{name} (pid {pid}) {describe_exitcode(exitcode)}"
        super().__init__(f"{message}{': ' + detail if detail else ''}")

    def __reduce__(self) -> Any:
        return type(self), (self.name, self.pid, self.exitcode, self.detail)

    @property
    def signal_name(self) -> Optional[str]:
        """Name of the signal that killed the process, None if it exited by itself."""
        if self.exitcode is None or self.exitcode >= 0:
            return None
        try:
            return signal.Signals(-self.exitcode).name
        except ValueError:
            return None


class WorkerLostError(ProcessExitedError):
    """A pool worker died while it held a task; the task failed with this error."""


class NoCollectivesError(RuntimeError):
    """A collective group was asked of a World without collectives: an elastic one (its
    members change, a gloo or NCCL group's cannot; ``launch(max_restarts=...)`` makes its
    ranks one) or one created with ``collective=False``.

    The same code raises it again when restarted, so :func:`~machinlike.launch` does not
    restart a rank that failed with it: the run ends with it at once.
    """


class PeerLostError(ConnectionError):
    """An RPC member could not be reached: it died, shut down, or the link broke.

    Attributes:
        member: Name of the member.
    """

    def __init__(self, member: str, detail: str = "") -> None:
        self.member = member
        self.detail = detail
        super().__init__(f"member {member!r} is unreachable{': ' + detail if detail else ''}")

    def __reduce__(self) -> Any:
        return type(self), (self.member, self.detail)


class SilentStoreError(TimeoutError):
    """A world's store address accepted the connection and never answered: another
    program holds the port, or the store's process is frozen. Told apart from an
    unreachable store because the fix differs (a port of one's own, not a wait)."""
