"""A3C on CartPole-v1: workers push gradients to a gradient server and pull fresh parameters.

Run it locally (spawns the learner and the workers itself):
    python examples/a3c.py
    python examples/a3c.py --num-workers 3 --time-budget 300
The managed networks and their optimizers on a GPU (the workers stay on the CPU):
    python examples/a3c.py --device cuda
or under torchrun, unchanged (rank 0 is the learner, the other ranks are workers):
    torchrun --standalone --nproc-per-node 4 examples/a3c.py

Asynchronous advantage actor-critic, as machin's A3C does it: the actor and the critic
are separate networks, each managed by a ``PushPullGradServer`` whose primary reducer
(and Adam optimizer) lives on rank 0. Every worker repeatedly

1. pulls the newest actor and critic parameters (nothing moves when it has them),
2. runs ``--envs-per-worker`` CartPole environments for ``--rollout`` steps with the
   actor (one batched forward per step),
3. computes GAE(lambda) advantages, bootstrapping from the critic after the last step
   and at time-limit truncations (not at terminations),
4. back-propagates the policy-gradient loss with an entropy bonus and the critic's
   squared error, clips each network's gradient norm, and
5. pushes both gradients to the workers' own secondary reducers, which forward them to
   the primaries on rank 0; each push is one optimizer step there (``--reduce-batch 1``).

Rank 0 also keeps the episode log: workers report finished episodes; the mean return of
the last 100 episodes (over all workers, in order of arrival) is the figure. Training
stops once that mean reaches ``--stop-at``, or at the time budget.
"""

from __future__ import annotations

import argparse
import collections
import threading
import time
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

import numpy as np
import torch
import torch.nn.functional as F

import _util  # the examples' shared plumbing, beside this script
from _metrics import RunMetrics, logdir_of
import machinlike
from machinlike.metrics import flatten_stats
from machinlike.server import grad_server_helper

GROUP = "a3c"
ENV_ID = "CartPole-v1"
OBS_SIZE, ACTIONS = 4, 2


def make_actor(hidden: int = 64) -> torch.nn.Module:
    """Policy network: observation -> action logits."""
    return torch.nn.Sequential(torch.nn.Linear(OBS_SIZE, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, ACTIONS))


def make_critic(hidden: int = 64) -> torch.nn.Module:
    """Value network: observation -> state value."""
    return torch.nn.Sequential(torch.nn.Linear(OBS_SIZE, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, hidden), torch.nn.Tanh(),
                               torch.nn.Linear(hidden, 1))


class Rollout(NamedTuple):
    """``steps`` x ``envs`` transitions of one rollout (numpy arrays)."""

    obs: np.ndarray        # (steps, envs, OBS_SIZE) observations the actions were taken in
    actions: np.ndarray    # (steps, envs) int64
    rewards: np.ndarray    # (steps, envs) float32
    done: np.ndarray       # (steps, envs) bool: the episode ended with this transition
    truncated: List[Tuple[int, int, np.ndarray]]  # (step, env, final observation) at time limits
    last_obs: np.ndarray   # (envs, OBS_SIZE) observations after the last step


class Sampler:
    """``num_envs`` CartPole environments stepped in lockstep, one actor forward per step.

    Keeps the running return and length of every environment's episode; finished
    episodes collect in :attr:`finished` until the caller takes them.
    """

    def __init__(self, num_envs: int, seed: int) -> None:
        import gymnasium  # only the workers need it

        self.envs = [gymnasium.make(ENV_ID) for _ in range(num_envs)]
        self.obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(self.envs)]).astype(np.float32)
        for i, env in enumerate(self.envs):
            env.action_space.seed(seed + i)
        self.rng = np.random.default_rng(seed)
        self.returns = np.zeros(num_envs)
        self.lengths = np.zeros(num_envs, dtype=np.int64)
        self.finished: List[Tuple[float, int]] = []
        self.steps = 0

    def close(self) -> None:
        for env in self.envs:
            env.close()

    def rollout(self, actor: torch.nn.Module, steps: int) -> Rollout:
        envs = len(self.envs)
        obs = np.empty((steps, envs, OBS_SIZE), dtype=np.float32)
        actions = np.empty((steps, envs), dtype=np.int64)
        rewards = np.empty((steps, envs), dtype=np.float32)
        done = np.zeros((steps, envs), dtype=bool)
        truncated: List[Tuple[int, int, np.ndarray]] = []
        with torch.no_grad():
            for t in range(steps):
                probs = torch.softmax(actor(torch.from_numpy(self.obs)), dim=-1).numpy()
                # inverse-CDF sampling with numpy: much cheaper than torch.distributions per step
                chosen = (self.rng.random((envs, 1)) > np.cumsum(probs, axis=1)).sum(axis=1)
                np.minimum(chosen, ACTIONS - 1, out=chosen)
                obs[t] = self.obs
                actions[t] = chosen
                for i, env in enumerate(self.envs):
                    next_obs, reward, terminated, truncated_now, _ = env.step(int(chosen[i]))
                    rewards[t, i] = reward
                    self.returns[i] += reward
                    self.lengths[i] += 1
                    if terminated or truncated_now:
                        done[t, i] = True
                        if truncated_now and not terminated:
                            truncated.append((t, i, np.asarray(next_obs, dtype=np.float32)))
                        self.finished.append((float(self.returns[i]), int(self.lengths[i])))
                        self.returns[i] = 0.0
                        self.lengths[i] = 0
                        next_obs, _ = env.reset()
                    self.obs[i] = next_obs
        self.steps += steps * envs
        return Rollout(obs, actions, rewards, done, truncated, self.obs.copy())

    def take_finished(self) -> List[Tuple[float, int]]:
        finished, self.finished = self.finished, []
        return finished


