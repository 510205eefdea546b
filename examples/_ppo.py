"""The APPO pieces of ``impala_atari.py --algo appo``: advantage estimation (GAE, or V-trace
through ``_impala_core.vtrace``), the clipped surrogate, and the loss over one minibatch.

Not part of the library: the example imports it from its own folder.

    batch [T+1, N] frames ── one forward, no grad ──► values, learner log-probs
        └── advantages(...) ──► advantages A, value targets R           [T, N]
    per epoch, per shuffled minibatch of the T x N steps:
        forward ──► ppo_loss(logits, values, actions, behaviour log-probs, A, R, old values)
                      = clipped_surrogate + value_cost * value loss - entropy_cost * entropy

The ratio is pi_theta / mu, mu the policy that acted (Schulman et al., 2017, on an
asynchronous batch as in Sample Factory's APPO): a batch several versions old starts with
ratios away from 1, and the clip keeps the step within ``clip`` of the acting policy.
"""

from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from _impala_core import vtrace

__all__ = ["gae", "advantages", "clipped_surrogate", "ppo_loss", "ppo_update", "RunningMoments", "Normalizers",
           "ppo_init"]


class RunningMoments:
    """Running mean and variance of a stream of batches (Chan et al.'s parallel update),
    elementwise over ``shape``, in float64 so that millions of samples do not drift.

    Args:
        shape: The shape of one sample's statistics; batches are reduced over their
            leading dimensions down to it. ``()``: one scalar mean and variance.
    """

    def __init__(self, shape: Tuple[int, ...] = ()) -> None:
        self.mean = torch.zeros(shape, dtype=torch.float64)
        self.var = torch.ones(shape, dtype=torch.float64)
        self.count = 0

    def update(self, samples: torch.Tensor) -> None:
        """Fold in ``samples``, [..., *shape] (any device, any float or integer dtype).

        The batch's moments are taken where the samples are (on a GPU, a batch of frames
        would otherwise cross to the CPU each time), in float32: a batch's own mean and
        spread need no more; only the running fold is float64."""
        flat = samples.reshape(-1, *self.mean.shape)
        n = flat.shape[0]
        if n == 0:
            return
        var, mean = (m.to("cpu", torch.float64) for m in torch.var_mean(flat.float(), 0, unbiased=False))
        total = self.count + n
        delta = mean - self.mean
        self.mean = self.mean + delta * (n / total)
        self.var = (self.var * self.count + var * n + delta.pow(2) * (self.count * n / total)) / total
        self.count = total

    def std(self, eps: float = 1e-5) -> torch.Tensor:
        return (self.var + eps).sqrt()


class Normalizers:
    """The learner's running statistics for APPO (rl_games' ``normalize_input`` and
    ``normalize_value``), owned by the learner and published through the network's buffers.

    Inputs: each pixel's mean and spread over the frames trained on, written into the
    network's ``obs_mean`` and ``obs_scale`` buffers (so the actors' copies, which pull the
    state dict, see the same inputs). Pong's background is constant, so normalised frames
    are near 0 there and the ball and paddles stand out at several units.

    Values: the value head predicts returns in units of the returns' running spread; the
    advantages are computed on the values scaled back, and the targets in the head's units,
    so the value loss keeps a unit scale while returns grow from -1 to +1 per point.

    Args:
        frame_shape: (H, W) of one frame; None: inputs are not normalised.
        values: whether values are normalised.
        every: frames are sampled from every ``every``-th step of a batch (they repeat
            across the 4-frame stack and neighbouring steps; all of them would cost ~5% of
            the learner's time on two cores for no better estimate).
    """

    def __init__(self, frame_shape: Optional[Tuple[int, int]], values: bool, every: int = 4) -> None:
        self.inputs = RunningMoments(frame_shape) if frame_shape is not None else None
        self.values = RunningMoments() if values else None
        self.every = every

    def describe(self) -> str:
        """'inputs+values', 'inputs', 'values' or 'nothing': what is normalised."""
        names = [name for name, on in (("inputs", self.inputs), ("values", self.values)) if on is not None]
        return "+".join(names) or "nothing"

    def observe_frames(self, obs: torch.Tensor, net: nn.Module) -> None:
        """Fold ``obs`` [T+1, N, C, H, W] uint8 into the pixel statistics and write them
        into ``net``'s ``obs_mean`` / ``obs_scale`` buffers (in place, on its device)."""
        if self.inputs is None:
            return
        self.inputs.update(obs[:: self.every])
        mean_buf, scale_buf = net.get_buffer("obs_mean"), net.get_buffer("obs_scale")
        mean_buf.copy_(self.inputs.mean.to(mean_buf.dtype).reshape(mean_buf.shape))
        scale_buf.copy_(self.inputs.std(1.0).reciprocal().to(scale_buf.dtype).reshape(scale_buf.shape))


