"""A ``multiprocessing`` process that reports how its target ended.

Data flow::

    parent                                   child
    start() ── Process pickled (ctx's Popen) ──> loads (target, args, kwargs, cleaner);
            │   target/args/kwargs/cleaner as        daemon: watch_parent()
            │   one machinlike.pickle payload        run() [target(*args, **kwargs)]; cleaner()
            │                                         │ exception / sys.exit(n != 0)
    report pipe (read end) <────── one record ────────┘ (nothing on success)
    sentinel (exit) ───────> exception / watch() / join()

``exception`` combines the record (if any) with the exit code:

=============================  ==========================================================
the child ...                  ``exception``
=============================  ==========================================================
returned                       None
raised ``E``                   ``E`` (original type; ``__cause__``: RemoteTraceback)
called ``sys.exit(n)``, n!=0   ProcessExitedError(exitcode n, "the target called
                               sys.exit(n)"), ``__cause__``: where it was called
called ``os._exit(n)``, n!=0   ProcessExitedError "exited with code n"
was killed by a signal         ProcessExitedError "killed by signal SIGKILL (9)" etc.
=============================  ==========================================================

``sys.exit`` becomes a :class:`~machinlike.exception.ProcessExitedError`, not a
``SystemExit``, so that ``watch()`` cannot silently end the parent.

Every failure is also a :class:`ProcessException` (machin's catch-all for a child's
failure): ``exception`` is an instance of a subclass of both the child's type and
``ProcessException``, created once per type, so ``except ValueError`` and ``except
ProcessException`` both catch it. It pickles as the plain original type.

As with ``multiprocessing.Process``, a subclass may override ``run()`` instead of passing
a target; reporting and the cleaner still apply.
"""

from __future__ import annotations

import threading
import time
import weakref
from multiprocessing import connection
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple, Union, cast

from . import _checks, _lifeline, _mainguard, _reductions, _warm
from ._reductions import cuda_counters
from ._report_fit import fit_report
from ._warm import resolve_context
from .exception import ExceptionWithTraceback, ProcessExitedError, RemoteError, RemoteTraceback
from .pickle import dumps, dumps_to_cpu, loads

__all__ = ["Process", "ProcessException"]

_EXCEPTION = "exception"
_EXIT = "exit"


def _check_callable(value: Any, param: str) -> None:
    if value is not None and not callable(value):
        raise TypeError(f"{param} must be callable or None, not {type(value).__name__}")
    _checks.not_async(param, value, "in the child process")


def _add_note(exc: BaseException, note: str) -> None:
    add_note = getattr(exc, "add_note", None)  # Python >= 3.11
    if add_note is not None:
        add_note(note)


def call_with_cleaner(
    target: Optional[Callable[..., Any]], args: Iterable[Any], kwargs: Mapping[str, Any],
    cleaner: Optional[Callable[[], Any]],
) -> None:
    """Run ``target``, then ``cleaner`` even if ``target`` raised.

    If both raise, the target's exception propagates, with a note about the cleaner's.
    """
    error: Optional[BaseException] = None
    try:
        if target is not None:
            target(*args, **kwargs)
    except BaseException as exc:
        error = exc
    if cleaner is not None:
        try:
            cleaner()
        except BaseException as exc:
            if error is None:
                raise
            _add_note(error, f"the cleaner raised as well: {type(exc).__name__}: {exc}")
    if error is not None:
        raise error


class ProcessException(Exception):
    """Mixed into every failure :attr:`Process.exception` reports (machin's name).

    machin wrapped a child's error in a ``ProcessException`` holding its text. Here the
    reported exception keeps its own type and attributes, and its class also derives
    from ``ProcessException``, so both ``except ProcessException`` (machin code) and
    ``except ValueError`` work. A type that cannot be subclassed (rare: a C extension
    type without the base-type flag) is reported unchanged, and is then not a
    ``ProcessException``.
    """


# mix-in -> original exception type -> its subclass that is also the mix-in (ProcessException,
# thread.ThreadException); weak on the original, so a class defined at run time can still
# be collected.
_tagged_types: "Dict[type, weakref.WeakKeyDictionary[type, type]]" = {}
_tagged_lock = threading.Lock()


def _rebuild_tagged(plain: BaseException, mixin: type = ProcessException) -> BaseException:
    return tag_exception(plain, mixin)


def _reduce_tagged(self: BaseException) -> Any:
    # Pickle as the plain original (found by reference), tagged again when loaded.
    original, mixin = type(self).__bases__
    return _rebuild_tagged, (_copy_exception(self, original), mixin)