def a3c_losses(actor: torch.nn.Module, critic: torch.nn.Module, batch: Rollout, gamma: float, lam: float,
               entropy_coef: float,
               reward_scale: float = 1.0) -> Tuple[torch.Tensor, torch.Tensor, Dict[str, float]]:
    """(actor loss, critic loss, diagnostics) of one rollout, with GAE(lambda) advantages.

    Rewards are multiplied by ``reward_scale`` for learning only: with CartPole's reward
    of 1 per step, discounted returns reach ~100 and a critic chasing targets that large
    (through a clipped gradient) lags behind and destabilises the policy; 0.1 keeps them
    near 10. The returns reported as the figure are the environment's, unscaled.
    """
    steps, envs = batch.actions.shape
    obs = torch.from_numpy(batch.obs).reshape(steps * envs, OBS_SIZE)
    logits = actor(obs).reshape(steps, envs, ACTIONS)
    values = critic(obs).reshape(steps, envs)
    rewards = torch.from_numpy(batch.rewards) * reward_scale
    done = torch.from_numpy(batch.done)
    with torch.no_grad():
        v = values.detach()
        # The value of the state after each transition: the next row, the critic's view of
        # the state after the last step, zero after a termination, and the critic's view
        # of the final state after a time-limit truncation (the episode did not fail).
        next_v = torch.cat([v[1:], critic(torch.from_numpy(batch.last_obs)).reshape(1, envs)])
        next_v = next_v.masked_fill(done, 0.0)
        if batch.truncated:
            final = critic(torch.from_numpy(np.stack([o for _, _, o in batch.truncated]))).reshape(-1)
            for (t, i, _), value in zip(batch.truncated, final, strict=True):
                next_v[t, i] = value
        advantages = torch.empty(steps, envs)
        running = torch.zeros(envs)
        keep = (~done).float()
        for t in reversed(range(steps)):
            delta = rewards[t] + gamma * next_v[t] - v[t]
            running = delta + gamma * lam * keep[t] * running
            advantages[t] = running
        returns = advantages + v
    log_probs = F.log_softmax(logits, dim=-1)
    taken = log_probs.gather(-1, torch.from_numpy(batch.actions).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
    actor_loss = -(taken * advantages).mean() - entropy_coef * entropy
    critic_loss = 0.5 * (returns - values).pow(2).mean()
    return actor_loss, critic_loss, {"entropy": entropy.item(), "value": v.mean().item()}


class EpisodeLog:
    """Rank 0's log of finished episodes, in order of arrival (the workers report them).

    Args:
        curve: Where every episode becomes a row.
        target: The quality bar; the first time the mean of the last 100 reaches it is noted.
        stop_at: Mean of the last 100 at which training stops (0: only the time budget).

    Attributes:
        started: ``time.monotonic()`` when training started (reset by the learner).
        workers: The latest counters of each worker (``steps``, ``refused``, ``entropy``, ``cpu``).
    """

    def __init__(self, curve: _util.Curve, target: float, stop_at: float) -> None:
        self.curve = curve
        self.target = target
        self.stop_at = stop_at
        self.started = time.monotonic()
        self.last100: collections.deque = collections.deque(maxlen=100)
        self.episodes = 0
        self.workers: Dict[str, Dict[str, float]] = {}
        self.reached: Optional[Dict[str, float]] = None
        self.stopped: Optional[str] = None
        self.stop = threading.Event()
        self._lock = threading.Lock()
        #: Called with each report's returns and lengths (the run's metrics); None: nobody.
        self.listener: Optional[Callable[[List[float], List[int]], None]] = None

    def mean(self) -> float:
        return float(np.mean(self.last100)) if self.last100 else 0.0

    def total(self, counter: str) -> float:
        return sum(w[counter] for w in self.workers.values())

    def env_steps(self) -> int:
        return int(self.total("steps"))

    def report(self, member: str, episodes: List[Tuple[float, int]], counters: Dict[str, float]) -> bool:
        """A worker's finished episodes and counters; returns whether training is over."""
        if self.listener is not None and episodes and not self.stop.is_set():
            self.listener([r for r, _ in episodes], [n for _, n in episodes])
        with self._lock:
            if self.stop.is_set():  # episodes ending after the stop do not count
                self.workers.setdefault(member, dict(counters))["cpu"] = counters["cpu"]
                return True
            self.workers[member] = counters
            seconds = time.monotonic() - self.started
            for episode_return, length in episodes:
                self.episodes += 1
                self.last100.append(episode_return)
                full = len(self.last100) == 100
                mean = self.mean()
                self.curve.add(episode=self.episodes, seconds=f"{seconds:.2f}", env_steps=self.env_steps(),
                               worker=member, length=length, episode_return=f"{episode_return:g}",
                               mean_return_100=f"{mean:.2f}" if full else "")
                if full and self.reached is None and mean >= self.target:
                    self.reached = {"seconds": seconds, "episode": self.episodes, "env_steps": self.env_steps()}
                if full and self.stop_at and mean >= self.stop_at:
                    self.finish(f"the mean return of the last 100 episodes reached {self.stop_at:g}")
                    break
            return self.stop.is_set()

    def finish(self, reason: str) -> None:
        if self.stopped is None:
            self.stopped = reason
        self.stop.set()


def learn(world: machinlike.World, args: argparse.Namespace, group: machinlike.RpcGroup, servers: Any,
          log: EpisodeLog) -> Dict[str, Any]:
    """Rank 0: the primaries step the optimizers on their threads; here we print progress."""
    deadline = log.started + args.time_budget
    progress = _util.Progress(args.print_every)
    metrics = RunMetrics(logdir_of(args), world, args.metrics_every, enabled=not args.no_metrics)
    log.listener = metrics.episodes
    _util.announce_watch(world, logdir_of(args), args.no_metrics, "learner")
    last = {"t": 0.0, "steps": 0, "updates": 0}
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            log.finish(f"the time budget of {args.time_budget:g} s ran out")
        wake = args.print_every if args.no_metrics else min(args.print_every, args.metrics_every)
        if log.stop.wait(max(0.0, min(wake, left))):
            break
        servers.watch()  # a failed reducer thread ends the run with its own error
        stats = servers.stats()
        actor = stats[0]["primary"]
        if metrics.due():
            workers = max(1, len(log.workers))
            metrics.log(log.env_steps(), actor["steps"], learner={
                "loss_actor": log.total("actor_loss") / workers, "loss_critic": log.total("critic_loss") / workers,
                "entropy": log.total("entropy") / workers, "grad_norm": log.total("grad_norm") / workers,
                "policy_lag": actor["lag_mean"], "pushes_refused": log.total("refused")},
                servers={**flatten_stats(stats[0], "server/actor"), **flatten_stats(stats[1], "server/critic")})
        if not progress.due():
            continue
        seconds = time.monotonic() - log.started
        steps = log.env_steps()
        span = max(1e-9, seconds - last["t"])
        entropy = log.total("entropy") / max(1, len(log.workers))
        print(f"[{seconds:6.1f} s] episodes {log.episodes:5d}  env steps {steps:7d} "
              f"({(steps - last['steps']) / span:5.0f}/s)  mean return (last 100) {log.mean():5.1f}  "
              f"updates {actor['steps']:5d} ({(actor['steps'] - last['updates']) / span:4.1f}/s)  "
              f"version lag mean {actor['lag_mean']:.2f} max {actor['lag_max']}  entropy {entropy:.2f}",
              flush=True)
        last.update(t=seconds, steps=steps, updates=actor["steps"])
    servers.watch()
    metrics.close()
    stats = [s["primary"] for s in servers.stats()]
    return {"stats": stats, "episodes": log.episodes, "env_steps": log.env_steps(), "mean": log.mean(),
            "full": len(log.last100) == 100, "reached": log.reached, "stopped": log.stopped,
            "seconds": time.monotonic() - log.started, "refused": int(log.total("refused")),
            "cpu": time.process_time() + log.total("cpu")}


def act(world: machinlike.World, args: argparse.Namespace, group: machinlike.RpcGroup, servers: Any,
        label: Optional[str] = None) -> None:
    """A worker: pull, sample, compute gradients, push; report episodes until told to stop.

    ``label``: the name it reports under (None: its member name); a restarted worker
    reports under a new one so that its counters, which start afresh, add to the old ones.
    """
    actor_server, critic_server = servers
    actor, critic = make_actor(args.hidden), make_critic(args.hidden)
    sampler = Sampler(args.envs_per_worker, args.seed * 10000 + world.rank * 100)
    last_report = time.monotonic()
    refused = 0
    try:
        while True:
            actor_server.pull(actor)
            critic_server.pull(critic)
            batch = sampler.rollout(actor, args.rollout)
            actor_loss, critic_loss, info = a3c_losses(actor, critic, batch, args.gamma, args.gae_lambda,
                                                    args.entropy, args.reward_scale)
            actor.zero_grad(set_to_none=False)
            critic.zero_grad(set_to_none=False)
            (actor_loss + critic_loss).backward()  # the two networks share no parameters
            grad_norm = float(torch.nn.utils.clip_grad_norm_(actor.parameters(), args.clip))
            torch.nn.utils.clip_grad_norm_(critic.parameters(), args.clip)
            # False: the local secondary's queue was full and dropped the push (not expected
            # with --reduce-batch 1 unless rank 0 is starved of CPU); counted, not hidden.
            refused += (not actor_server.push(actor, pull=False)) + (not critic_server.push(critic, pull=False))
            servers.watch()
            now = time.monotonic()
            if sampler.finished or now - last_report >= 1.0:
                last_report = now
                counters = {"steps": sampler.steps, "refused": refused, "entropy": info["entropy"],
                            "cpu": time.process_time(), "actor_loss": actor_loss.item(),
                            "critic_loss": critic_loss.item(), "grad_norm": grad_norm}
                if group.registered_sync("report", (label or world.name, sampler.take_finished(), counters)):
                    break
    finally:
        sampler.close()
    # Apply what is still queued on the secondaries: stopping them with pushes queued
    # would drop those (with a warning). Everyone is still running: close() comes later.
    actor_server.flush()
    critic_server.flush()


class _Hosted:
    """The elastic run's servers, shaped as ``learn()`` and ``act()`` use them."""

    def __init__(self, impls: List[Any], accessors: List[Any]) -> None:
        self.impls, self.accessors = impls, accessors

    def __iter__(self) -> Any:
        return iter(self.accessors)

    def stats(self) -> List[Dict[str, Any]]:
        return [impl.stats() for impl in self.impls]

    def watch(self) -> None:
        for impl in self.impls:
            impl.watch()


def worker_elastic(world: machinlike.World, args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """``--chaos``: an elastic world where workers die (SIGKILL) and come back.

    Rank 0 (the learner, "0") is essential and hosts both primaries. Each worker hosts a
    secondary reducer of each server; one that dies takes its queued pushes with it (the
    servers count them) and its replacement rejoins the running servers with fresh
    environments. A worker, first or restarted, waits at a :class:`_util.ReadyGate` that
    the learner opens once both servers exist (the learner may still be building them
    when a worker joins). Once training stops, the learner waits (bounded) for the live
    workers to say they flushed, then closes the servers.
    """
    from machinlike.exception import PeerLostError
    from machinlike.server import PushPullGradServerImpl

    torch.set_num_threads(1)
    learner, names = "0", ["a3c_actor", "a3c_critic"]
    options = dict(primary_reducer=learner, reduce_method="mean", reduce_batch_size=args.reduce_batch,
                   max_queue_size=max(64, args.reduce_batch))
    group = world.create_rpc_group(GROUP)  # open: a restarted worker rejoins at once
    gate = _util.ReadyGate(world, group, f"{GROUP}/ready")
    if world.name == learner:
        _util.member_printer(world, "learner")
        columns = ["episode", "seconds", "env_steps", "worker", "length", "episode_return", "mean_return_100"]
        log = EpisodeLog(_util.Curve(args.out, columns), args.target, args.stop_at)
        bye: set = set()
        bye_changed = threading.Condition()

        def said_bye(member: str) -> None:
            with bye_changed:
                bye.add(member)
                bye_changed.notify_all()

        group.register("report", log.report)
        group.register("bye", said_bye)
        torch.manual_seed(args.seed)
        impls = []
        for name, model, lr in ((names[0], make_actor(args.hidden).to(args.device), args.actor_lr),
                                (names[1], make_critic(args.hidden).to(args.device), args.critic_lr)):
            impl = PushPullGradServerImpl(name, group, **options)
            impl.manage_model(model, torch.optim.Adam(model.parameters(), lr=lr))
            impl.start()
            impls.append(impl)
        print(f"A3C on {ENV_ID}: {_util.plural(args.num_workers, 'worker')} x {_util.plural(args.envs_per_worker, 'environment')}, "
              f"learner on rank 0 ({args.device}), chaos every {args.chaos:g} s", flush=True)
        hosted = _Hosted(impls, [group.get_paired(n).to_here() for n in names])
        gate.open()  # both servers and the report services exist: workers may start
        log.started = time.monotonic()
        result = learn(world, args, group, hosted, log)
        # The workers flush their secondaries once told to stop; wait for the live ones
        # (a worker that dies meanwhile drops out of the live set).
        deadline = time.monotonic() + 30.0
        with bye_changed:
            while not set(world.get_members()) - {learner} <= bye and time.monotonic() < deadline:
                bye_changed.wait(0.2)  # also re-reads the live set: a loss notifies nobody here
        gate.close()
        for accessor in hosted.accessors:
            accessor.flush()
        result["members"] = impls[0].stats()["members"]
        result["dropped"] = sum(i.stats()["primary"]["dropped_dead_reducer"] for i in impls)
        for impl in impls:
            impl.close()
        return result
    if world.membership.gone(learner):
        return None  # restarted after the learner finished
    impls = _util.after_host(world, gate, learner, "worker", "learner",
                             lambda: [PushPullGradServerImpl(n, group, **options) for n in names])
    if impls is None:
        return None
    for impl in impls:
        impl.start()
    try:
        accessors = [group.get_paired(n, timeout=60.0).to_here() for n in names]
        label = world.name if world.incarnation == 1 else f"{world.name}.{world.incarnation}"
        act(world, args, group, _Hosted(impls, accessors), label)
        group.registered_sync("bye", (world.name,))
        # Stay (hosting the secondaries) until the learner has flushed them and left.
        world.wait_for_members([learner], timeout=args.time_budget + 120.0, gone=True)
    except PeerLostError as err:
        if err.member != learner:
            raise
    except KeyError:  # past the gate, a missing service means the learner withdrew it: finishing
        print(f"[worker {world.name}] stopped: the learner finished (it withdrew its services)", flush=True)
    for impl in impls:
        impl.close()
    return None


def worker(world: machinlike.World, args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    if world.elastic:
        return worker_elastic(world, args)
    torch.set_num_threads(1)  # 2 cores shared by every rank
    if world.world_size < 2:
        raise ValueError(f"a3c needs at least 2 processes (a learner and a worker), got {world.world_size}")
    members = world.get_members()
    learner, workers = members[0], members[1:]
    group = world.create_rpc_group(GROUP, members)
    log: Optional[EpisodeLog] = None
    if world.name == learner:
        columns = ["episode", "seconds", "env_steps", "worker", "length", "episode_return", "mean_return_100"]
        log = EpisodeLog(_util.Curve(args.out, columns), args.target, args.stop_at)
        group.register("report", log.report)
        torch.manual_seed(args.seed)  # the managed networks' initial weights
        print(f"A3C on {ENV_ID}: {_util.plural(len(workers), 'worker')} x {_util.plural(args.envs_per_worker, 'environment')}, "
              f"learner on rank 0 ({args.device})", flush=True)
    servers = grad_server_helper(
        # Only the primary (the learner) builds these: the managed models live on --device;
        # the workers' own copies stay on the CPU (pushes and pulls cast between them).
        [lambda: make_actor(args.hidden).to(args.device), lambda: make_critic(args.hidden).to(args.device)],
        group=group,
        optimizer=torch.optim.Adam, learning_rate=[args.actor_lr, args.critic_lr], server_name="a3c",
        primary_reducer=learner, secondary_reducers=workers, reduce_method="mean",
        reduce_batch_size=args.reduce_batch, max_queue_size=max(64, args.reduce_batch))
    result: Optional[Dict[str, Any]] = None
    if log is not None:
        log.started = time.monotonic()  # training starts now that the servers are up
        result = learn(world, args, group, servers, log)
    else:
        act(world, args, group, servers)
    # Nobody stops a reducer (close() does) before every worker has stopped pushing.
    group.barrier()
    servers.close()
    group.destroy()
    return result


def main() -> None:
    p = _util.parser(__doc__.splitlines()[0], workers=3, budget=540.0, out="runs/a3c.csv")
    p.add_argument("--envs-per-worker", type=_util.positive_int, default=4,
                   help="environments each worker steps (default 4)")
    p.add_argument("--rollout", type=_util.positive_int, default=32,
                   help="steps per environment between pushes (default 32)")
    p.add_argument("--actor-lr", type=_util.positive_float, default=1e-3,
                   help="Adam learning rate of the actor (default 1e-3)")
    p.add_argument("--critic-lr", type=_util.positive_float, default=1e-3,
                   help="Adam learning rate of the critic (default 1e-3)")
    p.add_argument("--gamma", type=_util.fraction, default=0.99, help="discount (default 0.99)")
    p.add_argument("--gae-lambda", type=_util.fraction, default=0.95, help="GAE lambda (default 0.95)")
    p.add_argument("--entropy", type=_util.non_negative_float, default=0.01, help="entropy bonus weight (default 0.01)")
    p.add_argument("--reward-scale", type=_util.positive_float, default=0.1,
                   help="rewards are multiplied by this for learning; keeps the critic's targets small (default 0.1)")
    p.add_argument("--clip", type=_util.positive_float, default=0.5,
                   help="gradient-norm clip per network and push (default 0.5)")
    p.add_argument("--hidden", type=_util.positive_int, default=64, help="hidden units per layer (default 64)")
    p.add_argument("--reduce-batch", type=_util.positive_int, default=1,
                   help="pushes each reducer combines; 1: every push is one optimizer step (default 1)")
    p.add_argument("--target", type=_util.non_negative_float, default=195.0,
                   help="quality bar for the mean return of the last 100 episodes (default 195)")
    p.add_argument("--stop-at", type=_util.non_negative_float, default=400.0,
                   help="stop once the mean return of the last 100 episodes reaches this; 0: train for the "
                        "whole budget (default 400, well above --target)")
    p.add_argument("--print-every", type=_util.positive_float, default=5.0,
                   help="seconds between progress lines (default 5)")
    args = p.parse_args()
    start = time.monotonic()
    results = _util.run(worker, args.num_workers + 1, args, chaos_ok=True)
    final = results[0] if results else None
    if final is None:  # a torchrun rank other than 0: rank 0 prints the summary
        return
    actor = final["stats"][0]
    png = _util.plot_csv(args.out, "episode", ["episode_return", "mean_return_100"], f"a3c: {ENV_ID}")
    reached = final["reached"]
    verdict = "reached" if final["full"] and final["mean"] >= args.target else "NOT reached"
    _util.summary("a3c", {
        "mean return": (f"{final['mean']:.1f} over the last 100 episodes (target {args.target:g}: {verdict})"
                        if final["full"] else f"{final['mean']:.1f} over only {final['episodes']} episodes"),
        "target first reached": (f"after {reached['seconds']:.1f} s of training, episode {reached['episode']}, "
                                 f"{reached['env_steps']} env steps" if reached else "never"),
        "stopped": f"{final['stopped']}, after {final['seconds']:.1f} s of training",
        "episodes": f"{final['episodes']} ({final['env_steps']} env steps)",
        "server": (f"{actor['steps']} actor updates from {actor['applied']} pushes, "
                   f"{actor['steps'] / max(1e-9, final['seconds']):.1f} updates/s, version lag mean "
                   f"{actor['lag_mean']:.2f} max {actor['lag_max']}, {final['refused']} pushes refused"),
        **({"chaos": (f"every {args.chaos:g} s: {final['members']['losses']} workers lost, "
                      f"{final['members']['rejoins']} rejoined, {_util.plural(final['dropped'], 'push', 'pushes')} dropped with them")}
           if args.chaos is not None else {}),
        "curve": args.out + (f" and {png}" if png else ""),
        **_util.metrics_summary(args, f"a3c: {ENV_ID}"),
        "CPU time": f"{final['cpu'] + time.process_time():.1f} s (this process and the ranks, user+sys)",
        "wall time": _util.wall_time(start),
    })


if __name__ == "__main__":
    main()
