"""Errors the servers raise to their callers."""

from __future__ import annotations

__all__ = ["ServerStoppedError"]


class ServerStoppedError(RuntimeError):
    """A server refused work because it is stopped or its worker thread (a gradient
    server's reducer, an inference server's batcher) failed."""
