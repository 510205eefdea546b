"""A machine whose ``/dev/shm`` is small: a container's 64 MB, unless ``--shm-size`` says more.

The first test runs a script in a mount namespace of its own with a 16 MB tmpfs over
``/dev/shm`` (root only; skipped elsewhere); the second reads a small room in place of
the real one. Copies that found no room failed before (torch's "unable to allocate shared
memory", or before torch 2.11 a SIGBUS), where the standard library's queue and pool
pickle by value; they now go by value with one warning. Shares, where sharing is the
point, fail with an error that says how to make room.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from machinlike._reductions import shm_space
from machinlike.distributed import share
from machinlike.pickle import dumps, loads
from machinlike.server._state_pool import StatePool

pytestmark = pytest.mark.timeout(120)
_SCRIPT = textwrap.dedent('''
    import threading, warnings
    import numpy as np, torch, machinlike, machinlike.distributed
    from machinlike.pickle import dumps, loads

    def rows(a):
        return int(a.shape[0]), float(a[-1])

    def main():
        print("room", __import__("shutil").disk_usage("/dev/shm").total >> 20)
        big = np.arange((32 << 20) // 8, dtype=np.float64)  # 32 MB: twice the room there is
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            q = machinlike.SimpleQueue()
            p = machinlike.Process(target=q.put, args=(big,))  # an argument, then a queue item
            p.start()
            got = q.get(timeout=60)
            p.join(30)
            print("queue", p.exitcode, p.exception, bool((got == big).all()))
            with machinlike.Pool(2) as pool:
                print("map", pool.map_async(lambda i: rows(big)[1] + i, [0, 1]).get(60))  # a closure over it
            told = [str(w.message) for w in caught if "shared memory is full" in str(w.message)]
            print("warned", len(told), "--shm-size" in told[0] if told else None)
        for name, send in (("queue tensor", lambda t: dumps(t, copy_tensor=False)), ("share", machinlike.distributed.share)):
            try:
                send(torch.ones((32 << 20) // 4))
                print(name, "sent")
            except RuntimeError as err:
                print(name, "refused", "shared memory is full" in str(err), "--shm-size" in str(err))

    if __name__ == "__main__":
        main()
''')


def test_copies_go_by_value_and_shares_say_how_to_make_room(tmp_path):
    if os.geteuid() != 0 or not shutil.which("unshare"):
        pytest.skip("mounting a small /dev/shm needs root and unshare(1)")
    script = tmp_path / "small_shm.py"
    script.write_text(_SCRIPT)
    command = f"mount -t tmpfs -o size=16m tmpfs /dev/shm && exec {sys.executable} {script}"
    try:
        done = subprocess.run(["unshare", "-m", "sh", "-c", command], capture_output=True, text=True,
                              timeout=100, cwd=tmp_path)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"the script hung: {err.stdout!r} {err.stderr!r}")
    if "mount:" in done.stderr and "permission denied" in done.stderr.lower():
        pytest.skip(f"cannot mount here: {done.stderr.strip()}")
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and lines == [
        "room 16",
        "queue 0 None True",
        f"map [{float((32 << 20) // 8 - 1)}, {float((32 << 20) // 8)}]",
        "warned 1 True",
        "queue tensor refused True True",
        "share refused True True",
    ], (done.stdout, done.stderr[-3000:])


def test_the_room_is_read_before_torch_allocates(monkeypatch):
    # torch before 2.11 reserved no pages for a shared memory file: a copy into one larger
    # than the room left killed the process with SIGBUS. The room is read first (here, as
    # if 1 MB were free of 64), and what finds too little goes by value or is refused.
    monkeypatch.setattr(shm_space, "_space", lambda: (1 << 20, 64 << 20))
    monkeypatch.setattr(shm_space, "_warned", False)
    array = np.arange(1 << 20, dtype=np.float64)  # 8 MB
    with pytest.warns(RuntimeWarning, match="shared memory is full"):
        data = dumps(array, copy_tensor=False)
    assert len(data) > array.nbytes and (loads(data) == array).all()
    for name, send in (("queue tensor", lambda t: dumps(t, copy_tensor=False)), ("share", share)):
        tensor = torch.ones(1 << 21)  # 8 MB
        with pytest.raises(RuntimeError, match=r"shared memory is full: .* 8\.0 MB .* 1 MB free of 64 MB; .*--shm-size"):
            send(tensor)
        assert not tensor.is_shared(), name
    shm_space._warned = False  # (said once per process: said again here)
    state = {"weight": torch.ones(1 << 21)}
    with pytest.warns(RuntimeWarning, match="a pushed model's tensor of 8.0 MB"):
        kept = StatePool()("model", state)  # a model server's pushed state, left where it is
    assert kept["weight"] is state["weight"] and not kept["weight"].is_shared()