def ppo_init(net: nn.Module) -> nn.Module:
    """The PPO baselines' initialisation: orthogonal weights with gain sqrt(2) and zero
    biases in the torso, gain 0.01 for the policy head (a near-uniform first policy: every
    action tried) and 1 for the value head. PyTorch's default (Kaiming-uniform with a = sqrt(5))
    starts the policy less even and shrinks the torso's activations layer by layer."""
    for module in net.modules():
        if isinstance(module, (nn.Conv2d, nn.Linear)):
            nn.init.orthogonal_(module.weight, 2 ** 0.5)
            nn.init.zeros_(module.bias)
    for name, gain in (("policy", 0.01), ("value", 1.0)):
        head = getattr(net, name, None)
        if isinstance(head, nn.Linear):
            nn.init.orthogonal_(head.weight, gain)
    return net


def gae(values: torch.Tensor, bootstrap: torch.Tensor, rewards: torch.Tensor, discounts: torch.Tensor,
        lam: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al., 2016), backwards over time.

    Args:
        values: V(x_t), [T, N].
        bootstrap: V(x_T), the value of the observation after the last step, [N].
        rewards: r_t, [T, N].
        discounts: gamma_t, [T, N]: gamma, or 0 where the episode ended at step t (so
            nothing flows back from the next episode's first observation).
        lam: lambda in [0, 1]: 0 gives one-step TD errors, 1 the discounted returns minus V.

    Returns:
        (advantages, returns), each [T, N]: A_t = sum_k (prod_{i<k} gamma_{t+i} lam) delta_{t+k}
        with delta_t = r_t + gamma_t V(x_{t+1}) - V(x_t); returns = A + V (the value targets).
    """
    next_values = torch.cat([values[1:], bootstrap.unsqueeze(0)], dim=0)
    deltas = rewards + discounts * next_values - values
    out = torch.empty_like(deltas)
    acc = torch.zeros_like(bootstrap)
    for t in reversed(range(values.shape[0])):
        acc = deltas[t] + discounts[t] * lam * acc
        out[t] = acc
    return out, out + values


def advantages(kind: str, values: torch.Tensor, bootstrap: torch.Tensor, rewards: torch.Tensor,
               discounts: torch.Tensor, log_rhos: torch.Tensor, lam: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """(advantages, value targets), [T, N] each, by ``kind``.

    Args:
        kind: ``"gae"`` (on-policy estimate; the clip handles the lag) or ``"vtrace"``
            (Espeholt et al.'s off-policy correction with rho-bar = c-bar = 1; its
            advantages are rho_t (r_t + gamma_t v_{t+1} - V(x_t))).
        log_rhos: log(pi / mu) of the actions taken, [T, N] (only ``vtrace`` reads it).
        lam: GAE's lambda (only ``gae`` reads it).

    Raises:
        ValueError: ``kind`` is neither.
    """
    if kind == "gae":
        return gae(values, bootstrap, rewards, discounts, lam)
    if kind == "vtrace":
        vs, adv = vtrace(values, bootstrap, rewards, discounts, log_rhos)
        return adv, vs
    raise ValueError(f"advantages {kind!r}: use 'gae' or 'vtrace'")


def clipped_surrogate(logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
                      clip: float) -> Tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped policy loss: mean over steps of -min(r A, clip(r, 1 - eps, 1 + eps) A).

    Args:
        logp: log pi_theta(a_t | x_t) (with grad), any shape.
        old_logp: log mu(a_t | x_t) of the policy that acted, the same shape.
        adv: advantages, the same shape (already normalised where wanted).
        clip: epsilon, > 0.

    Returns:
        (loss, clipped fraction): the scalar loss, and the share of steps whose ratio lay
        outside [1 - eps, 1 + eps] (a float tensor, no grad).
    """
    ratio = (logp - old_logp).exp()
    unclipped = ratio * adv
    clipped = ratio.clamp(1.0 - clip, 1.0 + clip) * adv
    loss = -torch.minimum(unclipped, clipped).mean()
    return loss, ((ratio - 1.0).abs() > clip).float().mean().detach()


def ppo_loss(logits: torch.Tensor, values: torch.Tensor, actions: torch.Tensor, old_logp: torch.Tensor,
             adv: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor, *, clip: float,
             value_clip: Optional[float], value_cost: float, entropy_cost: float,
             normalize: bool = True) -> Tuple[torch.Tensor, Dict[str, torch.Tensor]]:
    """The loss of one minibatch of M steps (means over its steps, not sums).

    Args:
        logits: [M, A] of the learner's current weights; values: [M].
        actions: [M] int64; old_logp: [M], the acting policy's log-probabilities.
        adv, returns: [M], from :func:`advantages`; old_values: [M], V before this batch's
            first update (the value clip's centre).
        clip: the surrogate's epsilon.
        value_clip: None: plain squared error; else the max of the squared errors of the
            value and of the value clipped to ``old_values +- value_clip`` (as PPO2).
        value_cost, entropy_cost: weights of the value loss and of the entropy bonus.
        normalize: scale ``adv`` to mean 0, std 1 within the minibatch.

    Returns:
        (loss, figures): figures are ``loss_policy``, ``loss_value``, ``entropy``,
        ``clip_fraction`` and ``approx_kl`` (mean of (r - 1) - log r, Schulman's estimator,
        against the acting policy), as detached 0-d tensors: reading them is the caller's
        choice (on a GPU each read waits for the device).
    """
    if normalize and adv.numel() > 1:
        # Pong's rewards are rare: raw advantages are ~0.01 early on, small beside the
        # entropy bonus; at unit spread the policy gradient keeps its weight.
        adv = (adv - adv.mean()) / (adv.std() + 1e-8)
    log_probs = F.log_softmax(logits, dim=-1)
    logp = log_probs.gather(1, actions.unsqueeze(1)).squeeze(1)
    policy_loss, clip_fraction = clipped_surrogate(logp, old_logp, adv, clip)
    if value_clip is None:
        value_loss = 0.5 * (values - returns).pow(2).mean()
    else:
        clipped_values = old_values + (values - old_values).clamp(-value_clip, value_clip)
        value_loss = 0.5 * torch.maximum((values - returns).pow(2), (clipped_values - returns).pow(2)).mean()
    entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
    loss = policy_loss + value_cost * value_loss - entropy_cost * entropy
    with torch.no_grad():
        log_ratio = logp - old_logp
        approx_kl = ((log_ratio.exp() - 1.0) - log_ratio).mean()
    return loss, {"loss_policy": policy_loss.detach(), "loss_value": value_loss.detach(), "entropy": entropy.detach(),
                  "clip_fraction": clip_fraction, "approx_kl": approx_kl}


def ppo_update(net: nn.Module, optimizer: torch.optim.Optimizer, batch: List[Dict[str, torch.Tensor]],
               args: argparse.Namespace, spare: Callable[[], bool] = lambda: False,
               norms: Optional[Normalizers] = None) -> Tuple[int, int, Dict[str, float]]:
    """Train ``net`` on one batch of actor messages: advantages once, then ``args.epochs``
    passes over shuffled minibatches (and up to ``args.max_epochs`` while ``spare()``).

    Args:
        batch: Messages of ``obs`` [T+1, E, C, H, W] uint8, ``actions``, ``rewards``,
            ``done``, ``logp`` [T, E] (``versions`` is not read), on the CPU.
        args: ``device``, ``gamma``, ``gae_lambda``, ``advantages`` (gae or vtrace),
            ``epochs``, ``max_epochs``, ``minibatches``, ``clip``, ``value_clip`` (None:
            off), ``baseline_cost``, ``entropy_cost``, ``max_grad_norm``, ``lr_schedule``
            (constant or adaptive), ``kl_target``, ``lr`` and ``max_lr`` (adaptive's bounds).
        spare: Asked after each epoch past ``args.epochs`` (while the last epoch's KL stayed
            under ``kl_target``): True while the learner would otherwise wait for the next
            batch (its device has capacity to spare), so one more epoch costs the actors
            nothing.
        norms: The learner's running statistics (see :class:`Normalizers`); None: raw
            inputs (scaled to [0, 1] by the network) and raw values.

    Returns:
        (optimizer steps, epochs, figures): the figures are the means over the steps of
        :func:`ppo_loss`'s, ``grad_norm`` (before clipping), ``kl`` (the last epoch's
        KL from the batch's policy before its first step) and ``lr`` (after this batch).
    """
    device = args.device

    def joined(key: str) -> torch.Tensor:
        return torch.cat([t[key] for t in batch], dim=1).to(device, non_blocking=True)

    obs = joined("obs")  # [T+1, N, C, H, W]; uint8 until the network's first layer
    actions, behaviour_logp = joined("actions"), joined("logp")
    rewards = joined("rewards").clamp(-1.0, 1.0)
    discounts = args.gamma * (1.0 - joined("done"))
    length, width = actions.shape
    frames = obs.reshape(-1, *obs.shape[2:])
    value_norm = norms.values if norms is not None else None
    if norms is not None:
        norms.observe_frames(obs, net)  # before the forward: the batch's own frames count
    with torch.no_grad():
        # In chunks: a GPU batch of several thousand frames would hold every layer's
        # activations at once for no gain in speed.
        outs = [net(chunk) for chunk in frames.split(2048)]
        logits = torch.cat([o[0] for o in outs]).reshape(length + 1, width, -1)[:-1]
        values = torch.cat([o[1] for o in outs]).reshape(length + 1, width)
        if value_norm is not None:  # the head's units -> returns' units
            values = values * value_norm.std().to(values) + value_norm.mean.to(values)
        before = F.log_softmax(logits, dim=-1)  # this batch's policy before its first step
        logp = before.gather(2, actions.unsqueeze(2)).squeeze(2)
        adv, returns = advantages(args.advantages, values[:-1], values[-1], rewards, discounts,
                                  logp - behaviour_logp, args.gae_lambda)
        old_values = values[:-1]
        if value_norm is not None:  # targets (and the clip's centre) in the head's units
            value_norm.update(returns)
            mean, std = value_norm.mean.to(values), value_norm.std().to(values)
            returns, old_values = (returns - mean) / std, (old_values - mean) / std
    size = length * width
    flat_obs = frames[:-width]  # the T x N acting observations, step-major as the others' reshape
    flat = {"actions": actions.reshape(-1), "old_logp": behaviour_logp.reshape(-1), "adv": adv.reshape(-1),
            "returns": returns.reshape(-1), "old_values": old_values.reshape(-1)}
    before = before.reshape(size, -1)
    sums: Dict[str, torch.Tensor] = {}
    steps = epochs = 0
    kl = 0.0  # KL(before || now) of the last epoch, mean over its minibatches
    while epochs < args.epochs or (epochs < args.max_epochs and kl < args.kl_target and spare()):
        epoch_kl = torch.zeros((), device=device)
        parts = torch.randperm(size, device=device).tensor_split(min(args.minibatches, size))
        for index in parts:
            logits_mb, values_mb = net(flat_obs[index])
            loss, figures = ppo_loss(logits_mb, values_mb, flat["actions"][index], flat["old_logp"][index],
                                     flat["adv"][index], flat["returns"][index], flat["old_values"][index],
                                     clip=args.clip, value_clip=args.value_clip, value_cost=args.baseline_cost,
                                     entropy_cost=args.entropy_cost)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            figures["grad_norm"] = nn.utils.clip_grad_norm_(net.parameters(), args.max_grad_norm).detach()
            optimizer.step()
            with torch.no_grad():
                now = F.log_softmax(logits_mb.detach(), dim=-1)
                epoch_kl += (before[index].exp() * (before[index] - now)).sum(-1).mean()
            for key, value in figures.items():
                sums[key] = sums[key] + value if key in sums else value
            steps += 1
        epochs += 1
        kl = epoch_kl.item() / len(parts)  # one read of the device per epoch
        if args.lr_schedule == "adaptive":
            _adapt_lr(optimizer, kl, args)
    # One read of the device per batch, not one per figure and step.
    means = torch.stack(list(sums.values())).div(max(steps, 1)).tolist()
    out = dict(zip(sums, means))
    out.update(kl=kl, lr=optimizer.param_groups[0]["lr"])
    return steps, epochs, out


def _adapt_lr(optimizer: torch.optim.Optimizer, kl: float, args: argparse.Namespace) -> None:
    """rl_games' adaptive schedule: the learning rate / 1.5 when an epoch moved the policy
    more than twice ``args.kl_target`` (KL from the batch's policy before its first step),
    x 1.5 when less than half, within [``args.lr`` / 100, ``args.max_lr``]. A fixed rate
    is either too timid early (Pong's first points) or too bold late."""
    lr = optimizer.param_groups[0]["lr"]
    if kl > 2.0 * args.kl_target:
        lr = max(lr / 1.5, args.lr / 100.0)
    elif kl < 0.5 * args.kl_target:
        lr = min(lr * 1.5, args.max_lr)
    for group in optimizer.param_groups:
        group["lr"] = lr
