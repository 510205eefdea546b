"""APPO or IMPALA on Atari (ALE through ale-py): actors step batches of games, a learner trains a CNN.

The learner trains a Nature-CNN with PPO's clipped surrogate (--algo appo, the default on the
CPU) or V-trace (--algo impala, the default on a GPU).

Run it locally (1 learner + 2 actors x 16 games of Pong; the launcher starts the processes):
    python examples/impala_atari.py
The learning curve (mean return against wall time and frames) as a PNG:
    python examples/impala_atari.py --time-budget 3600 --curve pong.png
Pong to +18 on two cores (APPO: PPO's clipped surrogate over epochs of each batch; here
+18 after 2.8M frames and 55 minutes, where V-trace needs ~25M frames: BENCHMARKS.md):
    python examples/impala_atari.py --time-budget 3600 --curve pong.png
IMPALA's single V-trace pass instead:
    python examples/impala_atari.py --algo impala
Another game, a fixed budget, inference on the learner for every actor's games at once:
    python examples/impala_atari.py --env breakout --time-budget 600 --inference central
The learner and the central inference server on a GPU (the actors stay on the CPU):
    python examples/impala_atari.py --device cuda --inference central
An actor SIGKILLed and restarted every 20 s (an elastic world):
    python examples/impala_atari.py --chaos 20

    actor (ranks 1..W)                                    learner (rank 0)
    ------------------                                    ----------------
    ale-py AtariVectorEnv: E games, 84x84 grey,
    frameskip 4, 4-frame stack, uint8 throughout
    policy per step, one of:
      local:   model_server.pull(cnn); cnn(obs)  ◄─ v ── pushes after every batch
      central: infer(obs) ─────────────────────────────►  InferenceServerImpl: one batched
                                                          forward for all actors' waiting rows
    registered_async("atari/trajectories/0", ...) ────►  Inbox (bounded; full: reply parked)
        T+1 x E stacked frames, actions, rewards,          take B; per --minibatches slice of
        behaviour log-probs, policy versions               their games: V-trace, an optimizer step;
                                                          lag = learner version - behaviour v
    registered_async("atari/report", ...) ────────────►  EpisodeLog (metric, CSV, stop) and
        ◄── reply: the inference mode to use next          the inference mode (--inference auto)

The metric is the mean (unclipped) return of the last 100 episodes the actors finished;
the learner trains on rewards clipped to [-1, 1]. The environment: ale-py's vector env with
the NoFrameskip-v4 conventions (frameskip 4 max-pooled over the last two frames, no sticky
actions: repeat_action_probability 0, up to 30 no-ops and FIRE at reset), 84x84 grey, a
4-frame stack; a frame is one emulator frame (an agent step is 4). The end of the run
prints when the mean first reached 0 and 18 (seconds since launch, frames). Training stops at ``--target`` or when
``--time-budget`` runs out. ``--inference auto`` runs local inference, then central, for
``--auto-seconds`` each (after a few seconds to settle), and keeps the one that trained
faster, saying so. An episode ends at the game's end or at ale-py's frame cap; either cuts
the V-trace (no bootstrap past the cap: 108k frames are far beyond a Pong game).

APPO follows rl_games' Pong recipe where it matters most: 128-step unrolls (most then hold
a point of Pong, not only the value's guess of one), each pixel normalised by its running
mean and spread, values normalised, the PPO baselines' orthogonal initialisation. Its
defaults depend on --device (see APPO_DEFAULTS): on the CPU, where the learner shares two
cores with the games, batches of one actor message (16 games x 128 steps), 2 epochs over 4
minibatches; on a GPU, batches of 6,144 steps in 8 minibatches of 768, 3 epochs and a
4th while no next batch waits.

Two cores: each process uses one torch thread (``--learner-threads`` for the learner,
whose forward+backward is most of the work); frames stay uint8 until the CNN's first layer.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import _util
import machinlike
from _atari_learner import GROUP, INFER, SERVER, learn
from _episodes import cpu_seconds, format_mean


def ale_game(name: str) -> str:
    """ale-py's ROM id for ``name``: 'pong', 'Pong', 'ALE/Pong-v5', 'PongNoFrameskip-v4',
    'SpaceInvaders' and 'space_invaders' all name a game.

    Raises:
        ValueError: no bundled ROM has that name (the message lists a few that do).
    """
    from ale_py.roms import get_all_rom_ids

    core = re.sub(r"^ALE/", "", name)
    core = re.sub(r"(NoFrameskip)?-v\d+$", "", core)
    game = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", core).lower()
    known = get_all_rom_ids()
    if game not in known:
        raise ValueError(f"--env {name!r}: ale-py has no ROM {game!r}; try one of {', '.join(sorted(known)[:12])}, ...")
    return game


class NatureCNN(nn.Module):
    """The DQN paper's network (Mnih et al., 2015) with a policy and a value head.

    ``forward`` takes uint8 frames [N, 4, 84, 84] and gives (logits [N, actions], value [N]).
    """

    def __init__(self, actions: int, frame: Tuple[int, int] = (84, 84)) -> None:
        super().__init__()
        # Each pixel's offset and scale, in the state dict so that every copy of the network
        # sees the same inputs: 0 and 1/255 (frames in [0, 1]) unless the learner normalises
        # them (APPO: each pixel's running mean and spread, see _ppo.Normalizers).
        self.register_buffer("obs_mean", torch.zeros(frame))
        self.register_buffer("obs_scale", torch.full(frame, 1.0 / 255.0))
        self.torso = nn.Sequential(
            nn.Conv2d(4, 32, 8, stride=4), nn.ReLU(), nn.Conv2d(32, 64, 4, stride=2), nn.ReLU(),
            nn.Conv2d(64, 64, 3, stride=1), nn.ReLU(), nn.Flatten(), nn.Linear(3136, 512), nn.ReLU())
        self.policy = nn.Linear(512, actions)
        self.value = nn.Linear(512, 1)

    def forward(self, frames: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        # Channels-last activations take oneDNN's faster convolutions on the CPU (the
        # learner's forward+backward: ~17% less per sample); reordering the uint8 frames
        # before the float conversion moves a quarter of the bytes.
        frames = frames.contiguous(memory_format=torch.channels_last)
        # The clamp binds only normalised inputs (rl_games' +-5): a pixel the ball seldom visits.
        hidden = self.torso(frames.float().sub_(self.obs_mean).mul_(self.obs_scale).clamp_(-5.0, 5.0))
        return self.policy(hidden), self.value(hidden).squeeze(-1)


def make_envs(game: str, count: int) -> Any:
    """``count`` games in one ale-py vector env (one C++ thread: the process is the unit of
    parallelism here); the observations of a finished game are the next game's first
    (SameStep autoreset). Rewards stay unclipped: the metric is the game's score."""
    from ale_py.vector_env import AtariVectorEnv

    return AtariVectorEnv(game, count, num_threads=1, autoreset_mode="SameStep", reward_clipping=False)


