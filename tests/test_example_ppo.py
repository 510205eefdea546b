"""examples/_ppo.py, the APPO loss of the Atari example: known answers on hand-made batches
(GAE, the clipped surrogate and its gradient, the value clip) and a bandit it learns."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import pytest
import torch
from torch import nn

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")


@pytest.fixture(scope="module")
def ppo():
    sys.path.insert(0, EXAMPLES)
    try:
        yield importlib.import_module("_ppo")
    finally:
        sys.path.remove(EXAMPLES)


def test_gae_known_answer(ppo):
    # One game, 3 steps; the episode ends at the last step (discount 0 there), so the
    # bootstrap 4.0 must not leak in. deltas: 1 + .5*2 - 1 = 1, 0 + .5*3 - 2 = -.5, 2 - 3 = -1.
    values = torch.tensor([[1.0], [2.0], [3.0]])
    bootstrap = torch.tensor([4.0])
    rewards = torch.tensor([[1.0], [0.0], [2.0]])
    discounts = torch.tensor([[0.5], [0.5], [0.0]])
    adv, returns = ppo.gae(values, bootstrap, rewards, discounts, lam=0.5)
    # A2 = -1; A1 = -.5 + .5*.5*(-1) = -.75; A0 = 1 + .5*.5*(-.75) = .8125
    torch.testing.assert_close(adv, torch.tensor([[0.8125], [-0.75], [-1.0]]))
    torch.testing.assert_close(returns, torch.tensor([[1.8125], [1.25], [2.0]]))
    # lambda 1: the discounted returns (1.5, 1, 2) minus V.
    adv, _ = ppo.gae(values, bootstrap, rewards, discounts, lam=1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.5], [-1.0], [-1.0]]))
    # lambda 0: the one-step TD errors; a discount > 0 at the end bootstraps from V(x_T).
    adv, _ = ppo.gae(values, bootstrap, rewards, torch.full((3, 1), 0.5), lam=0.0)
    torch.testing.assert_close(adv, torch.tensor([[1.0], [-0.5], [1.0]]))  # the last: 2 + .5*4 - 3


def test_gae_bootstraps_past_an_unfinished_episode(ppo):
    values, rewards = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 1.0]])
    adv, returns = ppo.gae(values, torch.tensor([2.0, 5.0]), rewards, torch.tensor([[0.5, 0.0]]), lam=0.95)
    # Game 0 goes on: 0 + .5*2 - 1 = 0. Game 1 ended: 1 - 0 = 1 (its bootstrap 5 unused).
    torch.testing.assert_close(adv, torch.tensor([[0.0, 1.0]]))
    torch.testing.assert_close(returns, torch.tensor([[1.0, 1.0]]))


def test_advantages_choose_the_estimator(ppo):
    values, bootstrap = torch.tensor([[1.0]]), torch.tensor([3.0])
    rewards, discounts = torch.tensor([[1.0]]), torch.tensor([[0.5]])
    # On-policy (log rho 0), one step: both give r + gamma V' - V = 1.5, targets 2.5.
    for kind in ("gae", "vtrace"):
        adv, target = ppo.advantages(kind, values, bootstrap, rewards, discounts, torch.zeros(1, 1), lam=0.9)
        torch.testing.assert_close((adv, target), (torch.tensor([[1.5]]), torch.tensor([[2.5]])))
    # Off-policy: V-trace weighs by rho = min(1, pi/mu) = 0.5; GAE ignores it.
    adv, _ = ppo.advantages("vtrace", values, bootstrap, rewards, discounts, torch.log(torch.tensor([[0.5]])), 0.9)
    torch.testing.assert_close(adv, torch.tensor([[0.75]]))
    with pytest.raises(ValueError, match="'td'"):
        ppo.advantages("td", values, bootstrap, rewards, discounts, torch.zeros(1, 1), 0.9)


def test_clipped_surrogate_known_answer_and_gradient(ppo):
    ratio = torch.tensor([1.5, 0.5, 1.05, 0.6])
    adv = torch.tensor([1.0, 1.0, -2.0, -1.0])
    old_logp = torch.tensor([-1.0, -2.0, -0.5, -1.5])
    logp = (old_logp + ratio.log()).requires_grad_()
    loss, clipped = ppo.clipped_surrogate(logp, old_logp, adv, clip=0.2)
    # min(r A, clip(r) A): 1.2 (clipped), 0.5, -2.1, -0.8 (clipped): mean -0.3, negated.
    assert loss.item() == pytest.approx(0.3)
    assert clipped.item() == pytest.approx(0.75)  # 1.5, 0.5 and 0.6 lie outside [0.8, 1.2]
    loss.backward()
    # d/dlogp of -r A / 4 where the unclipped term is the min, 0 where the clipped one is.
    torch.testing.assert_close(logp.grad, torch.tensor([0.0, -0.125, 0.525, 0.0]))


def test_ppo_loss_value_clip_and_entropy(ppo):
    logits = torch.zeros(1, 4)  # uniform: entropy ln 4, log-prob -ln 4
    common = dict(actions=torch.tensor([1]), old_logp=torch.log(torch.tensor([0.25])), adv=torch.tensor([2.0]),
                  returns=torch.tensor([2.0]), old_values=torch.tensor([0.0]), clip=0.1, value_cost=0.5,
                  normalize=False)
    loss, figures = ppo.ppo_loss(logits, torch.tensor([1.0]), value_clip=None, entropy_cost=0.0, **common)
    # ratio 1: policy loss -2; value 0.5 * (1 - 2)^2 = 0.5; total -2 + 0.5 * 0.5.
    assert figures["loss_policy"].item() == pytest.approx(-2.0) and figures["loss_value"].item() == pytest.approx(0.5)
    assert loss.item() == pytest.approx(-1.75)
    assert figures["entropy"].item() == pytest.approx(torch.log(torch.tensor(4.0)).item())
    assert figures["approx_kl"].item() == pytest.approx(0.0) and figures["clip_fraction"].item() == 0.0
    # The value may move 0.5 from old 0: clipped to 0.5, error (0.5 - 2)^2 = 2.25 > 1: 0.5 * 2.25.
    _, figures = ppo.ppo_loss(logits, torch.tensor([1.0]), value_clip=0.5, entropy_cost=0.0, **common)
    assert figures["loss_value"].item() == pytest.approx(1.125)
    loss, _ = ppo.ppo_loss(logits, torch.tensor([1.0]), value_clip=None, entropy_cost=0.1, **common)
    assert loss.item() == pytest.approx(-1.75 - 0.1 * torch.log(torch.tensor(4.0)).item())


class _Bandit(nn.Module):
    """A policy over 3 arms that ignores its observation, and a value estimate."""

    def __init__(self) -> None:
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(3))
        self.value = nn.Parameter(torch.zeros(()))

    def forward(self, frames: torch.Tensor):
        rows = frames.shape[0]
        return self.logits.expand(rows, 3), self.value.expand(rows)


def _bandit_rounds(ppo, net, pay, norms=None, games=32, rounds=60):
    """``rounds`` batches of one-step episodes in which arm 2 pays ``pay`` and the others 0,
    each trained on by ``ppo_update``; yields its (steps, epochs, figures) per batch."""
    torch.manual_seed(0)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.05)
    args = argparse.Namespace(device="cpu", gamma=0.99, gae_lambda=0.95, advantages="gae", epochs=2, max_epochs=2,
                              minibatches=2, clip=0.2, value_clip=None, baseline_cost=0.5, entropy_cost=0.0,
                              max_grad_norm=0.5, lr_schedule="constant", kl_target=0.01, lr=0.05, max_lr=0.05)
    for _ in range(rounds):
        with torch.no_grad():
            log_probs = torch.log_softmax(net.logits, -1)
        actions = torch.multinomial(log_probs.exp(), games, replacement=True)
        message = {"obs": torch.zeros(2, games, 1, dtype=torch.uint8), "actions": actions.unsqueeze(0),
                   "rewards": pay * (actions == 2).float().unsqueeze(0), "done": torch.ones(1, games),
                   "logp": log_probs[actions].unsqueeze(0), "versions": torch.zeros(1)}
        yield ppo.ppo_update(net, optimizer, [message], args, norms=norms)


def test_ppo_update_learns_the_arm_that_pays(ppo):
    # One-step episodes; arm 2 pays 1, the others 0. The messages have the Atari example's
    # layout (obs [T+1, E, ...] uint8, actions, rewards, done, logp [T, E]).
    net = _Bandit()
    for steps, epochs, figures in _bandit_rounds(ppo, net, pay=1.0):
        assert (steps, epochs) == (4, 2)
    probs = torch.softmax(net.logits, -1)
    assert probs[2] > 0.95, probs
    assert net.value.item() == pytest.approx(probs[2].item(), abs=0.15)  # V -> expected pay
    assert set(figures) >= {"loss_policy", "loss_value", "entropy", "clip_fraction", "approx_kl", "grad_norm"}


def test_ppo_update_spends_spare_epochs(ppo):
    net = _Bandit()
    args = argparse.Namespace(device="cpu", gamma=0.99, gae_lambda=0.95, advantages="vtrace", epochs=1, max_epochs=3,
                              minibatches=4, clip=0.2, value_clip=0.1, baseline_cost=0.5, entropy_cost=0.01,
                              max_grad_norm=0.5, lr_schedule="constant", kl_target=1.0, lr=0.01, max_lr=0.01)
    message = {"obs": torch.zeros(3, 2, 1, dtype=torch.uint8), "actions": torch.tensor([[0, 1], [2, 2]]),
               "rewards": torch.ones(2, 2), "done": torch.zeros(2, 2), "logp": torch.full((2, 2), -1.1)}
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01)
    # Four steps in the batch, four minibatches: one step each; spare twice, then busy.
    answers = iter([True, True])
    steps, epochs, _ = ppo.ppo_update(net, optimizer, [message], args, spare=lambda: next(answers, False))
    assert (steps, epochs) == (12, 3)
    steps, epochs, _ = ppo.ppo_update(net, optimizer, [message], args, spare=lambda: False)
    assert (steps, epochs) == (4, 1)
    # Spare time, but the first epoch moved the policy past the KL target: no more.
    args.kl_target = 1e-12
    steps, epochs, figures = ppo.ppo_update(net, optimizer, [message], args, spare=lambda: True)
    assert (steps, epochs) == (4, 1) and figures["kl"] > 0


def test_adaptive_lr_follows_the_kl(ppo):
    net = _Bandit()
    optimizer = torch.optim.Adam(net.parameters(), lr=1e-3)
    args = argparse.Namespace(kl_target=0.01, lr=1e-3, max_lr=2e-3)
    ppo._adapt_lr(optimizer, 0.03, args)  # > 2 x target: / 1.5
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 1.5)
    ppo._adapt_lr(optimizer, 0.01, args)  # within [target / 2, 2 x target]: kept
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 1.5)
    for _ in range(5):
        ppo._adapt_lr(optimizer, 0.001, args)  # < target / 2: x 1.5, up to max_lr
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)
    for _ in range(30):
        ppo._adapt_lr(optimizer, 1.0, args)  # down to lr / 100, no further
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-5)


def test_running_moments_match_the_whole_stream(ppo):
    torch.manual_seed(1)
    chunks = [torch.randn(n, 3, 2) * 4 + 7 for n in (5, 1, 40, 17)]
    moments = ppo.RunningMoments((3, 2))
    for chunk in chunks:
        moments.update(chunk)
    whole = torch.cat(chunks).double()
    assert moments.count == 63
    assert torch.allclose(moments.mean, whole.mean(0))
    assert torch.allclose(moments.var, whole.var(0, unbiased=False))
    assert torch.allclose(moments.std(0.0), whole.std(0, unbiased=False))
    moments.update(torch.empty(0, 3, 2))  # nothing to fold: unchanged
    assert moments.count == 63


class _Pixels(nn.Module):
    """The buffers NatureCNN carries for its inputs, on a 2x2 frame."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("obs_mean", torch.zeros(2, 2))
        self.register_buffer("obs_scale", torch.full((2, 2), 1.0 / 255.0))


