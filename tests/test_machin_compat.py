"""machin 0.4.2's own distributed algorithms (A3C, IMPALA, DQNApex, ARS), installed from
PyPI, running on machinlike through ``machinlike.compat.machin.install()``, 3 processes.

Skipped when machin is not installed (``pip install machin==0.4.2 --no-deps`` and the few
modules ``import machin`` needs: see docs/machin.rst, "Running machin's own package").
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from fresh_import import import_report
from torch import nn

import machinlike.compat.machin as shim
from machinlike.testing import world_test

pytestmark = pytest.mark.skipif(importlib.util.find_spec("machin") is None, reason="machin is not installed")

STATE_DIM, ACTIONS = 4, 2


class Actor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(STATE_DIM, ACTIONS)

    def forward(self, state, action=None):
        dist = torch.distributions.Categorical(logits=self.fc(state))
        act = action if action is not None else dist.sample()
        return act, dist.log_prob(act.flatten()), dist.entropy()


class Critic(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(STATE_DIM, 1)

    def forward(self, state):
        return self.fc(state)


class QNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(STATE_DIM, ACTIONS)

    def forward(self, state):
        return self.fc(state)


class ArgmaxActor(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(STATE_DIM, ACTIONS, bias=False)

    def forward(self, state):
        return torch.argmax(self.fc(state), dim=1).item()


def _episode(length, with_log_prob=False):
    out = []
    for step in range(length):
        record = {"state": {"state": torch.randn(1, STATE_DIM)}, "action": {"action": torch.tensor([[step % 2]])},
                  "next_state": {"state": torch.randn(1, STATE_DIM)}, "reward": float(step),
                  "terminal": step == length - 1}
        if with_log_prob:
            record["action_log_prob"] = -0.7
        out.append(record)
    return out


def _a3c(world):
    from machin.frame.algorithms import A3C
    from machin.frame.helpers.servers import grad_server_helper

    import gc

    from machinlike.server import PushPullGradServerImpl

    # machin's own helper: impls on every member, manage_model/start on the primary only
    servers = grad_server_helper([Actor, Critic], "a3c_grad", learning_rate=1e-3)
    a3c = A3C(Actor(), Critic(), nn.MSELoss(reduction="sum"), servers, batch_size=8,
              actor_update_times=1, critic_update_times=1)
    updates = 3
    for _ in range(updates):
        a3c.store_episode(_episode(8))
        a3c.update()  # A2C's update, then push() both models, machin's way
    group = servers[0].group
    group.barrier()
    if world.name == "0":
        for server in servers:
            server.flush(timeout=30)
        # machin's helper keeps no reference to the primary's server objects: find them
        impls = {o.server_name: o for o in gc.get_objects() if isinstance(o, PushPullGradServerImpl)
                 and o.group is group and o.primary is not None}
        applied = [impls[f"grad_server_{i}"].stats()["primary"]["applied"] for i in range(2)]
        # every member's gradients reached the primary: 3 members x 3 updates, per model
        assert applied == [3 * updates, 3 * updates], applied
    group.barrier()
    # everybody pulls the same newest parameters
    a3c.manual_sync()
    return [p.detach().clone() for p in a3c.actor.parameters()]


def _impala(world):
    from machin.frame.algorithms import IMPALA
    from machin.frame.helpers.servers import model_server_helper

    servers = model_server_helper(model_num=1, group_name="impala_models")
    group = world.create_rpc_group("impala", ["0", "1", "2"])
    impala = IMPALA(Actor(), Critic(), torch.optim.Adam, nn.MSELoss(reduction="sum"), group, servers, batch_size=2)
    if world.name in ("0", "1"):  # samplers: their episodes travel to the learner's buffer
        impala.store_episode(_episode(3 if world.name == "0" else 2, with_log_prob=True))
    group.barrier()
    if world.name == "2":  # the learner
        before = servers[0].pull(impala.actor) or True
        impala.update(update_value=True, update_policy=True)
        assert before and impala.actor.pp_version >= 1, "the learner published its update"
    group.barrier()
    return True


def _dqn_apex(world):
    from machin.frame.algorithms import DQNApex
    from machin.frame.helpers.servers import model_server_helper

    servers = model_server_helper(model_num=1, group_name="apex_models")
    group = world.create_rpc_group("apex", ["0", "1", "2"])
    apex = DQNApex(QNet(), QNet(), torch.optim.Adam, nn.MSELoss(reduction="sum"), group, servers, batch_size=4)
    if world.name in ("0", "1"):
        episode = _episode(4)
        for record in episode:
            record["action"] = {"action": torch.tensor([[1]])}
        apex.store_episode(episode)
    group.barrier()
    if world.name == "2":
        apex.update()
        assert apex.qnet.pp_version >= 1, "the learner published its update"
    group.barrier()
    return True


def _ars(world):
    from machin.frame.algorithms import ARS
    from machin.frame.helpers.servers import model_server_helper

    servers = model_server_helper(model_num=1, group_name="ars_models")
    group = world.create_rpc_group("ars", ["0", "1", "2"])
    ars = ARS(ArgmaxActor(), torch.optim.SGD, group, servers, noise_std_dev=0.1, learning_rate=0.1,
              noise_size=10000, rollout_num=6, used_rollout_num=6, normalize_state=True)
    for _ in range(2):
        for actor_type in ars.get_actor_types():
            ars.act({"state": torch.zeros(1, STATE_DIM)}, actor_type)
            ars.store_reward(1.0 if actor_type.startswith("neg") else 0.0, actor_type)
        ars.update()
    return [p.detach().clone() for p in ars.actor.parameters()]


@world_test(3, timeout=120)
def test_machin_algorithms_run_on_machinlike(world):
    shim.install()  # before anything imports machin
    # machin 0.4.2 itself (its prioritized buffer) uses np.float, which numpy 1.24 removed;
    # nothing to do with machinlike, but DQNApex cannot run on numpy 2 without it.
    import numpy as np

    if "float" not in np.__dict__:
        np.float = float
    import machin.parallel.distributed as machin_distributed

    assert machin_distributed.get_world() is world  # machin's code sees machinlike's World
    actors = _a3c(world)
    world_actors = world.create_rpc_group("check", ["0", "1", "2"])
    world_actors.pair(f"a3c/{world.name}", actors)
    _impala(world)
    _dqn_apex(world)
    ars = _ars(world)
    world_actors.pair(f"ars/{world.name}", ars)
    world_actors.barrier()
    for member in ("0", "1", "2"):
        theirs = world_actors.get_paired(f"a3c/{member}").to_here()
        assert all(torch.equal(a, b) for a, b in zip(actors, theirs)), "A3C members pulled different parameters"
        theirs = world_actors.get_paired(f"ars/{member}").to_here()
        assert all(torch.equal(a, b) for a, b in zip(ars, theirs)), "ARS members disagree on the parameters"
    world_actors.barrier()


def test_install_redirects_without_import_side_effects():
    # In a fresh interpreter: importing machinlike and the shim imports no machin; install()
    # (twice) maps machin.parallel and its modules onto machinlike's, keeping their specs;
    # an unmapped machin module fails by name; uninstall() leaves no machin.parallel module.
    report = import_report()["machin_shim"]  # the shared fresh-interpreter probe runs these steps
    assert report == "clean", report
