"""Which version a model holds: a pull undoes local writes (as machin's always-loading pull
did), and a gradient server's version does not spoil a model server's chain (cold trial 23:
a learner that pulled from a gradient server had its next model-server push rejected and
its trained weights replaced by stale ones, in silence)."""

from __future__ import annotations

import torch
from torch import nn

from machinlike.server import grad_server_helper, model_server_helper
from machinlike.server._model_version import get_version, held_version, set_version
from machinlike.testing import world_test


def _linear() -> nn.Module:
    model = nn.Linear(2, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(1.0)
    return model


def test_a_mark_tells_in_place_writes_other_chains_and_hand_set_versions():
    model = _linear()
    tensors = list(model.parameters())
    set_version(model, 3, "pp_version", "a/model", tensors)
    assert model.pp_version == 3 and "pp_version" not in model.state_dict()
    assert held_version(model, "pp_version", "a/model", tensors) == 3
    assert held_version(model, "pp_version", "b/model", tensors) is None  # another server's number
    with torch.no_grad():
        model.weight.mul_(2.0)  # (an optimizer step writes in place alike)
    assert held_version(model, "pp_version", "a/model", tensors) is None
    set_version(model, 4, "pp_version", "a/model", tensors)
    model.weight.data.fill_(5.0)  # torch does not count writes through .data (documented)
    assert held_version(model, "pp_version", "a/model", tensors) == 4
    model.pp_version = -1  # set by hand (a benchmark's "always behind"): taken as it is
    assert held_version(model, "pp_version", "a/model", tensors) == -1
    set_version(model, None, "pp_version", "a/model", tensors)
    assert get_version(model) is None and held_version(model, "pp_version", "a/model", tensors) is None
    with torch.inference_mode():
        frozen = _linear()
    set_version(frozen, 1, "pp_version", "a/model", list(frozen.parameters()))  # counts no writes: by number
    assert held_version(frozen, "pp_version", "a/model", list(frozen.parameters())) == 1


@world_test(2, timeout=90)
def test_a_learner_pulls_from_a_gradient_server_and_publishes_to_a_model_server(world):
    group = world.create_rpc_group("both", ["0", "1"])
    grads = grad_server_helper([_linear], group, optimizer=torch.optim.SGD, learning_rate=1.0,
                               reduce_method="sum", reduce_batch_size=1)
    models = model_server_helper(1, group)
    (gs,), (ms,) = grads, models
    if world.name == "1":
        learner = _linear()
        assert ms.push(learner) and learner.pp_version == 1  # published before training
        for step in range(3):
            learner.weight.grad = torch.ones_like(learner.weight)
            assert gs.push(learner, pull=False)
            assert gs.flush() == step + 1 and gs.pull(learner)
            assert learner.pp_grad_version == step + 1 and learner.pp_version == step + 1
            assert ms.push(learner), "the model server's push was rejected after a gradient-server pull"
        assert learner.weight.tolist() == [[-2.0, -2.0]] and learner.pp_version == 4
    group.barrier()
    actor = _linear()
    assert ms.pull(actor) and actor.weight.tolist() == [[-2.0, -2.0]]
    group.barrier()
    models.close()
    grads.close()


@world_test(2, timeout=90)
def test_a_pull_undoes_writes_made_in_place_since_the_models_version(world):
    group = world.create_rpc_group("undo", ["0", "1"])
    models = model_server_helper(1, group)
    grads = grad_server_helper([_linear], group, optimizer=torch.optim.SGD, learning_rate=1.0)
    (ms,), (gs,) = models, grads
    if world.name == "0":
        assert ms.push(_linear())
    group.barrier()
    model = _linear()
    assert ms.pull(model) and not ms.pull(model)  # up to date: nothing loaded
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()  # a local step (a diverged one, say) after the pull
    assert model.weight.tolist() == [[0.5, 0.5]]
    assert ms.pull(model) and model.weight.tolist() == [[1.0, 1.0]]  # the server's again
    assert not ms.pull(model)
    client = _linear()
    assert gs.pull(client) and not gs.pull(client)
    with torch.no_grad():
        client.weight.fill_(7.0)
    assert gs.pull(client) and client.weight.tolist() == [[1.0, 1.0]]
    assert not hasattr(client, "pp_version")  # the gradient server keeps its own attribute
    group.barrier()
    models.close()
    grads.close()