def test_normalizers_publish_each_pixels_statistics_in_the_buffers(ppo):
    net = _Pixels()
    norms = ppo.Normalizers((2, 2), values=False, every=1)
    # [T+1, N, C, H, W]: pixel (0, 0) is constant 10, pixel (1, 1) alternates 0 / 200.
    obs = torch.zeros(4, 2, 1, 2, 2, dtype=torch.uint8)
    obs[..., 0, 0] = 10
    obs[::2, :, :, 1, 1] = 200
    norms.observe_frames(obs, net)
    assert net.obs_mean[0, 0].item() == pytest.approx(10.0) and net.obs_mean[1, 1].item() == pytest.approx(100.0)
    # A constant pixel keeps scale 1 (spread floor 1 grey level); the alternating one 1/100.
    assert net.obs_scale[0, 0].item() == pytest.approx(1.0)
    assert net.obs_scale[1, 1].item() == pytest.approx(1.0 / (100.0 ** 2 + 1.0) ** 0.5)
    assert norms.values is None


def test_ppo_init_starts_near_uniform(ppo):
    torch.manual_seed(0)
    net = nn.Sequential()
    net.torso = nn.Linear(8, 16)
    net.policy = nn.Linear(16, 6)
    net.value = nn.Linear(16, 1)
    ppo.ppo_init(net)
    logits = net.policy(torch.relu(net.torso(torch.randn(64, 8))))
    assert logits.abs().max() < 0.2  # gain 0.01: every action about 1/6
    assert net.torso.bias.abs().sum() == 0
    weight = net.torso.weight
    assert torch.allclose(weight.T @ weight, 2.0 * torch.eye(8), atol=1e-4)  # orthogonal columns, gain sqrt(2)


def test_ppo_update_learns_with_normalised_values(ppo):
    # The bandit again, paying 5 (clipped to 1 by the learner): with value normalisation the
    # head learns the pay in the returns' units, the policy the paying arm.
    net = _Bandit()
    norms = ppo.Normalizers(None, values=True)
    games = 32
    for _ in _bandit_rounds(ppo, net, pay=5.0, norms=norms, games=games):
        pass
    probs = torch.softmax(net.logits, -1)
    assert probs[2] > 0.95, probs
    assert norms.values.count == 60 * games
    raw = net.value.item() * norms.values.std().item() + norms.values.mean.item()
    assert raw == pytest.approx(probs[2].item(), abs=0.15)


def test_normalizers_say_what_they_normalise(ppo):
    assert ppo.Normalizers((2, 2), values=True).describe() == "inputs+values"
    assert ppo.Normalizers(None, values=True).describe() == "values"
    assert ppo.Normalizers(None, values=False).describe() == "nothing"
