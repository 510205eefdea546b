"""``async def`` services and functions: run on one event loop thread of the callee.

    register("relay", coroutine function) ─► as_async_execution(it): an
        ``@async_execution`` function, so the callee answers when its future completes
    a call ─► the coroutine, sent to this process's loop thread
             (run_coroutine_threadsafe) ─► its concurrent future
          done ─► the torch Future the RPC layer answers with: its value, or its exception

Why: a service that awaits other calls (a relay to an inference server, a proxy to a
replay shard) holds no RPC thread while it waits; a thousand of them pending are a
thousand coroutines on one thread, not a thousand blocked threads (``rpc_threads``). A
coroutine must not block: one that sleeps with ``time.sleep`` holds every other one
(``await asyncio.sleep``; blocking work belongs in a plain service).

The loop thread starts with the first such call and stays, asleep, for the process's
life (a daemon: it holds nothing at exit); a forked child starts its own.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import inspect
import os
import threading
from typing import Any, Callable, Coroutine, Optional

import torch
from torch.distributed import rpc

__all__ = ["is_coroutine_function", "as_async_execution", "future_of", "on_loop_thread", "blocking_error"]

_loop: Optional[asyncio.AbstractEventLoop] = None
_thread: Optional[threading.Thread] = None
_lock = threading.Lock()


def is_coroutine_function(func: Any) -> bool:
    """Whether ``func`` is an ``async def`` function (or a bound method of one)."""
    return inspect.iscoroutinefunction(func)


def _running_loop() -> asyncio.AbstractEventLoop:
    """This process's loop for coroutine services, started on first use."""
    global _loop, _thread
    with _lock:
        if _loop is None:
            loop = asyncio.new_event_loop()
            started = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(started.set)
                loop.run_forever()

            thread = threading.Thread(target=run, name="machinlike-coroutines", daemon=True)
            thread.start()
            started.wait()  # (a new thread's first step: at once)
            _loop, _thread = loop, thread
        return _loop


def on_loop_thread() -> bool:
    """Whether this thread is the loop thread of this process's coroutine services."""
    return _thread is not None and threading.current_thread() is _thread


def blocking_error(what: str) -> RuntimeError:
    """What a blocking call raises on the loop thread (see :func:`on_loop_thread`): there
    it would stall every coroutine service of the process, and wait out its timeout should
    its callee call one of them back."""
    return RuntimeError(f"{what} blocks, and this is an async def service (on the event loop thread of this "
                        f"process's coroutine services): it would stall all of them, and wait out its timeout "
                        f"should its callee call one of them back; await the asynchronous form instead "
                        f"(await group.registered_async(...), await fut)")


def _settle(fut: torch.futures.Future, done: "concurrent.futures.Future[Any]") -> None:
    if done.cancelled():
        fut.set_exception(asyncio.CancelledError("the coroutine was cancelled on the callee"))
        return
    error = done.exception()
    if error is not None:
        fut.set_exception(error)
    else:
        fut.set_result(done.result())


def future_of(coroutine: Coroutine[Any, Any, Any]) -> torch.futures.Future:
    """A torch Future of ``coroutine``'s outcome; the coroutine runs on this process's
    loop thread."""
    fut: torch.futures.Future = torch.futures.Future()
    done = asyncio.run_coroutine_threadsafe(coroutine, _running_loop())
    done.add_done_callback(functools.partial(_settle, fut))
    return fut


def as_async_execution(func: Callable[..., Any]) -> Callable[..., Any]:
    """An ``@async_execution`` function that runs the coroutine function ``func`` on this
    process's loop thread and answers with its result (or exception) once it finishes."""

    @functools.wraps(func)
    def run(*args: Any, **kwargs: Any) -> torch.futures.Future:
        return future_of(func(*args, **kwargs))

    return rpc.functions.async_execution(run)


def _after_fork_in_child() -> None:
    global _loop, _thread, _lock
    _loop = _thread = None  # (its thread did not come along)
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)
