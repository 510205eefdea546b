"""The receiver's cache of peers' shared memory (``_shm._receive``): what a new mapping
costs as the cache grows, and that an entry whose owner freed its memory is let go."""

from __future__ import annotations

import os

import pytest

from machinlike._shm import _receive


@pytest.fixture
def fresh_cache():
    _receive.forget_all()
    fds = []
    yield fds
    _receive.forget_all()
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _attach_new(fds, size=4096):
    fd = os.memfd_create(f"receive-test-{len(fds)}")
    os.ftruncate(fd, size)
    fds.append(fd)
    return _receive.attach(os.getpid(), fd, os.fstat(fd).st_ino, size, False)


def test_a_new_mapping_costs_the_same_however_many_are_cached(fresh_cache, monkeypatch):
    """Each new mapping asked /proc about every cached one: a worker handed 3,000 shared
    tensors took 71 s, 1,200 of them 3.7 s a batch of 100 (cold trial 19)."""
    looks = []
    real = _receive._released
    monkeypatch.setattr(_receive, "_released", lambda mapping: looks.append(1) or real(mapping))
    for _ in range(400):
        _attach_new(fresh_cache)
    assert len(_receive._maps) == 400
    assert len(looks) <= 2 * 400, len(looks)  # (a look at every entry each time: 80,200)


def test_an_entry_whose_owner_freed_its_memory_is_let_go_within_as_many_mappings_as_are_cached(fresh_cache):
    first = _attach_new(fresh_cache)
    for _ in range(31):
        _attach_new(fresh_cache)
    os.close(fresh_cache[0])  # the owner freed it: its descriptor is gone
    key = (os.getpid(), first.origin[2])
    for _ in range(len(_receive._maps)):
        _attach_new(fresh_cache)
    assert key not in _receive._maps and len(_receive._maps) == 63
