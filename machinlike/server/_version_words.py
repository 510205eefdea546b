"""Version words: a same-host puller that holds the newest version learns it without a call.

Why: a model or gradient server's puller whose model already holds the newest version
still asked the host, one call (0.84 ms on the 2-core box, BENCHMARKS.md), and actors pull
every few steps. The host now keeps each in-place pulled key's newest version in a word
of shared memory that its same-host pullers map once::

    host process (ordered server)                puller on the same host (accessor)
    -----------------------------                ----------------------------------
    Board: one shared page per process,          no word for the key (or it went stale):
      WORDS words of [tag | version]               the pull's call asks for one; the
    offer(key): a free word, a new tag,  ◄──────   reply carries it: (page by reference,
      its version the newest (server lock)         slot, tag, host name, incarnation)
    store(key, v) ─► version = v (server lock)   pull at version v: the tag is still the
    close() or collection ─► tag = 0, free         word's, its version is v and the host
                                                   is live as the same incarnation in
                                                   this World ─► "nothing new", no call

Anything else makes the call, as before: no word offered (a full board, a host on another
machine, whose page arrives as a copy and is refused), a version that is not an int, a host
that closed the server (tag 0), left, died or came back (its incarnation in this World's
roster), a World stopped or replaced here. A dead host is found by the roster's loss
detection, so a pull between its death and the verdict says "nothing new" (true: no
newer version can have been made) unless a call of the same accessor (a push, say)
already failed on the host: that drops its views, and the next pull asks, and fails too.

Reads are ordered on x86-64 only (a core's stores reach the others in order, as
``_shm._recycled`` relies on): the reader reads the tag, the version, then the tag again,
and a word freed and reused between its reads shows a changed tag. Elsewhere no word is
offered.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from typing import Any, Dict, Hashable, List, NamedTuple, Optional, Tuple

import torch

from .. import _shm
from ..distributed import World, get_world

__all__ = ["Board", "Offer", "HostWords", "Seen", "PullerWords", "as_word", "NO_VERSION", "WORDS"]

log = logging.getLogger(__name__)

WORDS = 256  # per host process: one word per in-place pulled key of its servers
NO_VERSION = -(1 << 63)  # the word of a key whose newest version is not an int: matches no model
_INT64 = (-(1 << 63) + 1, (1 << 63) - 1)


class Offer(NamedTuple):
    """What a host's reply carries: ``page`` (shared by reference on this host), the word's
    ``slot`` and ``tag``, and the host's member ``name`` and ``incarnation``. ``page`` is
    None when no word is offered (the host, name and incarnation still say for how long)."""

    page: Optional[torch.Tensor]
    slot: int
    tag: int
    name: str
    incarnation: int


class Board:
    """A host process's page of words (made on first use; a forked child makes its own)."""

    _mine: Optional["Board"] = None
    _made = threading.Lock()

    def __init__(self) -> None:
        self.page = _shm.share(torch.zeros(2 * WORDS, dtype=torch.int64))
        self._words = self.page.numpy()  # (plain stores: a word is written by its owner alone)
        self._free = list(range(WORDS - 1, -1, -1))
        self._lock = threading.Lock()
        self._tags = 0

    @classmethod
    def here(cls) -> Optional["Board"]:
        """This process's board; None where words are not offered (see the module doc), or
        when its page could not be made (no room in /dev/shm: asked again next time)."""
        if not _shm.recycled.supported():
            return None
        with cls._made:
            if cls._mine is None:
                try:
                    cls._mine = Board()
                except (RuntimeError, OSError) as err:  # (pulls make their calls, as before)
                    log.debug("no version words in this process: %s", err)
                    return None
            return cls._mine

    def take(self, version: int) -> Optional[Tuple[int, int]]:
        """A free word set to ``version``: ``(index, tag)``; None when all are taken."""
        with self._lock:
            if not self._free:
                return None
            index = self._free.pop()
            self._tags += 1
            tag = self._tags
        self._words[2 * index + 1] = version
        self._words[2 * index] = tag  # (last: a reader that sees the tag sees its version)
        return index, tag

    def write(self, index: int, version: int) -> None:
        self._words[2 * index + 1] = version

    def give_back(self, indices: List[int]) -> None:
        for index in indices:
            self._words[2 * index] = 0
        with self._lock:
            self._free.extend(indices)


def _after_fork_in_child() -> None:
    Board._mine = None  # (the parent's page: its words are the parent's)
    Board._made = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def as_word(version: Any) -> int:
    """``version`` as a word's value: itself when an int in range, else :data:`NO_VERSION`."""
    return version if type(version) is int and _INT64[0] <= version <= _INT64[1] else NO_VERSION


