"""Atomic checkpoints of a server host: write whole or not at all, refuse what does not fit.

Why: a host (the gradient server's primary) that dies and is restarted must resume from
a state that is complete and belongs to it. A crash mid-write must never leave a file
that loads wrong, so a checkpoint is written beside its final name, flushed to disk and
renamed over it (``os.replace`` is atomic on POSIX), then the directory is flushed::

    save(state) ──► <dir>/<name>.ckpt.tmp-<pid> ── fsync ──► os.replace ──► <dir>/<name>.ckpt
                                                                             fsync(<dir>)
    load()      ◄── <dir>/<name>.ckpt: format, kind and server name checked, then the
                    caller compares the parameter spec (names, shapes, dtypes)

A file that is not a checkpoint, is truncated, or belongs to another server raises
:class:`CheckpointError` naming the file and what does not match.
"""

from __future__ import annotations

import io
import os
import tempfile
from typing import Any, Dict, Optional

import torch

__all__ = ["CheckpointError", "Checkpointer", "check_checkpoint_dir"]

_FORMAT = "machinlike-checkpoint/1"


class CheckpointError(ValueError):
    """A checkpoint file is corrupt or does not match the server loading it."""


def check_checkpoint_dir(directory: Any) -> str:
    """``checkpoint_dir`` checked, as a str path: a path that is no file and lies under no
    file (missing parts are made at the first save).

    Raises:
        TypeError: not a path.
        ValueError: it, or the nearest part of it that exists, is a file.
    """
    if not isinstance(directory, (str, os.PathLike)):
        raise TypeError(f"checkpoint_dir must be a path (str or os.PathLike), not {type(directory).__name__}")
    directory = os.fspath(directory)
    if not isinstance(directory, str):
        raise TypeError(f"checkpoint_dir={directory!r} must be a str path, not bytes")
    path = os.path.abspath(directory)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return directory
        path = parent
    if not os.path.isdir(path):
        what = "is a file" if path == os.path.abspath(directory) else f"lies under {path!r}, a file"
        raise ValueError(f"checkpoint_dir={directory!r} {what}, not a directory: pass a directory (made if "
                         f"missing) for the servers' checkpoint files")
    return directory


class Checkpointer:
    """Saves and loads one server's checkpoint file.

    Args:
        directory: Directory of the checkpoint (created if missing).
        kind: What is checkpointed (e.g. ``"grad-server"``), checked on load.
        name: The server's name, checked on load (the file is ``<name><suffix>`` with "/"
            replaced by "_").
        suffix: Ending of the file name (a server may keep several files).

    Raises:
        TypeError: ``directory`` is not a path.
        ValueError: it, or the nearest part of it that exists, is not a directory (a
            file: the first save would fail, long after the server was built).
    """

    def __init__(self, directory: Any, kind: str, name: str, suffix: str = ".ckpt") -> None:
        self.directory = check_checkpoint_dir(directory)
        self.kind = kind
        self.name = name
        self.path = os.path.join(self.directory, name.replace("/", "_") + suffix)

    def probe(self) -> None:
        """Make the directory and write a file in it (the host, as it is built): a
        directory that cannot hold the checkpoint fails the server's creation, not its
        first save, a push minutes on. Only the host: the path may exist on its machine
        alone.

        Raises:
            OSError: it cannot be made or written in (the error's own type, e.g.
                ``PermissionError``, naming the directory, the server and the fix).
        """
        try:
            os.makedirs(self.directory, exist_ok=True)
            with tempfile.TemporaryFile(dir=self.directory):
                pass
        except OSError as err:
            raise type(err)(err.errno, f"checkpoint_dir={self.directory!r} of {self.kind} {self.name!r} cannot hold "
                                       f"its checkpoint ({err.strerror}): pass a directory this process can make "
                                       f"and write") from err

    def exists(self) -> bool:
        return os.path.exists(self.path)

    def save(self, state: Dict[str, Any]) -> None:
        """Write ``state`` (tensors and plain values) atomically."""
        os.makedirs(self.directory, exist_ok=True)
        buffer = io.BytesIO()
        torch.save({"format": _FORMAT, "kind": self.kind, "name": self.name, "state": state}, buffer)
        tmp = f"{self.path}.tmp-{os.getpid()}"
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        fd = os.open(self.directory, os.O_RDONLY)
        try:
            os.fsync(fd)  # the rename itself reaches the disk
        finally:
            os.close(fd)

    def load(self) -> Optional[Dict[str, Any]]:
        """The saved state; None when there is no checkpoint yet.

        Raises:
            CheckpointError: the file is unreadable, truncated, not a checkpoint, or made
                by another kind of server or another server name.
        """
        if not self.exists():
            return None
        try:
            data = torch.load(self.path, map_location="cpu", weights_only=False)
        except Exception as err:  # torch reports truncation as several error types
            raise CheckpointError(f"checkpoint {self.path!r} is corrupt or truncated ({type(err).__name__}: {err}); "
                                  f"delete it to start afresh") from err
        if not isinstance(data, dict) or data.get("format") != _FORMAT:
            raise CheckpointError(f"{self.path!r} is not a machinlike checkpoint (format "
                                  f"{data.get('format') if isinstance(data, dict) else type(data).__name__!r}, "
                                  f"expected {_FORMAT!r})")
        for field, mine in (("kind", self.kind), ("name", self.name)):
            if data.get(field) != mine:
                raise CheckpointError(f"checkpoint {self.path!r} belongs to {field} {data.get(field)!r}, not "
                                      f"{mine!r}: pass another checkpoint_dir")
        return data["state"]
