"""Elastic workers' names and torch's 16-bit worker ids.

An elastic member's RPC worker is named ``<member>_<seq>`` by a sequence number that never
comes round (its endpoint counts them), and answers as torch id ``seq`` mod the id space;
the membership layer says why an id can be given again safely. A static world's worker is
named as its member and has no sequence number.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch.distributed as dist

__all__ = ["ID_SPACE_ENV", "DEFAULT_ID_SPACE", "id_space", "worker_seq", "worker_id", "id_held"]




# torch's worker ids are 16-bit (int16).
ID_SPACE_ENV = "MACHINLIKE_WORKER_ID_SPACE"


DEFAULT_ID_SPACE = 32000


def id_space() -> int:
    """How many torch worker ids an elastic world cycles through (``MACHINLIKE_WORKER_ID_SPACE``,
    default 32,000; smaller values are for tests that make ids come round quickly).

    Raises:
        ValueError: the variable is not a whole number in [16, 32767].
    """
    text = os.environ.get(ID_SPACE_ENV, str(DEFAULT_ID_SPACE))
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 16 <= value <= 32767:
        raise ValueError(f"{ID_SPACE_ENV}={text!r} must be a whole number from 16 to 32767 (torch's worker ids "
                         f"are 16-bit); unset it for the default {DEFAULT_ID_SPACE}")
    return value


# Cached: every member reads every other member's join, and each join's worker is parsed
# (N² parses while a world of N fills in one process of simulated members; a hit costs
# a quarter of a parse). Bounded; a pure function of the name.
@functools.lru_cache(maxsize=4096)
def worker_seq(worker: str) -> Optional[int]:
    """The sequence number of elastic worker ``worker`` (``<member>_<seq>``); None for a
    static world's worker (its name is its member's)."""
    base, _, seq = worker.rpartition("_")
    return int(seq) if base and seq.isdigit() else None


def worker_id(worker: str) -> Optional[int]:
    """The torch id of elastic worker ``worker``; None for a static world's worker."""
    seq = worker_seq(worker)
    return None if seq is None else seq % id_space()


def id_held(store: dist.Store, tid: int) -> bool:
    """Whether torch id ``tid`` is claimed in the dynamic group kept in ``store`` (by a
    live worker, or a gone one whose keys are not deleted yet)."""
    return bool(store.check([f"names/{tid}"]))