class Sampler:
    """``E`` games stepped together, one policy call per step for all of them."""

    def __init__(self, game: str, envs: int, seed: int, generator: torch.Generator) -> None:
        self.env = make_envs(game, envs)
        self.obs = self.env.reset(seed=seed)[0]  # a reset costs ~40 ms per game: only this one
        self.returns = np.zeros(envs)
        self.lengths = np.zeros(envs, np.int64)  # agent steps of each game's current episode
        self.finished_lengths: List[int] = []  # of the episodes in the last unroll's returns
        self.generator = generator

    def unroll(self, policy: Callable[[torch.Tensor], Tuple[torch.Tensor, int]],
               length: int) -> Tuple[Dict[str, torch.Tensor], List[float], List[float]]:
        """``length`` steps of every game.

        Returns:
            (trajectory, returns of the episodes finished, seconds of each policy call).
            ``done[t, e]``: game e ended at step t, so ``obs[t + 1, e]`` starts a new one.
            ``finished_lengths`` holds those episodes' lengths (agent steps).
        """
        count = self.returns.shape[0]
        obs = np.empty((length + 1, *self.obs.shape), np.uint8)
        actions = np.empty((length, count), np.int64)
        rewards = np.empty((length, count), np.float32)
        done = np.empty((length, count), np.float32)
        logp = np.empty((length, count), np.float32)
        versions = np.empty(length, np.int64)
        finished: List[float] = []
        self.finished_lengths = []
        calls: List[float] = []
        for t in range(length):
            obs[t] = self.obs
            began = time.perf_counter()
            logits, versions[t] = policy(torch.from_numpy(obs[t]))
            log_probs = F.log_softmax(logits, dim=-1)
            chosen = torch.multinomial(log_probs.exp(), 1, generator=self.generator)
            calls.append(time.perf_counter() - began)
            logp[t] = log_probs.gather(1, chosen).squeeze(1).numpy()
            actions[t] = chosen.squeeze(1).numpy()
            self.obs, reward, terminated, truncated, _ = self.env.step(actions[t])
            rewards[t] = reward
            ended = np.logical_or(terminated, truncated)
            done[t] = ended
            self.returns += reward
            self.lengths += 1
            for e in np.flatnonzero(ended):
                finished.append(float(self.returns[e]))
                self.finished_lengths.append(int(self.lengths[e]))
                self.returns[e] = 0.0
                self.lengths[e] = 0
        obs[length] = self.obs
        trajectory = {"obs": torch.from_numpy(obs), "actions": torch.from_numpy(actions),
                      "rewards": torch.from_numpy(rewards), "done": torch.from_numpy(done),
                      "logp": torch.from_numpy(logp), "versions": torch.from_numpy(versions)}
        return trajectory, finished, calls