class HostWords:
    """The words of one ordered server's keys; its host calls ``offer`` and ``store`` under
    its lock and ``close`` once. Collected unclosed (a World stopped under its server), its
    words are freed all the same."""

    def __init__(self) -> None:
        # The process's board and the finalizer that frees these words on it, both from the
        # first word on: a server nobody pulls in place makes no page.
        self._board: Optional[Board] = None
        self._release: Optional[weakref.finalize] = None
        self._index: Dict[Hashable, Tuple[int, int]] = {}  # key -> (slot, tag); bounded by WORDS
        self._taken: List[int] = []  # (the finalizer's own list: freed at close or collection)
        self._closed = False

    def offer(self, key: Hashable, newest: Any, host: str, incarnation: int) -> Offer:
        """The word of ``key`` (made at ``newest`` if it has none) for a same-host puller
        of ``host`` (this member's name) at ``incarnation``."""
        taken = self._index.get(key)
        board = self._board
        if taken is None and not self._closed:
            board = board or Board.here()
            taken = None if board is None else board.take(as_word(newest))
            if taken is not None and board is not None:
                if self._release is None:
                    self._board, self._release = board, weakref.finalize(self, board.give_back, self._taken)
                self._index[key] = taken
                self._taken.append(taken[0])
        if taken is None or board is None:
            return Offer(None, 0, 0, host, incarnation)
        return Offer(board.page, taken[0], taken[1], host, incarnation)

    def store(self, key: Hashable, version: Any) -> None:
        """``key``'s newest version is now ``version``."""
        taken = self._index.get(key)
        if taken is not None and self._board is not None:
            self._board.write(taken[0], as_word(version))

    def close(self) -> None:
        """Free every word: its pullers call again (and find the server gone)."""
        self._closed, self._index = True, {}
        if self._release is not None:
            self._release()


class Seen:
    """A puller's view of one key's word (or of its absence), valid while the World and
    the host's incarnation are those it was offered in."""

    __slots__ = ("world", "host", "incarnation", "words", "index", "tag")

    def __init__(self, world: World, offer: Offer) -> None:
        self.world = weakref.ref(world)  # (a World stopped here is not kept alive by a view of it)
        self.host, self.incarnation = offer.name, offer.incarnation
        page = offer.page
        # A copy (a host on another machine, or a page sent by value) never changes: refused.
        usable = page is not None and offer.tag > 0 and _shm.is_shared_by_reference(page)
        # (a memoryview's items are Python ints: a read costs a tenth of a numpy scalar's)
        self.words: Optional[memoryview] = page.numpy().data if usable and page is not None else None
        self.index, self.tag = 2 * offer.slot, offer.tag

    def current(self) -> bool:
        """Whether this view still speaks for the host (see the module doc)."""
        world = get_world()
        return world is not None and world is self.world() and world.get_incarnation(self.host) == self.incarnation

    def freed(self) -> bool:
        """Whether the host freed the word (it closed the server; one made again has another)."""
        return self.words is not None and self.words[self.index] != self.tag

    def holds(self, version: Any) -> bool:
        """Whether the host's newest version is ``version`` (False: ask it)."""
        words = self.words
        if words is None or type(version) is not int or version == NO_VERSION:
            return False
        i, tag = self.index, self.tag
        return words[i] == tag and words[i + 1] == version and words[i] == tag


class PullerWords:
    """An accessor's words, by key (shared by its bounded copies; bounded by ``most``)."""

    def __init__(self, most: int = 64) -> None:
        self._seen: Dict[Hashable, Seen] = {}
        self._most = most

    def __reduce__(self) -> Tuple[Any, ...]:
        return PullerWords, (self._most,)  # (what was seen is this process's: a copy starts afresh)

    @staticmethod
    def of(accessor: object) -> "PullerWords":
        """``accessor``'s words, made on first use (its copies made after share them)."""
        found = accessor.__dict__.get("_words")
        return accessor.__dict__.setdefault("_words", PullerWords()) if found is None else found

    def answer(self, key: Hashable, version: Any) -> Tuple[bool, bool]:
        """``(nothing_new, ask)``: whether the pull is answered here, and else whether its
        call is to ask for a word (none is known that still speaks for the host)."""
        seen = self._seen.get(key)
        if seen is None or not seen.current() or seen.freed():
            return False, True
        return seen.holds(version), False

    def forget(self) -> None:
        """Drop every view: a call of the accessor failed on its host (lost, say), so the
        next pulls ask the host, and fail as that call did, before the World's verdict."""
        self._seen = {}

    def keep(self, key: Hashable, offer: Optional[Offer]) -> None:
        """Remember what a reply offered for ``key`` (None: nothing; asked again next time)."""
        world = get_world()
        if offer is None or world is None:
            self._seen.pop(key, None)
            return
        if len(self._seen) >= self._most and key not in self._seen:
            self._seen.clear()  # (keys an accessor pulls are a model or two: a full map is misuse)
        self._seen[key] = Seen(world, offer)
