"""A ``threading.Thread`` that keeps its target's exception and runs a cleaner."""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Dict, Iterable, Mapping, Optional, Tuple

from ._checks import not_async
from .process import call_with_cleaner, tag_exception

__all__ = ["Thread", "ThreadException"]

_counter = itertools.count(1)


class ThreadException(Exception):
    """Mixed into every failure :attr:`Thread.exception` reports (machin's name).

    machin wrapped a thread's error in a ``ThreadException`` holding its text. Here the
    reported exception keeps its own type, attributes and traceback, and its class also
    derives from ``ThreadException`` (as a process's does from
    :class:`~machinlike.process.ProcessException`), so ``except ThreadException`` (machin
    code) and ``except KeyError`` both catch it. A target that called ``sys.exit(n)``,
    n != 0, is reported as a plain ``ThreadException`` saying so (its ``SystemExit`` as
    ``__cause__``): re-raised by ``watch()``, a ``SystemExit`` would end the program
    without a word.
    """


class Thread(threading.Thread):
    """Like ``threading.Thread``, plus ``exception``, ``watch()`` and ``cleaner``.

    Nothing is pickled: the thread shares the caller's objects. The exception is what the
    target raised, with its attributes and its own traceback (the thread's frames), its
    class also a :class:`ThreadException`; there is no remote traceback to chain. A
    target that raises does not go to ``threading.excepthook``: the exception waits in
    :attr:`exception`.

    Args:
        group: Must be None (reserved, as in ``threading``).
        target: Callable run in the thread; None runs nothing.
        name: Thread name; None for ``machinlike-thread-N``.
        args: Positional arguments for ``target``.
        kwargs: Keyword arguments for ``target``.
        cleaner: Callable run in the thread after ``target``, even when it raised. If
            both raise, the target's exception is kept, with a note about the cleaner's.
        daemon: Daemon flag; None inherits the creating thread's.

    Raises:
        TypeError: ``target`` or ``cleaner`` is not callable, ``args`` not iterable or
            ``kwargs`` not a mapping.
        ValueError: ``group`` is not None.
    """

    def __init__(
        self,
        group: None = None,
        target: Optional[Callable[..., Any]] = None,
        name: Optional[str] = None,
        args: Iterable[Any] = (),
        kwargs: Mapping[str, Any] = {},
        cleaner: Optional[Callable[[], Any]] = None,
        *,
        daemon: Optional[bool] = None,
    ) -> None:
        if group is not None:
            raise ValueError(f"group must be None (reserved for future use), got {group!r}")
        for value, param in ((target, "target"), (cleaner, "cleaner")):
            if value is not None and not callable(value):
                raise TypeError(f"{param} must be callable or None, not {type(value).__name__}")
            not_async(param, value, "on the thread")
        try:
            args = tuple(args)
        except TypeError:
            raise TypeError(f"args must be an iterable, not {type(args).__name__}") from None
        if not isinstance(kwargs, Mapping):
            raise TypeError(f"kwargs must be a mapping, not {type(kwargs).__name__}")
        if name is None:
            name = f"machinlike-thread-{next(_counter)}"
        # the target stays with us (run() is ours), not in threading.Thread's attributes
        super().__init__(None, None, name, daemon=daemon)
        # None once run() took it (a thread runs once)
        self._call: Optional[Tuple[Optional[Callable[..., Any]], Tuple[Any, ...], Dict[str, Any],
                                   Optional[Callable[[], Any]]]] = (target, args, dict(kwargs), cleaner)
        self._exception: Optional[BaseException] = None

    def run(self) -> None:
        """The thread's body: target, then cleaner; a failure is kept, not printed."""
        if self._call is None:
            return  # ran already
        target, args, kwargs, cleaner = self._call
        self._call = None  # like threading.Thread: do not keep the target's references
        try:
            call_with_cleaner(target, args, kwargs, cleaner)
        except SystemExit as exc:
            if exc.code not in (None, 0):
                stopped = ThreadException(f"thread {self.name!r}: its target called sys.exit({exc.code!r})")
                stopped.__cause__ = exc
                self._exception = stopped
        except BaseException as exc:
            self._exception = tag_exception(exc, ThreadException)

    @property
    def exception(self) -> Optional[BaseException]:
        """The target's (or cleaner's) exception once the thread has ended, else None: of
        its own type and :class:`ThreadException`.

        ``sys.exit(0)`` counts as success; another ``sys.exit`` code is a
        ``ThreadException`` saying so.
        """
        if self.is_alive():
            return None
        return self._exception

    def watch(self) -> None:
        """Raise :attr:`exception` here if there is one; otherwise do nothing."""
        exc = self.exception
        if exc is not None:
            raise exc