def act(world: machinlike.World, group: machinlike.RpcGroup, args: argparse.Namespace, index: int,
        learner: str) -> Dict[str, Any]:
    """An actor: unroll with the mode's policy, ship the trajectory, report episodes and the
    policy calls' timing; until the learner's reply says stop."""
    server = group.get_paired(SERVER).to_here()
    model = NatureCNN(args.actions)
    central: Any = None  # the inference server's accessor, fetched on first use

    def local(obs: torch.Tensor) -> Tuple[torch.Tensor, int]:
        with torch.no_grad():
            return model(obs)[0], model.pp_version

    def remote(obs: torch.Tensor) -> Tuple[torch.Tensor, int]:
        (logits, _), version = central.infer(obs, timeout=args.rpc_timeout, with_version=True)
        return logits, version

    # A restarted actor (--chaos) plays new games instead of replaying its predecessor's.
    index += 100_003 * (world.incarnation - 1)
    generator = torch.Generator().manual_seed(args.seed * 7919 + index)
    sampler = Sampler(args.game, args.envs_per_worker, args.seed * 10_000 + index * args.envs_per_worker, generator)
    mode = "local" if args.inference == "auto" else args.inference
    sending: Optional[machinlike.distributed.RpcFuture] = None
    reporting: Optional[machinlike.distributed.RpcFuture] = None
    unrolls, steps = 0, 0
    while True:
        # One send and one report in flight: the learner's parked replies pace the actors,
        # and only its reply to a send stops them (see impala.py). The next unroll starts
        # once the learner took the last one in: with the weights fetched after that, a
        # trajectory is 3 versions behind the learner where it was 5 (two actors,
        # --queue-size 1; 8 with the old queue of 4), and actors faster than the learner
        # only wait where they would have waited anyway.
        if sending is not None and not sending.wait():
            break
        if reporting is not None:
            mode = reporting.wait()
        if mode == "local":
            server.pull(model)  # transfers nothing when the actor already has the newest version
        elif central is None:
            central = group.get_paired(INFER).to_here()
        trajectory, finished, calls = sampler.unroll(local if mode == "local" else remote, args.unroll)
        unrolls += 1
        steps += args.unroll * args.envs_per_worker
        sending = group.registered_async(f"{GROUP}/trajectories/{learner}", args=(trajectory,),
                                         timeout=args.rpc_timeout)
        p95 = float(np.percentile(calls, 95)) * 1e3
        reporting = group.registered_async(f"{GROUP}/report", args=(world.name, finished, steps,
                                                                    int(trajectory["versions"][-1]), p95,
                                                                    sampler.finished_lengths),
                                           timeout=args.rpc_timeout)
        steps = 0
    if reporting is not None:
        reporting.wait()
    return {"role": "actor", "name": world.name, "unrolls": unrolls, "cpu": cpu_seconds()}


