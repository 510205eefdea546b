"""The seam between the public pool API (``_api``) and its two engines.

::

    PoolBase ──Engine──> ProcessCore (``_core``: worker processes, private pipes)
                    └──> ThreadCore  (``_thread``: worker threads, one queue)

Both engines honour this Protocol; ``PoolBase`` and the imap ``Feeder`` see nothing else.
This module holds no state.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Protocol, Tuple

from ._result import Job
from ._state import PoolState

__all__ = ["Engine"]


class Engine(Protocol):
    """What a pool asks of its engine."""

    processes: int  #: number of workers (processes or threads)
    name: str  #: the prefix of the engine's thread names

    @property
    def state(self) -> PoolState: ...

    def ahead(self) -> int:
        """How many chunks an imap may keep in flight beyond what was consumed."""
        ...

    def check_running(self) -> None:
        """Raise unless new work is accepted (BrokenPoolError, or ValueError once closed)."""
        ...

    def delivers_in_this_thread(self) -> bool:
        """Whether waiting here for a result would wait for this very thread."""
        ...

    def function(self, func: Callable[..., Any]) -> Any:
        """A map's function prepared once (the engine's own handle for it)."""
        ...

    def call(self, job: Job, func: Callable[..., Any], args: tuple, kwds: Optional[dict]) -> None: ...

    def map(self, job: Optional[Job], function: Any, star: bool, chunks: Iterable[Tuple[int, list]], final: bool) -> None:
        """Queue chunks ``(start, items)`` of ``job``; ``final``: no more will come (the
        last call of an imap passes no chunks and None for ``job``)."""
        ...

    def feed_opened(self) -> None: ...

    def feed_closed(self) -> None: ...

    def close(self) -> None: ...

    def terminate(self) -> None: ...

    def join(self, timeout: Optional[float]) -> None: ...