def _copy_exception(exc: BaseException, cls: type) -> BaseException:
    new = cls.__new__(cls, *exc.args)
    new.__dict__.update(exc.__dict__)
    new.args = exc.args
    new.__cause__, new.__context__ = exc.__cause__, exc.__context__
    new.__suppress_context__ = exc.__suppress_context__
    new.__traceback__ = exc.__traceback__
    return new


def _tagged_type(cls: type, mixin: type) -> type:
    with _tagged_lock:
        kinds = _tagged_types.setdefault(mixin, weakref.WeakKeyDictionary())
        tagged = kinds.get(cls)
        if tagged is None:
            # Same name and module, so tracebacks and messages read as the child's type.
            tagged = type(cls.__name__, (cls, mixin), {
                "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                "__reduce__": _reduce_tagged, "__doc__": cls.__doc__,
            })
            kinds[cls] = tagged
        return tagged


def tag_process_exception(exc: BaseException) -> BaseException:
    """``exc`` as an instance of a subclass of its type and :class:`ProcessException`.

    Returns ``exc`` itself when it already is a ``ProcessException`` or its type cannot
    be subclassed.
    """
    return tag_exception(exc, ProcessException)


def tag_exception(exc: BaseException, mixin: type) -> BaseException:
    """``exc`` as an instance of a subclass of its type and ``mixin`` (its attributes,
    cause and traceback kept); ``exc`` itself when it already is one or its type cannot
    be subclassed."""
    if isinstance(exc, mixin):
        return exc
    try:
        return _copy_exception(exc, _tagged_type(type(exc), mixin))
    except Exception:  # an unsubclassable type or an unusual constructor: keep it as it is
        return exc


