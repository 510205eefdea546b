"""Errors that only pools raise (the worker-lost error lives in :mod:`machinlike.exception`)."""

from __future__ import annotations

import multiprocessing

__all__ = ["BrokenPoolError", "PoolTerminatedError", "PoolTimeoutError"]


class BrokenPoolError(RuntimeError):
    """The pool cannot run tasks any more.

    Raised for every pending task and every new submission once the pool is broken:
    its initializer raised in a worker, workers kept dying while starting, or a worker
    could not be started at all. ``__cause__`` is what broke it.
    """


class PoolTerminatedError(RuntimeError):
    """The pool was terminated (``terminate()``, garbage collection or interpreter exit)
    before this task finished."""


class PoolTimeoutError(multiprocessing.TimeoutError, TimeoutError):
    """A result did not arrive in time.

    It is both ``multiprocessing.TimeoutError`` (what the standard pool raises) and the
    built-in ``TimeoutError``, so either ``except`` clause catches it.
    """
