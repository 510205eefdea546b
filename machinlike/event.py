"""Events that are set when any (:class:`OrEvent`) or all (:class:`AndEvent`) children are.

Design: a child must be a :class:`machinlike.event.Event` (a ``threading.Event`` that
tells its observers when it is set or cleared) or another composite. A composite waits on
its *own* condition variable and re-evaluates its children whenever one of them changes,
so ``wait``::

* returns at once when the condition already holds;
* returns as soon as a child's change makes it hold (no sleeping, no polling);
* never waits longer than ``timeout`` (one monotonic deadline for all wake-ups).

Nothing is patched on the children: notification is part of :class:`Event`'s ``set`` and
``clear``. A plain ``threading.Event`` cannot tell anyone it changed, so it is refused
with a ``TypeError`` rather than polled. Composites observe their children weakly; a
dropped composite stops being notified.

Composites are level-triggered: ``wait`` reports whether the condition held when it was
last evaluated. A child that is set and cleared again before a waiter wakes up ("pulsed")
may go unnoticed; signal with ``set()`` and let the consumer ``clear()``.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional, Union

from . import _checks

__all__ = ["Event", "OrEvent", "AndEvent"]


class _Observed:
    """Mixin: a set of weakly held composite observers, told about every change."""

    def _init_observed(self) -> None:
        self._observers: "weakref.WeakSet[_CompositeEvent]" = weakref.WeakSet()
        self._observers_lock = threading.Lock()

    def _observe(self, observer: "_CompositeEvent") -> None:
        with self._observers_lock:
            self._observers.add(observer)

    def _tell_observers(self) -> None:
        with self._observers_lock:
            observers = list(self._observers)
        for observer in observers:
            observer._child_changed()


class Event(threading.Event, _Observed):
    """A ``threading.Event`` that can be a child of :class:`OrEvent` / :class:`AndEvent`."""

    def __init__(self) -> None:
        super().__init__()
        self._init_observed()

    def set(self) -> None:
        """Set the flag, wake its waiters and those of every composite above it."""
        super().set()
        self._tell_observers()

    def clear(self) -> None:
        """Reset the flag (composites above it re-evaluate)."""
        super().clear()
        self._tell_observers()


_Child = Union[Event, "_CompositeEvent"]


class _CompositeEvent(_Observed):
    def __init__(self, *events: _Child) -> None:
        kind = type(self).__name__
        if not events:
            raise ValueError(f"{kind} needs at least one event")
        for index, event in enumerate(events):
            if not isinstance(event, (Event, _CompositeEvent)):
                hint = ""
                if isinstance(event, threading.Event):
                    hint = (
                        "; a plain threading.Event cannot notify a composite: "
                        "create it as machinlike.event.Event()"
                    )
                raise TypeError(
                    f"{kind} argument {index} must be a machinlike.event.Event, OrEvent or AndEvent, "
                    f"not {type(event).__module__}.{type(event).__qualname__}{hint}"
                )
        self._events = tuple(events)
        self._cond = threading.Condition(threading.Lock())
        self._init_observed()
        for event in self._events:
            event._observe(self)

    @property
    def events(self) -> tuple:
        """The children, in the order given."""
        return self._events

    def is_set(self) -> bool:  # pragma: no cover - overridden
        raise NotImplementedError

    def wait(self, timeout: Optional[float] = None) -> bool:
        """Block until the condition holds, at most ``timeout`` seconds.

        Args:
            timeout: Seconds; None waits indefinitely, 0 just checks.

        Returns:
            Whether the condition held when ``wait`` returned.

        Raises:
            TypeError: ``timeout`` is not a number.
            ValueError: ``timeout`` is negative, NaN or infinite.
        """
        timeout = _checks.seconds_or_none("timeout", timeout, allow_zero=True)
        if self.is_set():
            return True
        with self._cond:
            # wait_for keeps one monotonic deadline across wake-ups
            return self._cond.wait_for(self.is_set, timeout)

    def _child_changed(self) -> None:
        with self._cond:
            self._cond.notify_all()
        self._tell_observers()  # outside our lock: no lock is held while taking another

    def __repr__(self) -> str:
        state = "set" if self.is_set() else "unset"
        return f"<{type(self).__name__} {state} of {len(self._events)} events>"


class OrEvent(_CompositeEvent):
    """Set while at least one child is set.

    Args:
        *events: :class:`Event`, :class:`OrEvent` or :class:`AndEvent` instances.

    Raises:
        ValueError: no events given.
        TypeError: an argument is not one of those (e.g. a plain ``threading.Event``).
    """

    def is_set(self) -> bool:
        """Whether any child is set."""
        return any(event.is_set() for event in self._events)


class AndEvent(_CompositeEvent):
    """Set while every child is set.

    Args:
        *events: :class:`Event`, :class:`OrEvent` or :class:`AndEvent` instances.

    Raises:
        ValueError: no events given.
        TypeError: an argument is not one of those (e.g. a plain ``threading.Event``).
    """

    def is_set(self) -> bool:
        """Whether all children are set."""
        return all(event.is_set() for event in self._events)