# ------------------------------------------------------------------------------ roles
def worker_elastic(world: machinlike.World, args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """``--chaos``: an elastic world where actors die (SIGKILL) and come back.

    The learner ("0", essential) opens a :class:`_util.ReadyGate` once its services and
    version 1 exist; an actor, first or restarted, waits at the gate and then acts as in a
    static run. A trajectory counts once (it is in the inbox or it is not); reports carry
    the steps since the actor's last one, so a restart adds without repeating.
    """
    from machinlike.exception import PeerLostError

    start = time.monotonic()
    learner = "0"
    group = world.create_rpc_group(GROUP)  # open: a restarted actor rejoins at once
    gate = _util.ReadyGate(world, group, f"{GROUP}/ready")
    if world.name == learner:
        torch.set_num_threads(args.learner_threads)
        members = _util.member_printer(world, "learner")
        result = learn(world, group, args, NatureCNN, ready=gate.open)
        # The actors stop at their next send's reply; leaving first would fail their last calls.
        try:
            world.wait_for_members([str(r) for r in range(1, args.num_workers + 1)], timeout=30.0, gone=True)
        except TimeoutError as err:
            print(f"[learner] not every actor stopped within 30 s: {err}", flush=True)
        gate.close()
        result.pop("close")()
        result.update(train_time=time.monotonic() - start, cpu=cpu_seconds(), losses=members.losses,
                      rejoins=members.rejoins)
        return result
    torch.set_num_threads(1)
    if world.membership.gone(learner):
        return None  # restarted after the learner finished
    try:
        world.wait_for_members([learner], timeout=60.0)
        if gate.wait(learner, timeout=60.0):  # False: the learner finished before this actor got going
            act(world, group, args, world.rank - 1, learner)
    except PeerLostError as err:  # the learner finished (left) while this actor was calling it
        if err.member != learner:
            raise
    except KeyError:  # the learner withdrew its services: it is finishing
        pass
    return {"role": "actor", "name": world.name, "cpu": cpu_seconds()}


def worker(world: machinlike.World, args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    _util.reuse_large_buffers()  # batches of frames: see its docstring
    if world.elastic:
        return worker_elastic(world, args)
    start = time.monotonic()
    group = world.create_rpc_group(GROUP, world.get_members())
    if world.rank == 0:
        torch.set_num_threads(args.learner_threads)
        result = learn(world, group, args, NatureCNN)
    else:
        torch.set_num_threads(1)  # 2 cores, several processes: the learner gets the spare cycles
        group.barrier()  # the learner registered its services and published version 1
        result = act(world, group, args, world.rank - 1, "0")
    group.barrier()  # nobody calls a service any more
    if world.rank == 0:
        result["train_time"] = time.monotonic() - start
        result.pop("close")()
    group.destroy()
    result["cpu"] = cpu_seconds()
    return result


#: The learner settings that differ by algorithm (and, for APPO, by device), used where the
#: command line leaves them out. IMPALA's are the example's settings before APPO existed.
IMPALA_DEFAULTS: Dict[str, Any] = {"optimizer": "rmsprop", "lr": 6e-4, "entropy_cost": 0.0006, "max_grad_norm": 40.0,
                                   "batch_size": 1, "minibatches": 1, "epochs": 1, "max_epochs": 1,
                                   "learner_threads": 1, "unroll": 32, "value_clip": 0.0}
APPO_DEFAULTS: Dict[str, Dict[str, Any]] = {
    # The PPO baselines' Atari recipe (Adam 2.5e-4, entropy 0.01, grad norm 0.5) with
    # rl_games' Pong unrolls (128 steps; the first 32-step runs stood still at -20 after
    # 4.7M frames: most of their trajectories held no point). One actor message per batch
    # (2,048 steps) in 4 minibatches: rl_games' 4 optimizer steps per 1,024 steps. Two epochs, not four: on two cores the
    # learner's forward+backward (~1.1 ms per sample and epoch) is most of the work, so a
    # third and fourth epoch would cost ~40% of the frames per second. Two learner threads:
    # the actors collect a batch (~0.6 core-s) in a fraction of the learner's ~2.5 s on it,
    # so their core is mostly free while it trains (IMPALA's learner, ~4x cheaper per
    # sample, kept both cores busy and lost with a second thread).
    "cpu": {"optimizer": "adam", "lr": 2.5e-4, "entropy_cost": 0.01, "max_grad_norm": 0.5,
            "batch_size": 1, "minibatches": 4, "epochs": 2, "max_epochs": 2, "learner_threads": 2,
            "unroll": 128, "value_clip": 0.0},
    # rl_games' Pong batch on a GPU: 24 games x 256 steps in minibatches of 768 over 3
    # epochs; here 3 messages of 16 games x 128 steps (6,144), a 4th epoch only while the
    # actors have not yet delivered the next batch.
    "cuda": {"optimizer": "adam", "lr": 2.5e-4, "entropy_cost": 0.01, "max_grad_norm": 0.5,
             "batch_size": 3, "minibatches": 8, "epochs": 3, "max_epochs": 4, "learner_threads": 1,
             "unroll": 128, "value_clip": 0.0},
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    launched = time.time()
    parser = _util.parser(__doc__.splitlines()[0], workers=2, budget=600, out="runs/impala_atari.csv")
    parser.add_argument("--algo", choices=("appo", "impala"), default=None,
                        help="the learner: PPO's clipped surrogate over several epochs of each batch, or "
                             "IMPALA's single V-trace pass (default: appo on the CPU, impala on a GPU)")
    parser.add_argument("--curve", default=None, metavar="PNG",
                        help="also draw the mean return against wall time and frames into this PNG")
    parser.add_argument("--env", default="pong", help="ALE game: pong, breakout, ALE/Pong-v5, ... (default pong)")
    parser.add_argument("--envs-per-worker", type=_util.positive_int, default=16,
                        help="games each actor steps (default 16)")
    # On a GPU, central: one batched forward there for every actor's games left the CPU
    # cores to the games (H200, 8 actors: 4.65x the CPU learner's local inference).
    parser.add_argument("--inference", choices=("local", "central", "auto"), default=None,
                        help="where the acting policy runs: a copy in each actor, one batched server on the "
                             "learner, or whichever trains faster in a short trial (default: central with a "
                             "CUDA --device, else local)")
    parser.add_argument("--auto-seconds", type=_util.positive_float, default=10.0,
                        help="--inference auto: seconds each mode is measured (default 10)")
    parser.add_argument("--max-batch", type=_util.positive_int, default=64,
                        help="central inference: rows per forward (default 64)")
    parser.add_argument("--max-wait", type=_util.non_negative_float, default=0.002,
                        help="central inference: seconds a forward waits for more rows (default 0.002)")
    # IMPALA: one; with the actors on the same two cores, a second intra-op thread only waits
    # for a core (measured: 1,031 agent steps/s with one, 929 with two, local inference).
    parser.add_argument("--learner-threads", type=_util.positive_int, default=None,
                        help="torch threads of the learner (default: 2 for appo on the CPU, else 1)")
    parser.add_argument("--unroll", type=_util.positive_int, default=None,
                        help="trajectory length T, steps (default: impala 32; appo 128, so that most "
                             "trajectories hold a point of Pong, not only the value's guess of one)")
    parser.add_argument("--batch-size", type=_util.positive_int, default=None,
                        help="actor messages (E games x T steps each) per update (default: impala 1; appo 1 on "
                             "the CPU, 3 on a GPU)")
    # More, smaller steps per batch (A2C-like) take more steps per frame, as RMSprop's step
    # does not grow with the batch; but a step over 4 games costs ~30% more per sample than
    # one over 16 (the convolutions at a small batch), and on Pong neither learned faster
    # within 3M frames: one step per batch by default.
    parser.add_argument("--minibatches", type=_util.positive_int, default=None,
                        help="optimizer steps per batch (appo: per epoch), each on a slice of its games (impala: "
                             "at most one per game) or of its shuffled steps (appo) (default: impala 1; appo 4 on "
                             "the CPU, 8 on a GPU)")
    parser.add_argument("--epochs", type=_util.positive_int, default=None,
                        help="appo: passes over each batch (default 2 on the CPU, 4 on a GPU)")
    parser.add_argument("--max-epochs", type=_util.positive_int, default=None,
                        help="appo: more passes, up to this many, while no next batch waits (default: "
                             "--epochs on the CPU, 6 on a GPU)")
    parser.add_argument("--advantages", choices=("gae", "vtrace"), default="gae",
                        help="appo: GAE on the learner's values, or V-trace-corrected (default gae)")
    parser.add_argument("--gae-lambda", type=_util.fraction, default=0.95, help="appo: GAE's lambda (default 0.95)")
    # 0.2, not the PPO baselines' 0.1: the ratio is against the policy that acted, a few
    # versions back (lag), and 0.1 clipped 25-40% of the steps in the short checks.
    parser.add_argument("--clip", type=_util.open_fraction, default=0.2,
                        help="appo: the surrogate's epsilon (default 0.2)")
    parser.add_argument("--lr-schedule", choices=("adaptive", "constant"), default="adaptive",
                        help="appo: adapt the learning rate to keep each epoch's KL near --kl-target (rl_games' "
                             "schedule), or keep --lr (default adaptive)")
    parser.add_argument("--kl-target", type=_util.positive_float, default=0.01,
                        help="appo: the KL per epoch the adaptive schedule aims at; extra epochs stop above "
                             "it (default 0.01)")
    parser.add_argument("--max-lr", type=_util.positive_float, default=1e-3,
                        help="appo: the adaptive schedule's ceiling (default 1e-3)")
    parser.add_argument("--value-clip", type=_util.non_negative_float, default=None,
                        help="appo: clip the value's move per batch to this (PPO2), in the value head's "
                             "units; 0: off (default 0: values are normalised, as rl_games' Pong)")
    parser.add_argument("--no-input-norm", dest="input_norm", action="store_false",
                        help="appo: frames scaled to [0, 1] instead of each pixel's running mean and spread")
    parser.add_argument("--no-value-norm", dest="value_norm", action="store_false",
                        help="appo: the value head predicts raw returns instead of normalised ones")
    # One: a trajectory that waits in a queue is trained on further from the weights that
    # acted (measured policy lag 8 versions with a queue of 4, 3 with one).
    parser.add_argument("--queue-size", type=_util.positive_int, default=None,
                        help="messages the learner queues (default: --batch-size)")
    parser.add_argument("--optimizer", choices=("rmsprop", "adam"), default=None,
                        help="RMSprop as the IMPALA paper (decay 0.99, eps 0.01) or Adam (default: impala "
                             "rmsprop, appo adam)")
    parser.add_argument("--lr", type=_util.positive_float, default=None,
                        help="learning rate (default: impala 6e-4, appo 2.5e-4)")
    parser.add_argument("--gamma", type=_util.fraction, default=0.99, help="discount (default 0.99)")
    # The losses are sums over the batch's steps (as TorchBeast and DeepMind's scalable_agent
    # sum theirs, with entropy costs of 0.0006 and 0.00025): 0.01 kept Pong's policy uniform.
    parser.add_argument("--entropy-cost", type=_util.non_negative_float, default=None,
                        help="weight of the entropy bonus: impala's summed loss (default 0.0006), appo's mean "
                             "loss (default 0.01)")
    parser.add_argument("--normalize-advantages", action="store_true",
                        help="scale each minibatch's V-trace advantages to mean 0, std 1 (default off)")
    parser.add_argument("--baseline-cost", type=_util.non_negative_float, default=0.5,
                        help="weight of the value (baseline) loss added to the policy loss (default 0.5)")
    parser.add_argument("--max-grad-norm", type=_util.positive_float, default=None,
                        help="gradient clipping (default: impala 40, appo 0.5)")
    parser.add_argument("--window", type=_util.positive_int, default=100,
                        help="episodes in the mean return (default 100)")
    parser.add_argument("--target", type=_util.number, default=None,
                        help="stop when the mean return reaches this; 0: use the whole budget "
                             "(default 18 for Pong, else 0)")
    parser.add_argument("--rpc-timeout", type=_util.positive_float, default=120.0,
                        help="seconds per RPC wait (default 120)")
    parser.add_argument("--print-every", type=_util.positive_float, default=10.0,
                        help="seconds between progress lines (default 10)")
    args = parser.parse_args(argv)
    args.launched = launched
    if args.algo is None:
        # What each machine has shown to learn Pong fastest (BENCHMARKS.md): APPO reached +18 in
        # 55 minutes on two cores, where IMPALA stood at -20 after an hour; on a GPU, IMPALA's
        # -9.9 at 6.5 minutes is measured and APPO's 128-step recipe not yet.
        args.algo = "impala" if args.device.startswith("cuda") else "appo"
    defaults = IMPALA_DEFAULTS if args.algo == "impala" else APPO_DEFAULTS[args.device.split(":")[0]]
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    several = [f"--{name.replace('_', '-')} {getattr(args, name)}" for name in ("epochs", "max_epochs")
               if getattr(args, name) != 1]
    if args.algo == "impala" and several:
        parser.error(f"{', '.join(several)}: IMPALA makes one pass over each batch; use --algo appo for several")
    if args.max_epochs < args.epochs:
        args.max_epochs = args.epochs  # --epochs given alone: no extra epochs unless asked
    if args.queue_size is None:
        args.queue_size = args.batch_size
    if args.inference is None:
        args.inference = "central" if args.device.startswith("cuda") else "local"
    if args.queue_size < args.batch_size:
        parser.error(f"--queue-size {args.queue_size} must be at least --batch-size {args.batch_size}")
    args.value_clip = args.value_clip or None
    if args.max_lr < args.lr:
        parser.error(f"--max-lr {args.max_lr:g} must be at least --lr {args.lr:g}")
    if args.curve is not None and not args.curve.lower().endswith(".png"):
        parser.error(f"--curve {args.curve!r}: name a .png file, e.g. --curve pong.png")
    episode_plot = os.path.splitext(os.path.abspath(args.out))[0] + ".png"
    if args.curve is not None and os.path.abspath(args.curve) == episode_plot:
        parser.error(f"--curve {args.curve!r} is where the episode plot of --out {args.out!r} goes; name another file")
    try:
        args.game = ale_game(args.env)
    except ValueError as err:
        parser.error(str(err))
    if args.target is None:
        args.target = 18.0 if args.game == "pong" else 0.0
    env = make_envs(args.game, 1)  # the action count, before any process starts
    args.actions = int(env.single_action_space.n)
    env.close()
    return args


def plot_learning_curve(csv_path: str, png: str, title: str, levels: Sequence[float] = (0.0, 18.0)) -> Optional[str]:
    """Draw the mean return of the last 100 episodes against minutes since launch and
    against frames (two panels) from the run's curve CSV into ``png``.

    Returns:
        ``png``, or None without matplotlib (said aloud) or without a mean yet.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[examples]'): no --curve PNG")
        return None
    with open(csv_path, newline="") as stream:
        rows = [r for r in csv.DictReader(stream) if r.get("mean_return") not in ("", None)]
    if not rows:
        print(f"--curve {png}: no episode finished, nothing to draw")
        return None
    minutes = [float(r["launch_s"]) / 60 for r in rows]
    frames = [4 * int(r["env_steps"]) / 1e6 for r in rows]
    means = [float(r["mean_return"]) for r in rows]
    figure, axes = plt.subplots(1, 2, figsize=(10, 3.8), sharey=True)
    for axis, x, label in ((axes[0], minutes, "wall time since launch (min)"), (axes[1], frames, "frames (M)")):
        axis.plot(x, means, linewidth=1.4)
        for level in levels:
            axis.axhline(level, color="grey", linestyle=":", linewidth=0.8)
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("mean return, last 100 episodes")
    figure.suptitle(title)
    figure.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(png)), exist_ok=True)
    figure.savefig(png, dpi=100)
    plt.close(figure)
    return png


def main() -> None:
    args = parse_args()
    start = time.monotonic()
    results = [r for r in _util.run(worker, 1 + args.num_workers, args, chaos_ok=True) if r]
    for result in results:
        if result.get("name") != "0":
            continue
        title = f"{args.algo.upper()} on ALE {args.game}"
        png = _util.plot_csv(args.out, "env_steps", ["return", "mean_return"], f"{title}: episode returns")
        curve = None
        if args.curve:
            curve = plot_learning_curve(args.out, args.curve, f"{title}, {args.device}, {args.num_workers} actors x "
                                                              f"{args.envs_per_worker} games")
        cpu = sum(r["cpu"] for r in results) + (cpu_seconds() if len(results) > 1 or args.chaos else 0.0)
        _util.summary(title, {
            "stopped": result["reason"],
            f"mean return, last {args.window} episodes": format_mean(result["mean_return"]),
            "episodes": result["episodes"],
            "frames (agent steps x 4)": f"{4 * result['env_steps']:,}",
            "learner updates": result["updates"],
            "learner batches": result["batches"],
            "training throughput": result["throughput"],
            "inference": result["inference"],
            "training time (incl. set-up)": f"{result['train_time']:.1f} s",
            "wall time": _util.wall_time(start),
            "CPU time, all processes" + ("" if len(results) > 1 else " (this rank)"): f"{cpu:.1f} s",
            **({"chaos": f"every {args.chaos:g} s: {result['losses']} actors lost, {result['rejoins']} rejoined"}
               if args.chaos is not None else {}),
            "learning curve": args.out + (f", {png}" if png else "") + (f", {curve}" if curve else ""),
            **_util.metrics_summary(args, title, x="agent steps"),
        })
        for line in result["milestones"]:  # last: the lines a reader (and a benchmark) looks for
            print(line, flush=True)


if __name__ == "__main__":
    main()
