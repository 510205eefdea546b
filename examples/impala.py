"""IMPALA on gymnasium's CartPole-v1: actors ship trajectories, learners train with V-trace.

Run it locally (1 learner + 2 actors; the launcher starts the processes):
    python examples/impala.py
The learner on a GPU (the actors stay on the CPU; ``auto``: a GPU when there is one):
    python examples/impala.py --device cuda
Two learners in a CollectiveGroup, the model wrapped in DistributedDataParallel:
    python examples/impala.py --learners 2
With an actor SIGKILLed and restarted every 3 s (an elastic world, one learner; see
``worker_elastic``):
    python examples/impala.py --chaos 3
Under torchrun, unchanged (the world size is torchrun's: learners first, the rest act):
    torchrun --standalone --nproc-per-node 3 examples/impala.py

    actor (ranks L..W-1)                                  learner l (ranks 0..L-1)
    --------------------                                  ------------------------
    model_server.pull(policy)            ◄── version v ── rank 0 pushes after every update
    unroll T steps in E envs with policy v; keep the
    behaviour log-probs and v
    registered_async("impala/trajectories/<l>", traj) ──► async service: a bounded queue; when
        (one in flight: the previous reply first;          it is full the reply is parked
         the reply says whether to keep going)              (back-pressure; no RPC thread held)
                                                          take B trajectories, V-trace targets,
                                                          Adam step (DDP all-reduce when L = 2),
                                                          lag = learner version - v
    registered_async("impala/episodes", returns) ───────► rank 0: EpisodeLog (metric, CSV, stop)

Actor i sends to learner i mod L, so each learner consumes its own share. The metric is the
mean return of the last 100 training episodes finished by the actors (all of them; the
actors sample from the stochastic behaviour policy). Training stops once it reaches
``--target`` (0: never) or when ``--time-budget`` runs out.

Seeds fix the initial weights, the environments and the actors' sampling; the order in
which trajectories reach the learner depends on timing, so two runs are close but not
bit-identical.
"""

from __future__ import annotations

import argparse
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import _util
import machinlike
from _metrics import RunMetrics, logdir_of
from _episodes import EpisodeLog, collect_columns, cpu_seconds, format_mean
from _impala_core import Inbox, vtrace
from machinlike.metrics import flatten_stats
from machinlike.server import PushPullModelServerImpl

GROUP = "impala"
SERVER = "impala_model"
ENV = "CartPole-v1"