class Process(BaseProcess):
    """Like ``multiprocessing.Process``, plus ``exception``, ``watch()`` and ``cleaner``.

    The target, its arguments and the cleaner travel through :mod:`machinlike.pickle`
    (tensors shared, not copied, as with the standard process), so lambdas, closures and
    local functions work as targets under any start method. Under ``ctx="fork"`` nothing
    is pickled: the child has a copy-on-write copy of the arguments, and a tensor is shared
    only when it is in shared memory already (``tensor.share_memory_()``).

    Args:
        group: Must be None (reserved, as in ``multiprocessing``).
        target: Callable run in the child; None runs nothing.
        name: Process name; None for ``Process-N``.
        args: Positional arguments for ``target``.
        kwargs: Keyword arguments for ``target``.
        cleaner: Callable run in the child after ``target``, even when it raised.
        ctx: Context that starts the process: None for the warm forkserver (spawn where
            unavailable), a start method name, or a context object.
        daemon: Daemon flag; None inherits the creating process's. A daemon child also
            ends by itself when its parent dies.

    Raises:
        TypeError: ``target`` or ``cleaner`` is not callable, ``args`` not iterable,
            ``kwargs`` not a mapping, ``ctx`` of a wrong type.
        ValueError: ``group`` is not None, or ``ctx`` names an unknown start method.
    """

    # BaseProcess's private fields this class drives (CPython's multiprocessing/process.py;
    # typeshed leaves them out), and the warm start's stdio slots.
    _popen: Any
    _check_closed: Callable[[], None]
    _stdio_slots: Tuple[int, ...]

    def __init__(
        self,
        group: None = None,
        target: Optional[Callable[..., Any]] = None,
        name: Optional[str] = None,
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] = {},
        cleaner: Optional[Callable[[], Any]] = None,
        ctx: Union[None, str, BaseContext] = None,
        *,
        daemon: Optional[bool] = None,
    ) -> None:
        if group is not None:
            raise ValueError(f"group must be None (reserved for future use), got {group!r}")
        _check_callable(target, "target")
        _check_callable(cleaner, "cleaner")
        try:
            args = tuple(args)
        except TypeError:
            raise TypeError(f"args must be an iterable, not {type(args).__name__}") from None
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"kwargs must be a mapping, not {type(kwargs).__name__}")
        # A context object (typeshed's BaseContext has no .Process); None in the child.
        self._ctx: Any = cast(Any, resolve_context(ctx))
        super().__init__(None, target, name, args, dict(kwargs), daemon=daemon)
        self._start_method = getattr(self._ctx.Process, "_start_method", None)
        self._cleaner = cleaner
        self._call_payload: Optional[bytes] = None
        self._report_reader: Optional[connection.Connection] = None
        self._report_writer: Optional[connection.Connection] = None
        self._init_parent_side()
        # what a subclass adds after this point travels with the target, through
        # machinlike.pickle (so lambdas and local classes work there too)
        self._own_keys = frozenset(self.__dict__) | {"_own_keys"}

    def _init_parent_side(self) -> None:
        self._cuda_given: List[cuda_counters.CudaCounter] = []
        self._report_lock = threading.Lock()
        self._record: Optional[tuple] = None
        self._settled = False
        self._outcome: Optional[BaseException] = None

    # ---------------------------------------------------------------- starting

    def _Popen(self, process_obj: BaseProcess) -> Any:  # called by BaseProcess.start
        return self._ctx.Process._Popen(process_obj)

    def start(self) -> None:
        """Start the child through this process's context.

        Raises:
            pickle.PicklingError, TypeError: the target, an argument or the cleaner
                cannot be pickled (spawn-like contexts only).
        """
        _mainguard.check(f"{type(self).__name__}.start()")
        _mainguard.check_main_file(f"{type(self).__name__}.start()", self._start_method)
        self._report_reader, self._report_writer = connection.Pipe(duplex=False)
        try:
            super().start()
            self._cleaner = None  # like the target: the child has its own now
        except BaseException:
            self._report_reader.close()
            if self._popen is None:
                self._give_back_cuda()  # (no child took them)
            raise
        finally:
            # The child holds its own copy; without ours, a child that dies mid-report
            # shows up here as EOF instead of a read that never ends.
            self._report_writer.close()

    def __getstate__(self) -> Dict[str, Any]:
        # Only a spawn-like start pickles a process, and only once, from start(). The
        # multiprocessing bookkeeping goes through the context's pickler; the user's
        # part is one machinlike.pickle payload, loaded in the child where a failure to
        # load it can still be reported.
        state = {k: v for k, v in self.__dict__.items() if k in self._own_keys}
        for key in ("_ctx", "_report_lock", "_report_reader", "_target", "_args", "_kwargs", "_cleaner"):
            state.pop(key, None)
        warm = ("_stdio_slots", "_environ")  # set by a warm start; needed before the payload loads
        extra = {k: v for k, v in self.__dict__.items() if k not in self._own_keys and k not in warm}
        for key in warm:
            if key in self.__dict__:
                state[key] = self.__dict__[key]
        # The primer connects the child to our shared-memory manager (if we have one),
        # sparing it the start of its own when it shares a tensor.
        primer = _reductions.manager_primer()
        user = (self._target, self._args, self._kwargs, self._cleaner, extra, primer)
        state.pop("_cuda_given", None)
        with cuda_counters.collecting() as given:
            state["_call_payload"] = dumps(user, copy_tensor=False)
        self._cuda_given = given  # CUDA tensors' references: given back once the child ended
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._ctx = None
        self._report_reader = None
        self._init_parent_side()

    # ---------------------------------------------------------------- child side

    def _bootstrap(self, parent_sentinel: Optional[int] = None) -> int:
        # The child's entry point (multiprocessing calls it, then it calls run()). The
        # reporting wraps run() here, so that a subclass overriding run() keeps it.
        body = self.run
        self.run = lambda: self._run_and_report(body)  # type: ignore[method-assign]
        if getattr(self, "_stdio_slots", ()):
            _warm.child_setup(self)  # a warm server's child: its parent's stdio, its server
        return super()._bootstrap(parent_sentinel)  # type: ignore[misc]

    def _run_and_report(self, body: Callable[[], Any]) -> None:
        if self.daemon:
            _lifeline.watch_parent()
        writer = self._report_writer
        try:
            if self._call_payload is not None:
                self._target, self._args, self._kwargs, self._cleaner, extra, _ = loads(self._call_payload)
                self.__dict__.update(extra)
                self._call_payload = None
            call_with_cleaner(body, (), {}, self._cleaner)
            # The process ends with os._exit, past every finalizer: what the call received
            # in named shared memory (a large array, a shared tensor) must be let go here,
            # or its segment outlived both processes until torch's manager exited.
            self._target = self._args = self._kwargs = None
        except SystemExit as exc:
            if exc.code not in (None, 0):
                code = exc.code if isinstance(exc.code, int) else 1
                text = ExceptionWithTraceback(exc, where=f"process {self.name!r}").tb_text
                self._send(writer, (_EXIT, code, f"the target called sys.exit({exc.code!r})", text))
            raise
        except BaseException as exc:
            self._send(writer, (_EXCEPTION, ExceptionWithTraceback(exc, where=f"process {self.name!r}")))
            raise  # the standard bootstrap prints it and sets exit code 1
        finally:
            if writer is not None:
                writer.close()

    @staticmethod
    def _send(writer: Optional[connection.Connection], record: tuple) -> None:
        if writer is None:
            return
        try:
            data = dumps_to_cpu(record)  # (a CUDA tensor in it arrives as a CPU copy: the parent may have no GPU)
        except Exception as exc:  # should not happen: ExceptionWithTraceback stands in
            data = dumps((_EXCEPTION, ExceptionWithTraceback(RemoteError(type(exc).__name__, str(exc)))))
        # (a report larger than the pipe held the child until the parent read it: see _report_fit)
        data = fit_report(writer.fileno(), data, record, dumps_to_cpu)
        try:
            writer.send_bytes(data)
        except OSError:  # the parent is gone or closed its end: nobody to tell
            pass

    # ---------------------------------------------------------------- parent side

    @property
    def exception(self) -> Optional[BaseException]:
        """How the child failed; None if it succeeded, never started, or is still
        running without having reported a failure.

        Never blocks beyond reading a report the child is writing. See the module
        docstring for what each way of ending gives. Once known, the same object is
        returned every time.
        """
        with self._report_lock:
            if self._settled:
                if self._cuda_given and self._popen is not None and self._popen.poll() is not None:
                    self._give_back_cuda()  # (settled by its report before it ended)
                return self._outcome
            if self._popen is None:
                return None
            self._read_record()
            exitcode = self._popen.poll()
            if self._record is None and exitcode is not None:
                self._read_record()  # the child wrote (if at all) before it ended
            if exitcode is not None:
                self._give_back_cuda()
            if self._record is None and exitcode is None:
                return None  # running, nothing reported yet
            # a report decides on its own; without one, the exit code does
            outcome = self._decide(exitcode)
            self._outcome = None if outcome is None else tag_process_exception(outcome)
            self._settled = True
            if self._report_reader is not None:
                self._report_reader.close()
            return self._outcome

    def watch(self) -> None:
        """Raise :attr:`exception` here if there is one; otherwise do nothing."""
        exc = self.exception
        if exc is not None:
            raise exc

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the child to end, reading its report meanwhile.

        Args:
            timeout: Seconds to wait; None waits until it ends.

        Raises:
            ValueError: the process was not started, or is closed.
        """
        timeout = _checks.seconds_or_none("timeout", timeout, allow_zero=True)
        self._check_closed()
        if self._popen is None:
            raise ValueError("can only join a started process")
        deadline = None if timeout is None else time.monotonic() + timeout
        sentinel = self.sentinel
        while True:
            reader = self._report_reader
            watch: List[Union[int, connection.Connection]] = [sentinel]
            if reader is not None and not reader.closed and self._record is None:
                watch.append(reader)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                ready = connection.wait(watch, remaining)
            except (OSError, ValueError):  # another thread closed the reader meanwhile
                continue
            if reader is not None and reader in ready:
                with self._report_lock:
                    self._read_record()
            if sentinel in ready:
                super().join()  # it has ended: this only collects the exit status
                self._give_back_cuda()
                return
            if not ready:
                return

    def close(self) -> None:
        """Release the process's resources (see ``multiprocessing.Process.close``).

        The outcome is settled first, so :attr:`exception` still answers afterwards.
        """
        self.exception  # noqa: B018 - settles the outcome while the popen still exists
        super().close()
        if self._report_reader is not None:
            self._report_reader.close()

    def _give_back_cuda(self) -> None:
        """(the child has ended) Give back the references of CUDA tensors it was sent that
        it did not free (it was killed, or exited past its deleters): torch keeps their
        memory here until then, for good (see ``_reductions.cuda_counters``)."""
        given, self._cuda_given = self._cuda_given, []
        if given:
            cuda_counters.release_unheld(given)

    def _read_record(self) -> None:
        reader = self._report_reader
        if self._record is not None or reader is None or reader.closed:
            return
        try:
            if not reader.poll(0):
                return
            data = reader.recv_bytes()
        except (EOFError, OSError):  # no report, or cut short by the child's death
            reader.close()
            return
        try:
            self._record = loads(data)
        except Exception as exc:
            reason = f"the child's exception could not be loaded here: {exc}"
            self._record = (_EXCEPTION, RemoteError(type(exc).__name__, reason))
        reader.close()

    def _decide(self, exitcode: Optional[int]) -> Optional[BaseException]:
        record = self._record
        if record is not None and record[0] == _EXCEPTION:
            return record[1]
        if record is not None and record[0] == _EXIT:
            _, code, detail, text = record
            error = ProcessExitedError(self.name, self.pid, code, detail)
            error.__cause__ = RemoteTraceback(text)
            return error
        if exitcode:
            return ProcessExitedError(self.name, self.pid, exitcode, _mainguard.explain(exitcode))
        return None
