"""The store server this library hosts answers an emptied key at once.

A withdrawn service's key holds an empty value, and torch's older store server (a
``TCPStore`` with ``use_libuv=False``) holds every reply of an empty value for 208 ms
(its length is sent with ``MSG_MORE`` and nothing follows), so a group's ``destroy``
takes 0.2 s per key it withdraws there. The stores hosted here are libuv's from torch 2.8 on.
"""

from __future__ import annotations

import datetime
import statistics
import time

import pytest
import torch
import torch.distributed as dist
from torch.torch_version import TorchVersion

from machinlike.distributed._store import host_store


@pytest.mark.timeout(60)
@pytest.mark.skipif(TorchVersion(torch.__version__) < "2.8", reason="torch before 2.8 serves a listening socket "
                    "with the older server only (the reason 2.6 and 2.7 are not supported)")
def test_a_release_and_a_read_of_the_emptied_key_take_no_200_ms():
    server = host_store("127.0.0.1", 1, 10.0)
    client = dist.TCPStore("127.0.0.1", server.port, None, False, datetime.timedelta(seconds=10))
    client.set("k", "me")
    took = []
    for _ in range(7):
        start = time.perf_counter()
        assert client.compare_set("k", "me", "") == b""  # released: the reply is the empty value
        assert client.compare_set("k", "probe", "probe") == b""  # read back, as an owner look-up does
        took.append(time.perf_counter() - start)
        assert client.compare_set("k", "", "me") == b"me"  # claimed again
    assert statistics.median(took) < 0.1, f"a release and a read took {took} s (the older server: 0.42 s)"