class ActorCritic(nn.Module):
    """Separate policy and value MLPs (tanh); ``forward`` gives (logits, value)."""

    def __init__(self, obs_dim: int = 4, actions: int = 2, hidden: int = 64) -> None:
        super().__init__()
        self.policy = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                    nn.Linear(hidden, actions))
        self.value = nn.Sequential(nn.Linear(obs_dim, hidden), nn.Tanh(), nn.Linear(hidden, hidden), nn.Tanh(),
                                   nn.Linear(hidden, 1))

    def forward(self, obs: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.policy(obs), self.value(obs).squeeze(-1)


# ---------------------------------------------------------------------------- actors
class Sampler:
    """``E`` CartPole environments stepped together with one batched policy forward per step."""

    def __init__(self, envs: int, seed: int, generator: torch.Generator) -> None:
        self.envs = [gym.make(ENV) for _ in range(envs)]
        self.obs = np.stack([env.reset(seed=seed + i)[0] for i, env in enumerate(self.envs)]).astype(np.float32)
        self.episode_returns = np.zeros(envs)
        self.episode_lengths = np.zeros(envs, np.int64)
        self.finished_lengths: List[int] = []  # of the episodes in the last unroll's returns
        self.generator = generator

    def unroll(self, model: ActorCritic, length: int) -> Tuple[Dict[str, Any], List[float]]:
        """``length`` steps in every environment; returns the trajectory and finished episodes' returns.

        ``done[t, e]`` means the episode ended at step t (terminated or truncated), so
        ``obs[t + 1, e]`` starts the next one. A truncated episode (the 500-step time limit)
        did not fail: its last observation travels in ``trunc_obs`` so that the learner can
        bootstrap from it.
        """
        count = len(self.envs)
        obs = np.empty((length + 1, count, self.obs.shape[1]), np.float32)
        actions = np.empty((length, count), np.int64)
        rewards = np.empty((length, count), np.float32)
        done = np.zeros((length, count), np.float32)
        logp = np.empty((length, count), np.float32)
        trunc_index: List[Tuple[int, int]] = []
        trunc_obs: List[np.ndarray] = []
        finished: List[float] = []
        self.finished_lengths = []
        for t in range(length):
            obs[t] = self.obs
            with torch.no_grad():
                logits, _ = model(torch.from_numpy(self.obs))
                log_probs = F.log_softmax(logits, dim=-1)
                chosen = torch.multinomial(log_probs.exp(), 1, generator=self.generator)
                logp[t] = log_probs.gather(1, chosen).squeeze(1).numpy()
            actions[t] = chosen.squeeze(1).numpy()
            for e, env in enumerate(self.envs):
                nxt, reward, terminated, truncated, _ = env.step(int(actions[t, e]))
                rewards[t, e] = reward
                self.episode_returns[e] += reward
                self.episode_lengths[e] += 1
                if terminated or truncated:
                    done[t, e] = 1.0
                    if truncated and not terminated:
                        trunc_index.append((t, e))
                        trunc_obs.append(nxt)
                    finished.append(float(self.episode_returns[e]))
                    self.finished_lengths.append(int(self.episode_lengths[e]))
                    self.episode_returns[e] = 0.0
                    self.episode_lengths[e] = 0
                    nxt, _ = env.reset()
                self.obs[e] = nxt
        obs[length] = self.obs
        trajectory = {
            "obs": torch.from_numpy(obs), "actions": torch.from_numpy(actions), "rewards": torch.from_numpy(rewards),
            "done": torch.from_numpy(done), "logp": torch.from_numpy(logp),
            "trunc_index": torch.tensor(trunc_index, dtype=torch.int64).reshape(-1, 2),
            "trunc_obs": torch.from_numpy(np.array(trunc_obs, np.float32).reshape(-1, obs.shape[2])),
            "version": model.pp_version,
        }
        return trajectory, finished


def act(world: machinlike.World, group: machinlike.RpcGroup, args: argparse.Namespace, index: int,
        learners: Sequence[str]) -> Dict[str, Any]:
    """An actor: pull the newest policy, unroll, ship the trajectory; until a reply says stop."""
    server = group.get_paired(SERVER).to_here()
    model = ActorCritic()
    # A restarted actor (--chaos) explores afresh instead of replaying its predecessor's episodes.
    index += 100_003 * (world.incarnation - 1)
    generator = torch.Generator().manual_seed(args.seed * 7919 + index)
    sampler = Sampler(args.envs_per_actor, args.seed * 10_000 + index * args.envs_per_actor, generator)
    learner = learners[index % len(learners)] if len(learners) > 1 else learners[0]
    sending: Optional[machinlike.distributed.RpcFuture] = None
    reporting: Optional[machinlike.distributed.RpcFuture] = None
    unrolls, steps = 0, 0
    while True:
        server.pull(model)  # transfers nothing when the actor already has the newest version
        trajectory, finished = sampler.unroll(model, args.unroll)
        unrolls += 1
        steps += args.unroll * args.envs_per_actor
        # One send and one report in flight at a time: the learner's parked replies are
        # what paces the actors. Only the learner's reply stops an actor: the learner may
        # still be waiting for a batch when the episode log decides to stop, and it decides
        # (with the other learner) after that batch.
        if reporting is not None:
            reporting.wait()
        if sending is not None and not sending.wait():
            break
        sending = group.registered_async(f"{GROUP}/trajectories/{learner}", args=(trajectory,),
                                         timeout=args.rpc_timeout)
        reporting = group.registered_async(f"{GROUP}/episodes",
                                           args=(world.name, finished, steps, trajectory["version"],
                                                 sampler.finished_lengths),
                                           timeout=args.rpc_timeout)
        steps = 0
    if reporting is not None:
        reporting.wait()
    return {"role": "actor", "name": world.name, "unrolls": unrolls}


# --------------------------------------------------------------------------- learners
def vtrace_loss(net: nn.Module, model: ActorCritic, batch: List[Dict[str, Any]],
                args: argparse.Namespace) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The IMPALA loss of a batch of trajectories: policy gradient with V-trace advantages,
    value regression onto v_s, and an entropy bonus.

    ``net`` runs the differentiated forward (the DDP wrapper when there is one); ``model``
    the no-grad bootstrap of truncated episodes.
    """
    obs = torch.cat([t["obs"] for t in batch], dim=1)            # [T+1, N, obs]
    actions = torch.cat([t["actions"] for t in batch], dim=1)    # [T, N]
    rewards = torch.cat([t["rewards"] for t in batch], dim=1)
    done = torch.cat([t["done"] for t in batch], dim=1)
    behaviour_logp = torch.cat([t["logp"] for t in batch], dim=1)
    length, width = actions.shape
    logits, values = net(obs.reshape(-1, obs.shape[-1]))
    logits = logits.reshape(length + 1, width, -1)[:-1]
    values = values.reshape(length + 1, width)
    log_probs = F.log_softmax(logits, dim=-1)
    logp = log_probs.gather(2, actions.unsqueeze(2)).squeeze(2)
    with torch.no_grad():
        # A truncated episode continues past the time limit: fold gamma * V(last obs) into
        # its last reward, and the zero discount cuts the trace as for a real ending.
        rewards = rewards.clone()
        offset = 0
        for t in batch:
            if len(t["trunc_index"]):
                _, tail = model(t["trunc_obs"])
                rewards[t["trunc_index"][:, 0], t["trunc_index"][:, 1] + offset] += args.gamma * tail
            offset += t["actions"].shape[1]
        log_rhos = logp.detach() - behaviour_logp
        vs, advantages = vtrace(values[:-1].detach(), values[-1].detach(), rewards, args.gamma * (1.0 - done),
                                log_rhos, args.rho_bar, args.c_bar)
    policy_loss = -(logp * advantages).mean()
    value_loss = 0.5 * (vs - values[:-1]).pow(2).mean()
    entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
    loss = policy_loss + args.baseline_cost * value_loss - args.entropy_cost * entropy
    return loss, {"policy_loss": policy_loss.item(), "value_loss": value_loss.item(), "entropy": entropy.item(),
                  "rho_mean": log_rhos.exp().mean().item()}


def learn(world: machinlike.World, group: machinlike.RpcGroup, args: argparse.Namespace,
          collective: Optional[machinlike.CollectiveGroup], actors: int,
          ready: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """A learner; rank 0 also hosts the model server and the episode log and decides when to stop.

    ``ready``: called once the services, the episode log and version 1 exist; None: a
    barrier of the group (the actors wait in theirs).
    """
    lead = world.rank == 0
    inbox = Inbox(args.queue_size)
    group.register(f"{GROUP}/trajectories/{world.name}", inbox.put)
    torch.manual_seed(args.seed)  # identical initial weights on every learner
    model = ActorCritic().to(args.device)  # the actors' copies stay on the CPU (pull casts)
    net: nn.Module = model
    if collective is not None:
        net = DistributedDataParallel(model, process_group=collective.group)
    optimizer = torch.optim.Adam(net.parameters(), lr=args.lr)
    state = {"updates": 0, "version_lag": ""}
    log = None
    metrics = RunMetrics(logdir_of(args), world, args.metrics_every, args.window, enabled=lead and not args.no_metrics)
    if lead:
        curve = _util.Curve(args.out, collect_columns(["updates", "version_lag"]))
        log = EpisodeLog(curve, args.window, args.target, args.time_budget, extra=lambda: dict(state),
                         listener=metrics.episodes)
        impl = PushPullModelServerImpl(SERVER, group)
        group.register(f"{GROUP}/episodes", log.report)
        server = group.get_paired(SERVER).to_here()
        server.push(model)  # version 1: what the actors start from
        learners = collective.size() if collective else 1
        print(f"[learner 0] {learners + actors} processes: {learners} learner(s), {actors} actor(s) x "
              f"{args.envs_per_actor} envs; learner on {args.device}; metric: mean return of the last {args.window} training episodes "
              f"of all actors", flush=True)
        _util.announce_watch(world, logdir_of(args), args.no_metrics, "learner 0")
    (ready or group.barrier)()  # services, the episode log and version 1 exist from here on

    progress = _util.Progress(args.print_every)
    window_updates, window_start = 0, time.monotonic()
    lags: List[int] = []
    stats: Dict[str, float] = {}
    figures: Dict[str, float] = {}
    while True:
        stop = log.should_stop() if lead else False
        if collective is not None:
            # Both learners must leave after the same update: DDP's all-reduce pairs them.
            flag = torch.tensor([float(stop)])
            collective.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
            stop = bool(flag.item())
        if stop:
            break
        batch = [_util.to_device(t, args.device) for t in inbox.take(args.batch_size, timeout=args.rpc_timeout)]
        version = state["updates"] + 1  # the version the learner's weights have (rank 0 published it)
        batch_lags = [version - t["version"] for t in batch]
        loss, stats = vtrace_loss(net, model, batch, args)
        optimizer.zero_grad()
        loss.backward()
        grad_norm = float(nn.utils.clip_grad_norm_(net.parameters(), args.max_grad_norm))
        optimizer.step()
        state["updates"] += 1
        state["version_lag"] = f"{sum(batch_lags) / len(batch_lags):.2f}"
        window_updates += 1
        if lead:
            server.push(model)
            lags += batch_lags
            figures = {"loss_policy": stats["policy_loss"], "loss_value": stats["value_loss"],
                       "entropy": stats["entropy"], "grad_norm": grad_norm, "rho_mean": stats["rho_mean"],
                       "policy_lag": sum(batch_lags) / len(batch_lags), "queue": len(inbox)}
            if metrics.due():
                metrics.log(log.snapshot()["env_steps"], state["updates"], learner=figures,
                            servers=flatten_stats(impl.stats(), "server/model"))
            if progress.due():
                now = time.monotonic()
                snap = log.snapshot()
                print(f"[learner 0] {progress.elapsed():6.1f} s  env steps {snap['env_steps']:>8,}  "
                      f"episodes {snap['episodes']:>5}  mean return (last {args.window}) "
                      f"{format_mean(snap['mean_return']):>6}  updates {state['updates']:>6} "
                      f"({window_updates / max(now - window_start, 1e-9):5.1f}/s)  version lag mean "
                      f"{sum(lags) / max(len(lags), 1):.2f} max {max(lags, default=0)}  queue {len(inbox)}/"
                      f"{args.queue_size}  entropy {stats['entropy']:.3f}", flush=True)
                window_updates, window_start, lags = 0, now, []
    inbox.close()  # parked and later sends answer "stop"
    if lead and state["updates"]:  # the last point: a short run's curves end where training did
        metrics.log(log.snapshot()["env_steps"], state["updates"], learner=figures,
                    servers=flatten_stats(impl.stats(), "server/model"))
    metrics.close()
    result: Dict[str, Any] = {"role": "learner", "name": world.name, "updates": state["updates"]}
    if lead:
        snap = log.snapshot()
        result.update(snap, reason=log.reason, impl=impl, curve=curve)
    return result


# ------------------------------------------------------------------------------ roles
def worker_elastic(world: machinlike.World, args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """``--chaos``: an elastic world where actors die (SIGKILL) and come back.

    One learner ("0", essential; no DDP: gloo groups need fixed members). It opens a
    :class:`_util.ReadyGate` once its services and version 1 exist; an actor, first or
    restarted, waits at the gate and then acts as in a static run. A trajectory counts once:
    it is in the learner's inbox or it is not (an actor killed mid-send loses only its own
    unsent work), and episode reports carry the steps since the actor's last report, so a
    restarted actor adds to the totals without repeating its predecessor's.
    """
    from machinlike.exception import PeerLostError

    torch.set_num_threads(1)
    start = time.monotonic()
    learner = "0"
    group = world.create_rpc_group(GROUP)  # open: a restarted actor rejoins at once
    gate = _util.ReadyGate(world, group, f"{GROUP}/ready")
    if world.name == learner:
        members = _util.member_printer(world, "learner 0")
        result = learn(world, group, args, None, args.num_workers, ready=gate.open)
        # The actors stop at their next send's reply (False); leaving before they did would
        # fail their last calls. Bounded: a restart may still be starting up.
        try:
            world.wait_for_members([str(r) for r in range(1, args.num_workers + 1)], timeout=30.0, gone=True)
        except TimeoutError as err:
            print(f"[learner 0] not every actor stopped within 30 s: {err}", flush=True)
        gate.close()
        result.pop("impl").close()
        result.pop("curve")
        result.update(train_time=time.monotonic() - start, png=None, cpu=cpu_seconds(),
                      losses=members.losses, rejoins=members.rejoins)
        return result
    if world.membership.gone(learner):
        return None  # restarted after the learner finished
    try:
        world.wait_for_members([learner], timeout=60.0)
        if gate.wait(learner, timeout=60.0):  # False: the learner finished before this actor got going
            act(world, group, args, world.rank - 1, [learner])
    except PeerLostError as err:  # the learner finished (left) while this actor was calling it
        if err.member != learner:
            raise
    except KeyError:  # the learner withdrew its services: it is finishing
        pass
    return {"role": "actor", "name": world.name, "cpu": cpu_seconds()}


def worker(world: machinlike.World, args: argparse.Namespace) -> Dict[str, Any]:
    if world.elastic:
        return worker_elastic(world, args)
    torch.set_num_threads(1)  # 2 cores, several processes: one thread each
    learners = args.learners
    if world.world_size < 2 * learners:
        # Actor i feeds learner i mod L; a learner without actors would wait for ever while
        # the other waits for it in the all-reduce.
        raise ValueError(f"a world of {world.world_size} processes gives some of the --learners {learners} no actor; "
                         f"start at least {2 * learners} processes (one actor per learner) or use fewer learners")
    start = time.monotonic()
    group = world.create_rpc_group(GROUP, world.get_members())
    # Every process enters the creation of the learners' process group, members or not.
    collective = world.create_collective_group(list(range(learners))) if learners > 1 else None
    names = [str(rank) for rank in range(learners)]
    if world.rank < learners:
        result = learn(world, group, args, collective if learners > 1 else None, world.world_size - learners)
    else:
        group.barrier()  # the learners registered their services and pushed version 1
        result = act(world, group, args, world.rank - learners, names)
    group.barrier()  # nobody calls a service any more
    if world.rank == 0:
        result["train_time"] = time.monotonic() - start
        result.pop("impl").close()
        result.pop("curve")  # drawn by the launching process once the ranks are done (see _util.plot_csv)
    group.destroy()
    result["cpu"] = cpu_seconds()
    if collective is not None:
        collective.destroy()
    return result


def main() -> None:
    parser = _util.parser(__doc__.splitlines()[0], workers=2, budget=300, out="runs/impala.csv")
    parser.add_argument("--learners", type=int, default=1, choices=(1, 2),
                        help="learner processes; 2 form a CollectiveGroup and train with DDP (default 1)")
    parser.add_argument("--envs-per-actor", type=_util.positive_int, default=8,
                        help="environments per actor (default 8)")
    parser.add_argument("--unroll", type=_util.positive_int, default=20, help="trajectory length T, steps (default 20)")
    parser.add_argument("--batch-size", type=_util.positive_int, default=4,
                        help="actor messages (each E trajectories of T steps) per update (default 4)")
    parser.add_argument("--queue-size", type=_util.positive_int, default=8,
                        help="messages a learner queues (default 8)")
    parser.add_argument("--lr", type=_util.positive_float, default=1e-3, help="Adam learning rate (default 1e-3)")
    parser.add_argument("--gamma", type=_util.fraction, default=0.99, help="discount (default 0.99)")
    parser.add_argument("--entropy-cost", type=_util.non_negative_float, default=0.01,
                        help="weight of the entropy bonus subtracted from the loss (default 0.01)")
    parser.add_argument("--baseline-cost", type=_util.non_negative_float, default=0.5,
                        help="weight of the value (baseline) loss added to the policy loss (default 0.5)")
    parser.add_argument("--rho-bar", type=_util.positive_float, default=1.0,
                        help="V-trace importance clip rho-bar (default 1)")
    parser.add_argument("--c-bar", type=_util.positive_float, default=1.0, help="V-trace trace clip c-bar (default 1)")
    parser.add_argument("--max-grad-norm", type=_util.positive_float, default=10.0,
                        help="gradient clipping (default 10)")
    parser.add_argument("--window", type=_util.positive_int, default=100,
                        help="episodes in the mean return (default 100)")
    parser.add_argument("--target", type=_util.non_negative_float, default=195.0,
                        help="stop when the mean return reaches this; 0: use the whole budget (default 195)")
    parser.add_argument("--rpc-timeout", type=_util.positive_float, default=120.0,
                        help="seconds per RPC wait (default 120)")
    parser.add_argument("--print-every", type=_util.positive_float, default=5.0,
                        help="seconds between progress lines (default 5)")
    args = parser.parse_args()
    if args.num_workers < args.learners:
        parser.error(f"--learners {args.learners} needs at least {args.learners} actors (one per learner), "
                     f"--num-workers is {args.num_workers}")
    if args.queue_size < args.batch_size:
        parser.error(f"--queue-size {args.queue_size} must be at least --batch-size {args.batch_size}")
    if args.chaos is not None and args.learners != 1:
        parser.error("--chaos needs --learners 1: DDP's gloo group has fixed members")
    start = time.monotonic()
    results = [r for r in _util.run(worker, args.learners + args.num_workers, args, chaos_ok=True) if r]
    for result in results:
        if result.get("name") == "0":
            # The ranks are done: plot here (see _util.plot_csv).
            result["png"] = _util.plot_csv(args.out, "env_steps", ["return", "mean_return"],
                                           f"IMPALA on {ENV}: episode returns")
            # Launched here: every rank's time plus this parent's. Under torchrun: this rank's.
            # (With --chaos: the ranks that returned; a killed actor's time is not reported.)
            cpu = sum(r["cpu"] for r in results) + (cpu_seconds() if len(results) > 1 or args.chaos else 0.0)
            _util.summary("IMPALA on " + ENV, {
                "stopped": result["reason"],
                f"mean return, last {args.window} episodes (all actors)": format_mean(result["mean_return"]),
                "episodes": result["episodes"],
                "environment steps": f"{result['env_steps']:,}",
                "learner updates": result["updates"],
                "training time (incl. set-up)": f"{result['train_time']:.1f} s",
                "wall time": _util.wall_time(start),
                "CPU time, all processes" + ("" if len(results) > 1 else " (this rank)"): f"{cpu:.1f} s",
                **({"chaos": f"every {args.chaos:g} s: {result['losses']} actors lost, {result['rejoins']} rejoined"}
                   if args.chaos is not None else {}),
                "learning curve": args.out + (f", {result['png']}" if result["png"] else ""),
                **_util.metrics_summary(args, f"IMPALA on {ENV}"),
            })


if __name__ == "__main__":
    main()
