"""Claim files of named-shared-memory payloads, and the payload tokens this process loaded.

Each pickling of a named segment adds one "in transit" reference and an empty claim file
under /dev/shm; the one load that unlinks the file releases that reference (``unlink``
succeeds for exactly one caller), every other load only maps. A per-process, bounded set
of payload tokens tells a first load from a repeat in the same process.
"""

from __future__ import annotations

import atexit
import collections
import os
import threading
from typing import Optional

__all__ = ["first_load", "make_claim", "take_claim"]


# Tokens of named-shared-memory payloads this process has loaded at least once. Bounded:
# a payload reloaded after 65536 newer ones counts as a first load again, which costs at
# worst an early unlink of the segment's name (live mappings stay valid).
_LOADED_TOKENS_MAX = 1 << 16


_loaded_tokens: "collections.OrderedDict[bytes, None]" = collections.OrderedDict()


_loaded_tokens_lock = threading.Lock()


def _after_fork_in_child() -> None:
    global _loaded_tokens_lock
    _loaded_tokens_lock = threading.Lock()  # another thread may have held it at fork


os.register_at_fork(after_in_child=_after_fork_in_child)


def first_load(token: bytes) -> bool:
    with _loaded_tokens_lock:
        if token in _loaded_tokens:
            _loaded_tokens.move_to_end(token)
            return False
        _loaded_tokens[token] = None
        if len(_loaded_tokens) > _LOADED_TOKENS_MAX:
            _loaded_tokens.popitem(last=False)
        return True


_CLAIM_DIR = "/dev/shm"


_CLAIM_PREFIX = "machinlike_claim_"


_swept_by = 0  # pid of the process that swept stale claims (once per process)


def make_claim(token: bytes, handle: bytes) -> Optional[str]:
    """Create the claim file of a payload's in-transit reference; None where /dev/shm is
    not writable (then every process's first load releases it, as torch's own path).

    The file holds the segment's name, so a claim whose segment is gone (a payload never
    loaded, once torch's manager exited) is known to be garbage and swept.
    """
    global _swept_by
    if _swept_by != os.getpid():
        _swept_by = os.getpid()
        _sweep_claims()
        atexit.register(_sweep_claims)
    path = f"{_CLAIM_DIR}/{_CLAIM_PREFIX}{os.getpid()}_{token.hex()}"
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:
        return None
    try:
        os.write(fd, handle)
    finally:
        os.close(fd)
    return path


def _sweep_claims() -> None:
    """Remove claim files whose segment no longer exists (nobody can load their payload)."""
    try:
        names = [n for n in os.listdir(_CLAIM_DIR) if n.startswith(_CLAIM_PREFIX)]
    except OSError:
        return
    for name in names:
        path = f"{_CLAIM_DIR}/{name}"
        try:
            with open(path, "rb") as stream:
                segment = stream.read().decode(errors="replace").lstrip("/")
            if not segment or not os.path.exists(f"{_CLAIM_DIR}/{segment}"):
                os.unlink(path)
        except OSError:  # taken by a load meanwhile, or another user's
            continue


def take_claim(path: str) -> bool:
    """Whether this caller is the one that removed the claim file (exactly one is)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True
