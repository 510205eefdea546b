"""The servers' public names import from their documented paths (machin's layout)."""

from __future__ import annotations

import importlib

import pytest
import torch

import machinlike.server as server

DOCUMENTED = {
    "machinlike.server.ordered": ["OrderedServerBase", "OrderedServerSimple", "OrderedServerSimpleImpl"],
    "machinlike.server.model": ["PushPullModelServer", "PushPullModelServerImpl"],
    "machinlike.server.grad": ["PushPullGradServer", "PushPullGradServerImpl", "ServerStoppedError",
                               "MissingGradientError", "CheckpointError"],
    "machinlike.server.inference": ["InferenceServer", "InferenceServerImpl"],
    "machinlike.server.helpers": ["ServerHandles", "grad_server_helper", "model_server_helper"],
}


@pytest.mark.parametrize("module_name", sorted(DOCUMENTED))
def test_module_all_and_package_reexports(module_name):
    module = importlib.import_module(module_name)
    assert sorted(module.__all__) == sorted(DOCUMENTED[module_name])
    for name in module.__all__:
        assert getattr(server, name) is getattr(module, name)  # the package re-exports the same object


def test_package_all_is_the_union():
    assert sorted(server.__all__) == sorted(n for names in DOCUMENTED.values() for n in names)


def test_accessors_refuse_bad_arguments_without_a_world():
    with pytest.raises(TypeError, match="group must be an RpcGroup"):
        server.OrderedServerSimple("s", group="g")
    with pytest.raises(TypeError, match="server_name must be a str"):
        server.OrderedServerSimpleImpl(3, group=None)
    with pytest.raises(TypeError, match="o_server must be an OrderedServerBase accessor, not NoneType"):
        server.PushPullModelServer("model")
    with pytest.raises(TypeError, match="model_creators must be a non-empty list of callables"):
        server.grad_server_helper([])
    with pytest.raises(TypeError, match=r"callables that build a model each, not function \(one server per "
                                        r"creator: pass \[model_creator\]\)"):
        server.grad_server_helper(lambda: None)  # one creator, not in a list
    made = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match=r"optimizer must be an optimizer class \(such as torch.optim.Adam\), not "
                                        r"Adam: .* pass its other arguments as optimizer_kwargs"):
        server.grad_server_helper([lambda: made], optimizer=torch.optim.Adam(made.parameters()))  # (trial 8)
    with pytest.raises(TypeError, match="lr_scheduler must be a scheduler class"):
        server.grad_server_helper([lambda: made], lr_scheduler="step")
    # Checked on every member before any group (torch's check ran on the primary alone).
    with pytest.raises(ValueError, match=r"learning_rate=-1.0 must be a finite number >= 0"):
        server.grad_server_helper([lambda: made], learning_rate=-1.0)
    with pytest.raises(ValueError, match=r"learning_rate\[1\]=nan must be a finite number >= 0"):
        server.grad_server_helper([lambda: made, lambda: made], learning_rate=[0.1, float("nan")])
