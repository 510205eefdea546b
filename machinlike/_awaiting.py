"""Awaiting, in an event loop, a result that another thread settles (an RPC answer, a pool
result): the loop keeps running; the settling thread wakes it.

    waiter, wake = loop_waker()     in the coroutine, on the loop's thread
    (register wake with the result)
    await waiter                    ◄── wake(): call_soon_threadsafe(set the waiter) from
                                        whichever thread settles the result
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable, Tuple

__all__ = ["loop_waker"]


def loop_waker() -> Tuple["asyncio.Future[None]", Callable[[Any], None]]:
    """A future of the running loop and the callable (one argument, ignored) that
    completes it from any thread.

    Raises:
        RuntimeError: no event loop runs in this thread.
    """
    loop = asyncio.get_running_loop()
    waiter: "asyncio.Future[None]" = loop.create_future()

    def wake(_: Any = None) -> None:
        try:
            loop.call_soon_threadsafe(_set, waiter)
        except RuntimeError:  # the loop was closed meanwhile: nobody awaits any more
            pass

    return waiter, wake


def _set(waiter: "asyncio.Future[None]") -> None:
    if not waiter.done():  # (a cancelled await)
        waiter.set_result(None)
