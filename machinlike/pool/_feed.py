"""Lazy input for ``imap`` / ``imap_unordered``: one feeder thread per pool.

    IMapIterator.next() ── a chunk taken ──┐
                                           ▼
    "machinlike-poolN-feeder": for each open feed, round robin, once half its window of
    ``ahead`` items past what was consumed is free: pull chunks from the input (user
    code, no lock held) and hand them to the engine.

The input is pulled lazily while the pool runs: an endless generator is fine, and an
iterator the caller abandons (garbage collected) stops its feed and closes the input.
Once the pool is closed the window is lifted, so that ``close(); join()`` cannot wait on
a consumer that is not reading. The thread exists only while feeds are open.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from typing import TYPE_CHECKING, Any, Callable, Deque, Iterator, Optional

from ._errors import PoolTerminatedError
from ._state import PoolState

if TYPE_CHECKING:
    from ._engine import Engine

__all__ = ["Feeder"]

_ENDED = (PoolState.TERMINATE, PoolState.BROKEN)
_MIN_AHEAD = 256  # items: a window of a few single items woke the feeder every few results
_CHUNKS_AT_ONCE = 64  # chunks pulled and handed to the engine in one round at most
# Iterators whose next item is in memory already: pulling several chunks never waits.
_NEVER_BLOCKS = frozenset({type(iter([])), type(iter(())), type(iter(range(0)))})


class _Feed:
    __slots__ = ("feeder", "source", "chunksize", "star", "handle", "ref", "position", "consumed", "ahead", "refill", "cancelled")
    # position: written by the feeder thread only; consumed: by the iterator, under its
    # own lock. Each side reads the other's bare (ints: GIL-atomic).

    def __init__(self, feeder: "Feeder", source: Iterator[Any], chunksize: int, star: bool, handle: Any, ahead: int) -> None:
        self.feeder = feeder
        self.source = source
        self.chunksize = chunksize
        self.star = star
        self.handle = handle
        self.ref: Optional[weakref.ref] = None
        self.position = 0  # items pulled from the input so far
        self.consumed = 0  # items the iterator has taken (a chunk at a time)
        self.ahead = ahead
        # Room that wakes the feeder: half the window, so that a round hands over several
        # chunks, not one per chunk consumed.
        self.refill = max(chunksize, (ahead // 2) // chunksize * chunksize)
        self.cancelled = False

    def consumed_chunk(self, count: int) -> None:
        """``count`` items were taken (called under the iterator's lock: one writer).

        Takes the feeder's lock only when it sleeps and this reopened enough room.
        """
        self.consumed += count
        feeder = self.feeder
        if feeder._idle and self.position - self.consumed <= self.ahead - self.refill:
            feeder._wake()


class Feeder:
    """Feeds the imap calls of one pool (see the module docstring).

    Args:
        backend: The pool's engine (``map``, ``function``, ``feed_opened`` ...).
        name: Prefix for the thread name.
    """

    def __init__(self, backend: "Engine", name: str) -> None:
        self._backend = backend
        self._name = name
        # Reentrant: the abandonment callback (a weakref callback, run by the garbage
        # collector in whatever thread) may fire in a thread that holds it.
        self._cv = threading.Condition(threading.RLock())
        self._feeds: Deque[_Feed] = deque()
        self._thread: Optional[threading.Thread] = None
        self._unbounded = False
        self._stopped = False
        # True while the thread sleeps for room: set under the lock before its last look,
        # read bare by consumers after they count. Whichever writes first is seen by the
        # other, so a consumer that reopens room either is seen or wakes the thread.
        self._idle = False

    def start(self, result: Any, func: Callable[..., Any], source: Iterator[Any], chunksize: int, star: bool) -> None:
        """Open a feed that fills ``result`` (an IMapIterator) from ``source``."""
        backend = self._backend
        try:
            handle = backend.function(func)
        except Exception as exc:  # e.g. an unpicklable function: raised by next()
            result._abort(exc)
            return
        feed = _Feed(self, source, chunksize, star, handle, max(backend.ahead(), -(-_MIN_AHEAD // chunksize)) * chunksize)
        feed.ref = weakref.ref(result, lambda _ref, feed=feed: self._abandon(feed))  # type: ignore[misc]
        result._feed = feed
        backend.feed_opened()
        with self._cv:
            self._feeds.append(feed)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self._name}-feeder", daemon=True)
                self._thread.start()
            self._cv.notify()

    def unbound(self) -> None:
        """The pool was closed: feed everything without waiting for consumers."""
        with self._cv:
            self._unbounded = True
            self._cv.notify()

    def stop(self) -> None:
        """The pool was terminated: fail and drop every feed."""
        with self._cv:
            self._stopped = True
            feeds = list(self._feeds)
            self._cv.notify()
        error = PoolTerminatedError("the pool was terminated before this imap finished")
        for feed in feeds:
            result = feed.ref() if feed.ref is not None else None
            if result is not None:
                result._abort(error)

    def join(self, timeout: Optional[float]) -> bool:
        """Wait for the feeder thread to end; False if it still runs after ``timeout``."""
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout)
        return not thread.is_alive()

    # ------------------------------------------------------------------ the thread

    def _wake(self) -> None:
        with self._cv:
            self._cv.notify()

    def _abandon(self, feed: _Feed) -> None:
        feed.cancelled = True
        with self._cv:
            self._cv.notify()

    def _run(self) -> None:
        while True:
            with self._cv:
                feed = self._next_feed()
                while feed is None:
                    if not self._feeds:
                        self._thread = None
                        return
                    self._idle = True
                    feed = self._next_feed()  # a look after saying so (see _idle)
                    if feed is None:
                        self._cv.wait()
                        feed = self._next_feed()
                self._idle = False
            self._advance(feed)

    def _next_feed(self) -> Optional[_Feed]:
        halted = self._stopped or self._backend.state in _ENDED
        feeds = self._feeds
        for _ in range(len(feeds)):
            feed = feeds[0]
            feeds.rotate(-1)
            # Fed again once a whole chunk fits in its window.
            if halted or feed.cancelled or self._unbounded or feed.position - feed.consumed <= feed.ahead - feed.refill:
                return feed
        return None

    def _advance(self, feed: _Feed) -> None:
        result = feed.ref() if feed.ref is not None else None
        if result is None or feed.cancelled:
            self._finish(feed, close_source=True)
            return
        backend = self._backend
        if self._stopped or backend.state in _ENDED:
            error: BaseException = PoolTerminatedError("the pool was terminated before this imap finished")
            if backend.state is PoolState.BROKEN:
                try:
                    backend.check_running()
                except Exception as exc:  # the BrokenPoolError, with its cause
                    error = exc
            result._abort(error)
            self._finish(feed, close_source=True)
            return
        # From an input that never blocks (a list's, a tuple's or a range's iterator), as
        # many chunks as its window has room for in one hand-over (up to _CHUNKS_AT_ONCE):
        # one chunk a round cost a wake-up of the engine per item at chunksize=1 (a P2PPool's
        # imap ran at a third of multiprocessing.Pool's rate). Any other input (a generator
        # may wait for its next item) one chunk a round: what was pulled goes out at once.
        count = 1
        if type(feed.source) in _NEVER_BLOCKS:
            room = feed.ahead - (feed.position - feed.consumed)  # (consumed: an int, read bare)
            count = _CHUNKS_AT_ONCE if self._unbounded else max(1, min(_CHUNKS_AT_ONCE, room // feed.chunksize))
        chunks = []
        failure: Optional[BaseException] = None
        ended = False
        for _ in range(count):
            try:
                items = list(itertools.islice(feed.source, feed.chunksize))
            except BaseException as exc:  # the input itself failed: raised at its position
                failure = exc
                break
            if items:
                chunks.append((feed.position, items))
                feed.position += len(items)
            if len(items) < feed.chunksize:
                ended = True
                break
        if chunks:
            backend.map(result, feed.handle, feed.star, chunks, False)
        if failure is not None:
            result._failed(feed.position, 1, failure)
            result._set_length(feed.position + 1)
            self._finish(feed, close_source=False)
        elif ended:
            result._set_length(feed.position)
            self._finish(feed, close_source=False)

    def _finish(self, feed: _Feed, close_source: bool) -> None:
        with self._cv:
            try:
                self._feeds.remove(feed)
            except ValueError:
                return
        backend = self._backend
        backend.map(None, feed.handle, feed.star, [], True)  # no more chunks: may drop the function
        backend.feed_closed()
        if close_source:
            close = getattr(feed.source, "close", None)
            if close is not None:
                try:
                    close()
                except Exception:  # a generator's cleanup failing is not the pool's error
                    pass
        feed.source = iter(())
