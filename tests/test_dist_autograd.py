"""Distributed autograd (``torch.distributed.autograd``) through group calls, across real
processes of one host: the same-host lane must leave such calls to torch RPC, which
records the functions that carry the gradients back."""

from __future__ import annotations

import torch
import torch.distributed.autograd as dist_autograd

from machinlike.distributed import _transport
from machinlike.testing import world_test

_model = {}


def _mul(x, w):
    return x * w


def _forward(x):
    return _model["net"](x)


def _remote_grads(context_id):
    grads = dist_autograd.get_gradients(context_id)
    return [grads[p].tolist() if p in grads else None for p in _model["net"].parameters()]


@world_test(2, timeout=90)
def test_gradients_cross_back_to_arguments_and_to_a_remote_model(world):
    g = world.create_rpc_group("autograd", ["0", "1"])
    if world.name == "1":
        torch.manual_seed(0)
        _model["net"] = torch.nn.Linear(2, 1)
        with torch.no_grad():
            _model["net"].weight.fill_(3.0)
        g.register("mul", _mul)
        g.register("forward", _forward)
    g.barrier()
    if world.name == "0":
        lane = _transport.lane.current()
        carried = lane.stats()["calls"]
        calls = {
            "registered_sync": lambda x, w: g.registered_sync("mul", args=(x, w)),
            "rpc_sync": lambda x, w: g.rpc_sync("1", _mul, args=(x, w)),
            "registered_async": lambda x, w: g.registered_async("mul", args=(x, w)).wait(),
            "rpc_async of a lambda": lambda x, w: g.rpc_async("1", lambda a, b: a * b, args=(x, w)).wait(),
        }
        for name, call in calls.items():
            x = torch.ones(3, requires_grad=True)
            w = torch.full((3,), 2.0, requires_grad=True)
            with dist_autograd.context() as context_id:
                dist_autograd.backward(context_id, [call(x, w).sum()])
                grads = dist_autograd.get_gradients(context_id)
                assert grads[x].tolist() == [2.0] * 3 and grads[w].tolist() == [1.0] * 3, name
        # The parameter-server pattern: the input needs no gradient, the remote model's
        # parameters do; their gradients stay with their owner, under the context's id.
        with dist_autograd.context() as context_id:
            out = g.registered_sync("forward", args=(torch.ones(4, 2),))
            dist_autograd.backward(context_id, [out.sum()])
            weight, bias = g.rpc_sync("1", _remote_grads, args=(context_id,))
        assert weight == [[4.0, 4.0]] and bias == [4.0]
        assert lane.stats()["calls"] == carried  # all of them through torch RPC
        # Outside a context the lane carries calls as before.
        assert g.registered_sync("mul", args=(torch.ones(1), torch.ones(1))).item() == 1.0
        assert lane.stats()["calls"] == carried + 1
    g.barrier()
    g.destroy()
