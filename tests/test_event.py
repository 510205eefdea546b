"""machinlike.event: OrEvent / AndEvent semantics, nesting, and wait timing.

Setter threads are started before ``wait`` and fire after a delay (that delay is the
scenario, "the event becomes set later"); the assertions bound the elapsed time instead
of relying on sleeps for ordering.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest

from machinlike.event import AndEvent, Event, OrEvent

DELAY = 0.3  # when a timer sets a child
SLACK = 1.5  # scheduling noise allowed on a loaded 2-core machine


def set_later(event: Event, delay: float = DELAY) -> threading.Timer:
    timer = threading.Timer(delay, event.set)
    # (a wait timed from here lasts DELAY at least: timed from its own start, it may not, when
    # a busy machine runs this thread again only after the timer fired)
    timer.began = time.monotonic()
    timer.start()
    return timer


def timed_wait(event, timeout, since=None):
    """``event.wait(timeout)``, and the seconds since ``since`` (None: since the wait began)."""
    begin = time.monotonic() if since is None else since
    result = event.wait(timeout)
    return result, time.monotonic() - begin


def test_event_is_a_threading_event_and_nothing_is_patched():
    a, b = Event(), Event()
    either = OrEvent(a, b)
    assert isinstance(a, threading.Event)
    assert "set" not in vars(a) and "clear" not in vars(a)
    assert type(a).set is Event.set
    a.set()
    assert a.is_set() and a.wait(0) and either.is_set()
    a.clear()
    assert not a.is_set() and not either.is_set()


@pytest.mark.parametrize("make", [OrEvent, AndEvent])
def test_wait_returns_at_once_when_already_set(make):
    a, b = Event(), Event()
    a.set()
    b.set()
    result, elapsed = timed_wait(make(a, b), 10.0)
    assert result is True and elapsed < 0.5


def test_or_event_returns_early_when_a_child_is_set():
    a, b = Event(), Event()
    either = OrEvent(a, b)
    timer = set_later(b)
    result, elapsed = timed_wait(either, 10.0, since=timer.began)
    timer.join()
    assert result is True
    assert DELAY * 0.9 <= elapsed < DELAY + SLACK


@pytest.mark.parametrize("make", [OrEvent, AndEvent])
def test_wait_never_exceeds_its_timeout(make):
    event = make(Event(), Event())
    result, elapsed = timed_wait(event, 0.3)
    assert result is False
    assert 0.29 <= elapsed < 0.3 + SLACK
    result, elapsed = timed_wait(event, 0)
    assert result is False and elapsed < 0.5


def test_and_event_needs_every_child():
    a, b = Event(), Event()
    both = AndEvent(a, b)
    a.set()
    assert not both.is_set()
    result, _ = timed_wait(both, 0.2)
    assert result is False
    timer = set_later(b)
    result, elapsed = timed_wait(both, 10.0)
    timer.join()
    assert result is True and elapsed < DELAY + SLACK


def test_nested_composites():
    a, b, c = Event(), Event(), Event()
    inner = AndEvent(a, b)
    outer = OrEvent(inner, c)
    a.set()
    assert not outer.is_set()
    timer = set_later(b)  # completes the inner AND, which completes the outer OR
    result, elapsed = timed_wait(outer, 10.0, since=timer.began)
    timer.join()
    assert result is True and inner.is_set() and DELAY * 0.9 <= elapsed < DELAY + SLACK
    a.clear()
    assert not outer.is_set()
    c.set()
    assert outer.is_set()
    deep = AndEvent(OrEvent(AndEvent(a, b), c), OrEvent(c))
    assert deep.is_set()
    c.clear()
    assert not deep.is_set()


def test_concurrent_setters_are_never_missed():
    # Two threads set the two children of an AND while the main thread waits: whatever
    # the interleaving, the wait must return True as soon as both are set.
    for _ in range(200):
        a, b = Event(), Event()
        both = AndEvent(a, b)
        setters = [threading.Thread(target=e.set) for e in (a, b)]
        for t in setters:
            t.start()
        assert both.wait(10.0) is True
        for t in setters:
            t.join()


def test_many_waiters_all_wake():
    a = Event()
    either = OrEvent(a, Event())
    results = []
    waiters = [threading.Thread(target=lambda: results.append(either.wait(10.0))) for _ in range(8)]
    for t in waiters:
        t.start()
    timer = set_later(a, 0.1)
    for t in waiters:
        t.join(20.0)
    timer.join()
    assert results == [True] * 8


def test_dropped_composite_is_forgotten():
    a = Event()
    OrEvent(a)
    gc.collect()
    assert len(a._observers) == 0
    a.set()  # no observer left to notify, no error


def test_plain_threading_event_is_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"machinlike\.event\.Event\(\)"):
        OrEvent(Event(), threading.Event())
    with pytest.raises(TypeError, match="argument 0"):
        AndEvent("not an event")


def test_argument_validation():
    with pytest.raises(ValueError, match="at least one event"):
        OrEvent()
    either = OrEvent(Event())
    with pytest.raises(ValueError, match=r"timeout=-[0-9.]* must be a number of seconds >= 0 \(finite\)"):
        either.wait(-1)
    with pytest.raises(TypeError, match="timeout=.* must be a number of seconds, not"):
        either.wait("1")
    assert "OrEvent unset of 1 events" in repr(either)


def test_public_names():
    import machinlike.event as module

    assert sorted(module.__all__) == ["AndEvent", "Event", "OrEvent"]
