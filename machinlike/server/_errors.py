"""Errors the servers raise to their callers."""

from __future__ import annotations

__all__ = ["MissingGradientError", "ServerStoppedError", "closed_here"]


class ServerStoppedError(RuntimeError):
    """A server refused work because it is stopped or its worker thread (a gradient
    server's reducer, an inference server's batcher) failed."""


class MissingGradientError(ValueError, RuntimeError):
    """A gradient push found parameters without a gradient (``.grad`` is None).

    A ``ValueError`` (the push's input is wrong) and a ``RuntimeError``, the type machin
    raised for it, so that machin code's ``except RuntimeError`` still catches it.
    """


def closed_here(what: str) -> str:
    """The message of a call through an accessor whose helper's ``close()`` ran on this member."""
    return (f"{what} was closed on this member (ServerHandles.close()): its accessors take no more calls "
            f"here; push, pull and flush before close(), or make the servers again with the helper")
