"""Ape-X DQN on gymnasium's CartPole-v1: a prioritised replay buffer sharded over the actors.

Run it locally (1 learner + 3 actors; the launcher starts the processes):
    python examples/dqn_apex.py
The learner on a GPU (the actors and their replay shards stay on the CPU):
    python examples/dqn_apex.py --device cuda
With an actor SIGKILLed and restarted every 10 s (an elastic world; see ``worker_elastic``):
    python examples/dqn_apex.py --chaos 10
Under torchrun, unchanged (rank 0 learns, the others act):
    torchrun --standalone --nproc-per-node 4 examples/dqn_apex.py

    actor i (ranks 1..N), epsilon_i                       learner (rank 0)
    -------------------------------                       ----------------
    model_server.pull(q)                 ◄── version v ── push every --publish-every updates
    act epsilon-greedily; n-step transitions; their
    initial priorities from its own q (Ape-X)
    its replay shard, behind three services:
      apex/replay/<i>/size        ◄────────────────────── (warm-up) sizes and total priorities
      apex/replay/<i>/sample(k)   ◄────────────────────── every update: a batch split over the shards
                                                          by their total priority (multinomial), each
                                                          shard sampling its k in proportion to priority
      apex/replay/<i>/update      ◄────────────────────── new priorities |n-step double-DQN TD error|
    apex/pace(u): wait until the learner made u updates ► async service (parked replies): actors take at
                                                          most --steps-per-update env steps per update
    apex/episodes(returns)  ────────────────────────────► rank 0: EpisodeLog (metric, CSV, stop)

Actor i = 0..N-1 (rank i + 1) uses epsilon_i = eps ** (1 + i / (N - 1) * alpha) (Ape-X; eps =
0.4, alpha = 7: for N = 3, 0.4, 0.016 and 0.00066). The sampling probability of transition j is its
priority over the sum of all shards' priorities, as with one buffer; importance weights
(N * P(j)) ** -beta are normalised by the batch maximum.

The metric (the "final figure" and ``--target``) is the mean return of the last 100
*training* episodes of the low-epsilon actors: those with epsilon_i <= ``--eval-epsilon``
(default 0.02; with the default three actors, ranks 2 and 3, epsilon 0.016 and 0.00066), or
the lowest-epsilon actor when none qualifies. Their
transitions go into the replay buffer like everyone's; there is no separate greedy
evaluation. The mean over every actor's episodes is printed beside it. Training stops once
the metric reaches ``--target`` (0: never) or when ``--time-budget`` runs out.

Seeds fix the initial weights, the environments and every random choice; how the actors'
steps interleave with the learner's updates depends on timing, so two runs are close but
not bit-identical.
"""

from __future__ import annotations

import argparse
import collections
import copy
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import gymnasium as gym
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import rpc

import _util
import machinlike
from _metrics import RunMetrics, logdir_of
from machinlike.metrics import flatten_stats
from _episodes import EpisodeLog, collect_columns, cpu_seconds, format_mean
from machinlike.exception import PeerLostError
from machinlike.server import PushPullModelServerImpl

GROUP = "apex"
SERVER = "apex_model"
ENV = "CartPole-v1"


class QNet(nn.Module):
    def __init__(self, obs_dim: int = 4, actions: int = 2, hidden: int = 128) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Linear(obs_dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
                                    nn.Linear(hidden, actions))

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        return self.layers(obs)


def actor_epsilon(index: int, actors: int, eps: float, alpha: float) -> float:
    """Ape-X's exploration schedule: eps ** (1 + index / (actors - 1) * alpha); eps for one actor."""
    return eps if actors == 1 else eps ** (1 + index / (actors - 1) * alpha)


def td_errors(online: nn.Module, target: nn.Module,
              batch: Dict[str, torch.Tensor]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(Q(s, a), n-step double-DQN target): r + gamma^n * Q_target(s', argmax_a' Q_online(s', a'))."""
    q = online(batch["obs"]).gather(1, batch["action"].unsqueeze(1)).squeeze(1)
    with torch.no_grad():
        best = online(batch["next_obs"]).argmax(1, keepdim=True)
        bootstrap = target(batch["next_obs"]).gather(1, best).squeeze(1)
        goal = batch["ret"] + batch["discount"] * bootstrap
    return q, goal


# ---------------------------------------------------------------------- replay shard
class ReplayShard:
    """An actor's share of the prioritised replay buffer (a ring); RPC threads and the actor share it.

    Priorities are stored raised to ``alpha``. Each slot has a generation number, so a
    priority update for a transition that has since been overwritten is dropped, and so is
    one carrying another ``token`` (with ``--chaos``: the actor's incarnation, so that an
    update meant for a killed actor's shard never lands in its replacement's).
    """

    def __init__(self, capacity: int, obs_dim: int, alpha: float, seed: int, token: int = 1) -> None:
        self._token = token
        self._capacity = capacity
        self._alpha = alpha
        self._obs = np.zeros((capacity, obs_dim), np.float32)
        self._next_obs = np.zeros((capacity, obs_dim), np.float32)
        self._action = np.zeros(capacity, np.int64)
        self._ret = np.zeros(capacity, np.float32)
        self._discount = np.zeros(capacity, np.float32)
        self._priority = np.zeros(capacity, np.float64)
        self._generation = np.zeros(capacity, np.int64)
        self._written = 0  # transitions ever added; slot = written % capacity
        self._rng = np.random.default_rng(seed)
        self._lock = threading.Lock()

    def add(self, obs: np.ndarray, action: np.ndarray, ret: np.ndarray, next_obs: np.ndarray,
            discount: np.ndarray, priority: np.ndarray) -> None:
        with self._lock:
            for i in range(len(action)):
                slot = self._written % self._capacity
                self._obs[slot], self._next_obs[slot] = obs[i], next_obs[i]
                self._action[slot], self._ret[slot], self._discount[slot] = action[i], ret[i], discount[i]
                self._priority[slot] = priority[i] ** self._alpha
                self._generation[slot] = self._written
                self._written += 1

    def size(self) -> Tuple[int, float]:
        """Service: (transitions held, sum of their priorities ** alpha)."""
        with self._lock:
            held = min(self._written, self._capacity)
            return held, float(self._priority[:held].sum())

    def sample(self, count: int) -> Dict[str, Any]:
        """Service: ``count`` transitions drawn in proportion to priority ** alpha (stratified).

        Returns the transitions, their slots and generations (for ``update``), their
        ``priority`` (raised to alpha), and the shard's size, total and token at sampling time.
        """
        with self._lock:
            held = min(self._written, self._capacity)
            cumulative = np.cumsum(self._priority[:held])
            total = float(cumulative[-1]) if held else 0.0
            if count == 0 or total <= 0:
                slots = np.zeros(0, np.int64)
            else:
                points = (np.arange(count) + self._rng.random(count)) * (total / count)
                slots = np.minimum(np.searchsorted(cumulative, points, side="right"), held - 1)
            batch = {"slot": slots, "generation": self._generation[slots], "obs": self._obs[slots],
                     "action": self._action[slots], "ret": self._ret[slots], "next_obs": self._next_obs[slots],
                     "discount": self._discount[slots], "priority": self._priority[slots]}
        out = {key: torch.from_numpy(np.ascontiguousarray(value)) for key, value in batch.items()}
        out.update(size=held, total=total, token=self._token)
        return out

    def update(self, slots: torch.Tensor, generations: torch.Tensor, priorities: torch.Tensor,
               token: Optional[int] = None) -> None:
        """Service: set new priorities; slots overwritten since they were sampled are skipped,
        and everything when ``token`` is not this shard's (None: not checked)."""
        if token is not None and token != self._token:
            return
        slots, generations = slots.numpy(), generations.numpy()
        values = priorities.double().numpy() ** self._alpha
        with self._lock:
            current = self._generation[slots] == generations
            self._priority[slots[current]] = values[current]


class NStep:
    """Turns one environment's steps into n-step transitions (s, a, sum of discounted r, s', gamma^k or 0)."""

    def __init__(self, n: int, gamma: float) -> None:
        self._n = n
        self._gamma = gamma
        self._window: Deque[Tuple[np.ndarray, int, float]] = collections.deque()

    def step(self, obs: np.ndarray, action: int, reward: float, next_obs: np.ndarray, terminated: bool,
             ended: bool) -> List[Tuple[np.ndarray, int, float, np.ndarray, float]]:
        self._window.append((obs, action, reward))
        out = []
        # A full window emits its oldest step; an ended episode flushes the rest. After a
        # termination nothing follows (discount 0); after a truncation the value of the last
        # observation is still owed (discount gamma^k).
        while self._window and (len(self._window) == self._n or ended):
            ret = 0.0
            for k, (_, _, r) in enumerate(self._window):
                ret += self._gamma ** k * r
            first_obs, first_action, _ = self._window.popleft()
            discount = 0.0 if terminated else self._gamma ** (len(self._window) + 1)
            out.append((first_obs, first_action, ret, next_obs, discount))
            if not ended:
                break
        return out


# ---------------------------------------------------------------------------- pacing
class Pacer:
    """Lets actors wait, without holding an RPC thread, until the learner made enough updates.

    ``wait_for(u)`` is an asynchronous service: its reply (the learner's update count, or
    -1 once training stopped) is parked until the learner reaches ``u`` updates.
    """

    def __init__(self) -> None:
        self._updates = 0
        self._parked: List[Tuple[int, torch.futures.Future]] = []
        self._cond = threading.Condition()
        self._stopped = False
        self._arrived: set = set()

    @rpc.functions.async_execution
    def wait_for(self, actor: str, updates: int) -> torch.futures.Future:
        reply: torch.futures.Future = torch.futures.Future()
        with self._cond:
            self._arrived.add(actor)
            self._cond.notify_all()
            if not self._stopped and self._updates < updates:
                self._parked.append((updates, reply))
                return reply
            answer = -1 if self._stopped else self._updates
        reply.set_result(answer)
        return reply

    def wait_actors(self, actors: int, timeout: float) -> None:
        """Block until ``actors`` actors asked to wait (they filled their warm-up share).

        Raises:
            TimeoutError: some did not within ``timeout`` seconds.
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while len(self._arrived) < actors:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"only actors {sorted(self._arrived)} of {actors} finished their warm-up "
                                       f"within {timeout:g} s")
                self._cond.wait(left)

    def advance(self, updates: int) -> None:
        with self._cond:
            self._updates = updates
            ready = [reply for needed, reply in self._parked if needed <= updates]
            self._parked = [(needed, reply) for needed, reply in self._parked if needed > updates]
        for reply in ready:
            reply.set_result(updates)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            released = [reply for _, reply in self._parked]
            self._parked = []
        for reply in released:
            reply.set_result(-1)


# ---------------------------------------------------------------------------- actors
def act(world: machinlike.World, group: machinlike.RpcGroup, args: argparse.Namespace, index: int,
        actors: int, epsilon: float, ready: Optional[Callable[[], bool]] = None) -> Dict[str, Any]:
    """An actor: act epsilon-greedily, fill its shard, keep pace with the learner, until told to stop.

    ``ready``: waits for the learner's services and version 1, False if the learner finished
    first; None: a barrier of the group.
    """
    # A restarted actor (--chaos) explores afresh instead of replaying its predecessor's episodes.
    seed = index + 100_003 * (world.incarnation - 1)
    shard = ReplayShard(args.shard_capacity, 4, args.alpha, args.seed * 7919 + seed, token=world.incarnation)
    name = world.name
    group.register(f"{GROUP}/replay/{name}/size", shard.size)
    group.register(f"{GROUP}/replay/{name}/sample", shard.sample)
    group.register(f"{GROUP}/replay/{name}/update", shard.update)
    if ready is None:
        group.barrier()  # shards and the learner's services are registered; version 1 is published
    elif not ready():
        return {"role": "actor", "name": name, "steps": 0, "epsilon": epsilon}
    server = group.get_paired(SERVER).to_here()
    model = QNet()
    server.pull(model)
    env = gym.make(ENV)
    obs, _ = env.reset(seed=args.seed * 10_000 + seed)
    rng = np.random.default_rng(args.seed * 104_729 + seed)
    nstep = NStep(args.n_step, args.gamma)
    pending: List[Tuple[np.ndarray, int, float, np.ndarray, float]] = []
    episode_return, episode_length, finished, lengths = 0.0, 0, [], []
    steps, unreported, since_pull = 0, 0, 0
    # This actor's share of the steps allowed so far: the warm-up, then steps_per_update per
    # update since ``base``, the learner's update count when it started (a restarted actor
    # asks for it after its warm-up, with needed = 0, rather than sprint to catch up).
    warm = args.warmup // actors
    allowed, base = warm, 0 if world.incarnation == 1 else None
    reporting = None
    while True:
        if steps >= allowed:
            needed = 0 if base is None else base + (steps - warm) * actors // args.steps_per_update + 1
            updates = group.registered_sync(f"{GROUP}/pace", args=(name, needed), timeout=args.rpc_timeout)
            if updates < 0:
                break  # training is over
            base = updates if base is None else base
            allowed = warm + (updates - base) * args.steps_per_update // actors
            continue
        if since_pull >= args.pull_every:
            server.pull(model)
            since_pull = 0
        if rng.random() < epsilon:
            action = int(rng.integers(2))
        else:
            with torch.no_grad():
                action = int(model(torch.from_numpy(obs).unsqueeze(0)).argmax(1).item())
        next_obs, reward, terminated, truncated, _ = env.step(action)
        steps += 1
        unreported += 1
        since_pull += 1
        episode_return += reward
        episode_length += 1
        ended = terminated or truncated
        pending += nstep.step(obs, action, float(reward), next_obs, terminated, ended)
        obs = next_obs
        if ended:
            finished.append(episode_return)
            lengths.append(episode_length)
            episode_return, episode_length = 0.0, 0
            obs, _ = env.reset()
        if len(pending) >= args.add_batch or (ended and pending):
            add_with_priorities(shard, model, pending)
            pending = []
        if finished and (reporting is None or reporting.done()):
            if reporting is not None and not reporting.wait():
                break
            reporting = group.registered_async(f"{GROUP}/episodes",
                                               args=(name, finished, unreported, model.pp_version, lengths),
                                               timeout=args.rpc_timeout)
            finished, lengths, unreported = [], [], 0
    if reporting is not None:
        reporting.wait()
    return {"role": "actor", "name": name, "steps": steps, "epsilon": epsilon}


def add_with_priorities(shard: ReplayShard, model: QNet,
                        transitions: Sequence[Tuple[np.ndarray, int, float, np.ndarray, float]]) -> None:
    """Ape-X: the actor computes initial priorities with its own copy of the network."""
    obs = np.stack([t[0] for t in transitions]).astype(np.float32)
    action = np.array([t[1] for t in transitions], np.int64)
    ret = np.array([t[2] for t in transitions], np.float32)
    next_obs = np.stack([t[3] for t in transitions]).astype(np.float32)
    discount = np.array([t[4] for t in transitions], np.float32)
    batch = {"obs": torch.from_numpy(obs), "action": torch.from_numpy(action), "ret": torch.from_numpy(ret),
             "next_obs": torch.from_numpy(next_obs), "discount": torch.from_numpy(discount)}
    with torch.no_grad():
        q, goal = td_errors(model, model, batch)
    shard.add(obs, action, ret, next_obs, discount, (goal - q).abs().numpy() + 1e-3)


# --------------------------------------------------------------------------- learner
class Sampler:
    """The learner's view of the sharded buffer: draws split over the shards by total priority.

    One request fetches ``chunks`` minibatches at once (one sample call per shard), and the
    new priorities of a whole fetch go back in one update call per shard: RPC round trips,
    not arithmetic, are what an update costs on a busy machine.

    ``elastic`` (``--chaos``): a shard whose actor is gone (a call fails with
    ``PeerLostError``, or its services are not registered yet) counts as empty for that
    fetch, and the failure in :attr:`missed`; every fetch asks every shard again (a sample
    of 0 reports its total), so a restarted actor's shard is drawn from once it holds data.
    """

    def __init__(self, group: machinlike.RpcGroup, shards: Sequence[str], batch_size: int, chunks: int,
                 beta: float, seed: int, timeout: float, elastic: bool = False) -> None:
        self._group = group
        self._shards = list(shards)
        self._batch_size = batch_size
        self._chunks = chunks
        self._beta = beta
        self._rng = np.random.default_rng(seed)
        self._timeout = timeout
        self._totals = np.zeros(len(shards))
        self._updating: List[Any] = []
        self._absent: Tuple[type, ...] = (PeerLostError, KeyError) if elastic else ()
        self.missed = 0  # shard calls that failed with a dead or not yet registered actor

    def _call(self, shard: str, service: str, args: Tuple[Any, ...] = ()) -> Any:
        try:
            return self._group.registered_async(f"{GROUP}/replay/{shard}/{service}", args=args,
                                                timeout=self._timeout)
        except self._absent:
            self.missed += 1
            return None

    def _wait(self, future: Any) -> Any:
        if future is None:
            return None
        try:
            return future.wait()
        except self._absent:
            self.missed += 1
            return None

    def sizes(self) -> Tuple[int, float]:
        sizes = [self._wait(f) or (0, 0.0) for f in [self._call(s, "size") for s in self._shards]]
        self._totals = np.array([total for _, total in sizes])
        return sum(size for size, _ in sizes), float(self._totals.sum())

    def request(self) -> Tuple[np.ndarray, List[Any]]:
        """Start fetching a batch (the learner trains on the previous one meanwhile)."""
        total = self._totals.sum()
        # No shard holds anything (only with --chaos, every actor lost at once): ask them all for nothing.
        shares = self._totals / total if total > 0 else np.zeros(len(self._shards))
        counts = self._rng.multinomial(self._batch_size * self._chunks, shares) if total > 0 else shares.astype(int)
        return shares, [self._call(s, "sample", (int(c),)) for s, c in zip(self._shards, counts)]

    def collect(self, request: Tuple[np.ndarray, List[Any]]) -> Tuple[Dict[str, torch.Tensor], List[torch.Tensor]]:
        """The fetched transitions and their split into minibatches (index tensors)."""
        shares, futures = request
        got = [(k, self._wait(f)) for k, f in enumerate(futures)]
        self._totals = np.array([p["total"] if p is not None else 0.0 for _, p in got])
        got = [(k, p) for k, p in got if p is not None]
        if not got:  # every shard gone at once (only with --chaos): an empty fetch
            keys = ("obs", "action", "ret", "next_obs", "discount", "slot", "generation", "is_weight", "shard", "token")
            return {key: torch.zeros(0, dtype=torch.int64) for key in keys}, []
        held = sum(p["size"] for _, p in got)
        # P(j) = P(shard k) * P(j | shard k): the multinomial split times the shard's own draw.
        probs = torch.cat([torch.as_tensor(shares[k]) * p["priority"] / max(p["total"], 1e-12) for k, p in got])
        weights = (held * probs).pow(-self._beta)
        batch = {key: torch.cat([p[key] for _, p in got]) for key in ("obs", "action", "ret", "next_obs", "discount",
                                                                      "slot", "generation")}
        batch["is_weight"] = weights.float()  # normalised per minibatch by the learner
        batch["shard"] = torch.cat([torch.full((len(p["slot"]),), k, dtype=torch.int64) for k, p in got])
        batch["token"] = torch.cat([torch.full((len(p["slot"]),), p["token"], dtype=torch.int64) for _, p in got])
        order = torch.from_numpy(self._rng.permutation(len(batch["slot"])))
        # Shards that answered may all hold nothing yet (only with --chaos: their actors
        # restarted), and an empty tensor still splits into one empty minibatch.
        return batch, [rows for rows in order.split(self._batch_size) if len(rows)]

    def update(self, batch: Dict[str, torch.Tensor], priorities: torch.Tensor) -> None:
        """Send new priorities to each shard (one update per shard in flight)."""
        self.drain()
        for k, shard in enumerate(self._shards):
            mine = batch["shard"] == k
            if mine.any():
                token = int(batch["token"][mine][0])  # the shard's incarnation when it was sampled
                self._updating.append(self._call(
                    shard, "update", (batch["slot"][mine], batch["generation"][mine], priorities[mine], token)))

    def drain(self, request: Optional[Tuple[np.ndarray, List[Any]]] = None) -> None:
        """Wait for the priority updates in flight, and for ``request``'s samples (dropped)."""
        for future in self._updating + (request[1] if request is not None else []):
            self._wait(future)
        self._updating = []


def learn(world: machinlike.World, group: machinlike.RpcGroup, args: argparse.Namespace,
          epsilons: Sequence[float], ready: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """The learner; it also hosts the model server, the pacer and the episode log.

    ``ready``: called once every service and version 1 exist; None: a barrier of the group
    (the actors wait in theirs), and shard calls that fail end the run.
    """
    actors = [str(rank) for rank in range(1, len(epsilons) + 1)]
    counted = [a for a, e in zip(actors, epsilons) if e <= args.eval_epsilon]
    why = f"epsilon <= {args.eval_epsilon:g}"
    if not counted:
        counted, why = [actors[int(np.argmin(epsilons))]], f"the lowest epsilon; none is <= {args.eval_epsilon:g}"
    torch.manual_seed(args.seed)
    online = QNet().to(args.device)  # the actors' copies stay on the CPU (pull casts)
    target = copy.deepcopy(online)
    optimizer = torch.optim.Adam(online.parameters(), lr=args.lr)
    state: Dict[str, Any] = {"updates": 0, "learner_version": 1}
    curve = _util.Curve(args.out, collect_columns(["updates", "learner_version"]))
    metrics = RunMetrics(logdir_of(args), world, args.metrics_every, args.window, enabled=not args.no_metrics)
    log = EpisodeLog(curve, args.window, args.target, args.time_budget, counted=counted, extra=lambda: dict(state),
                     listener=metrics.episodes)
    pacer = Pacer()
    impl = PushPullModelServerImpl(SERVER, group)
    group.register(f"{GROUP}/episodes", log.report)
    group.register(f"{GROUP}/pace", pacer.wait_for)
    server = group.get_paired(SERVER).to_here()
    server.push(online)  # version 1: what the actors start from
    described = ", ".join(f"{a}: {e:.3g}" for a, e in zip(actors, epsilons))
    print(f"[learner] on {args.device}; {len(actors)} actors, epsilon {described}; metric: mean return of the last {args.window} "
          f"training episodes of actor(s) {', '.join(counted)} ({why})", flush=True)
    _util.announce_watch(world, logdir_of(args), args.no_metrics, "learner")
    (ready or group.barrier)()  # every service exists from here on (and every shard, without --chaos)

    pacer.wait_actors(len(actors), args.rpc_timeout)
    sampler = Sampler(group, actors, args.batch_size, args.fetch_batches, args.beta, args.seed, args.rpc_timeout,
                      elastic=ready is not None)
    held, _ = sampler.sizes()
    print(f"[learner] warm-up done: {held} transitions in {len(actors)} shards", flush=True)
    progress = _util.Progress(args.print_every)
    window_updates, window_start, loss_sum, updates = 0, time.monotonic(), 0.0, 0
    request = sampler.request()

    def log_metrics(figures: Dict[str, float]) -> None:
        snap = log.snapshot()
        metrics.log(snap["env_steps"], updates, learner={
            **figures, "policy_lag": max((online.pp_version - v for v in snap["versions"].values()), default=0),
            "return_mean100_low_epsilon": snap["mean_return"], "shard_calls_missed": sampler.missed},
            servers=flatten_stats(impl.stats(), "server/model"))

    figures: Dict[str, float] = {}
    while not log.should_stop():
        fetched, minibatches = sampler.collect(request)
        request = sampler.request()  # fetched while these minibatches train
        priorities = torch.empty(len(fetched["slot"]))
        for rows in minibatches:
            batch = _util.to_device({key: value[rows] for key, value in fetched.items()}, args.device)
            q, goal = td_errors(online, target, batch)
            weight = batch["is_weight"] / batch["is_weight"].max()
            loss = (weight * F.smooth_l1_loss(q, goal, reduction="none")).mean()
            optimizer.zero_grad()
            loss.backward()
            grad_norm = float(nn.utils.clip_grad_norm_(online.parameters(), args.max_grad_norm))
            optimizer.step()
            priorities[rows] = ((goal - q).detach().abs() + 1e-3).cpu()
            state["updates"] += 1
            updates = state["updates"]
            if updates % args.target_every == 0:
                target.load_state_dict(online.state_dict())
            window_updates += 1
            loss_sum += loss.item()
        if minibatches:  # (none: every shard answered empty, only with --chaos)
            figures = {"loss_td": loss.item(), "grad_norm": grad_norm, "q_mean": q.mean().item()}
        if metrics.due():
            log_metrics(figures)
        sampler.update(fetched, priorities)
        pacer.advance(updates)
        if updates // args.publish_every > (updates - len(minibatches)) // args.publish_every:
            server.push(online)
            state["learner_version"] = online.pp_version
        if progress.due():
            now = time.monotonic()
            snap = log.snapshot()
            lags = [online.pp_version - v for v in snap["versions"].values()]
            print(f"[learner] {progress.elapsed():6.1f} s  env steps {snap['env_steps']:>8,}  episodes "
                  f"{snap['episodes_all']:>5}  mean return (last {args.window}): metric "
                  f"{format_mean(snap['mean_return']):>6}, all actors {format_mean(snap['mean_return_all']):>6}  "
                  f"updates {updates:>6} ({window_updates / max(now - window_start, 1e-9):5.1f}/s)  "
                  f"actor version lag max {max(lags, default=0)}  loss {loss_sum / max(window_updates, 1):.4f}", flush=True)
            window_updates, window_start, loss_sum = 0, now, 0.0
    pacer.close()  # parked and later pace requests answer "stop"
    if figures:  # the last point: a short run's curves end where training did
        log_metrics(figures)
    metrics.close()
    sampler.drain(request)
    snap = log.snapshot()
    snap.pop("versions")
    return dict(snap, role="learner", name=world.name, updates=state["updates"], reason=log.reason, impl=impl,
                curve=curve, counted=counted, missed=sampler.missed)


# ------------------------------------------------------------------------------ roles
def worker_elastic(world: machinlike.World, args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """``--chaos``: an elastic world where actors die (SIGKILL) and come back.

    The learner ("0", essential) opens a :class:`_util.ReadyGate` once its services and
    version 1 exist. An actor, first or restarted, registers its shard, waits at the gate
    and acts; a restarted one keeps its name (and epsilon), fills a fresh shard, and paces
    itself from the learner's update count when it came back. A killed actor's shard dies
    with it: the learner's sampler treats it as empty until the replacement's holds data.
    Episode reports carry the steps since the actor's last report, so nothing counts twice.
    Once told to stop, the actors keep their shards up until the learner is gone.
    """
    torch.set_num_threads(1)
    start = time.monotonic()
    learner, actors = "0", args.num_workers
    epsilons = [actor_epsilon(i, actors, args.epsilon, args.epsilon_alpha) for i in range(actors)]
    group = world.create_rpc_group(GROUP)  # open: a restarted actor rejoins at once
    gate = _util.ReadyGate(world, group, f"{GROUP}/ready")
    if world.name == learner:
        members = _util.member_printer(world, "learner")
        result = learn(world, group, args, epsilons, ready=gate.open)
        gate.close()
        result.pop("impl").close()
        result.pop("curve")
        result.update(train_time=time.monotonic() - start, png=None, cpu=cpu_seconds(), losses=members.losses,
                      rejoins=members.rejoins)
        return result
    if world.membership.gone(learner):
        return None  # restarted after the learner finished
    result: Dict[str, Any] = {"role": "actor", "name": world.name}
    try:
        world.wait_for_members([learner], timeout=60.0)
        result = act(world, group, args, world.rank - 1, actors, epsilons[world.rank - 1],
                     ready=lambda: gate.wait(learner, timeout=60.0))
        # The learner may still be fetching from this shard: keep it up until the learner is gone.
        world.wait_for_members([learner], timeout=args.rpc_timeout, gone=True)
    except PeerLostError as err:  # the learner finished (left) while this actor was calling it
        if err.member != learner:
            raise
    except KeyError:  # the learner withdrew its services: it is finishing
        pass
    result["cpu"] = cpu_seconds()
    return result


def worker(world: machinlike.World, args: argparse.Namespace) -> Dict[str, Any]:
    if world.elastic:
        return worker_elastic(world, args)
    torch.set_num_threads(1)  # 2 cores, several processes: one thread each
    if world.world_size < 2:
        raise ValueError("Ape-X needs a learner and at least one actor: start at least 2 processes")
    start = time.monotonic()
    actors = world.world_size - 1
    epsilons = [actor_epsilon(i, actors, args.epsilon, args.epsilon_alpha) for i in range(actors)]
    group = world.create_rpc_group(GROUP, world.get_members())
    if world.rank == 0:
        result = learn(world, group, args, epsilons)
    else:
        result = act(world, group, args, world.rank - 1, actors, epsilons[world.rank - 1])
    group.barrier()  # nobody calls a service any more
    if world.rank == 0:
        result["train_time"] = time.monotonic() - start
        result.pop("impl").close()
        result.pop("curve")  # drawn by the launching process once the ranks are done (see _util.plot_csv)
    group.destroy()
    result["cpu"] = cpu_seconds()
    return result


def main() -> None:
    parser = _util.parser(__doc__.splitlines()[0], workers=3, budget=420, out="runs/dqn_apex.csv")
    parser.add_argument("--batch-size", type=_util.positive_int, default=64, help="transitions per update (default 64)")
    parser.add_argument("--fetch-batches", type=_util.positive_int, default=4,
                        help="minibatches fetched from the shards per sample request (default 4)")
    parser.add_argument("--steps-per-update", type=_util.positive_int, default=4,
                        help="environment steps the actors may take per learner update, all together (default 4)")
    parser.add_argument("--warmup", type=_util.non_negative_int, default=2000,
                        help="transitions before the first update (default 2000)")
    parser.add_argument("--shard-capacity", type=_util.positive_int, default=20_000,
                        help="transitions per actor's shard (default 20000)")
    parser.add_argument("--lr", type=_util.positive_float, default=5e-4, help="Adam learning rate (default 5e-4)")
    parser.add_argument("--gamma", type=_util.fraction, default=0.99, help="discount (default 0.99)")
    parser.add_argument("--n-step", type=_util.positive_int, default=3, help="n of the n-step returns (default 3)")
    parser.add_argument("--target-every", type=_util.positive_int, default=250,
                        help="updates between target-network copies (default 250)")
    parser.add_argument("--publish-every", type=_util.positive_int, default=10,
                        help="updates between model-server pushes (default 10)")
    parser.add_argument("--pull-every", type=_util.positive_int, default=50,
                        help="actor steps between model-server pulls (default 50)")
    parser.add_argument("--add-batch", type=_util.positive_int, default=16,
                        help="transitions an actor adds (and prioritises) at once (default 16)")
    parser.add_argument("--alpha", type=_util.non_negative_float, default=0.6, help="priority exponent (default 0.6)")
    parser.add_argument("--beta", type=_util.fraction, default=0.4, help="importance-sampling exponent (default 0.4)")
    parser.add_argument("--epsilon", type=_util.fraction, default=0.4, help="Ape-X base epsilon (default 0.4)")
    parser.add_argument("--epsilon-alpha", type=_util.non_negative_float, default=7.0,
                        help="Ape-X epsilon exponent alpha (default 7)")
    parser.add_argument("--eval-epsilon", type=_util.fraction, default=0.02,
                        help="actors at or below this epsilon make the metric (default 0.02)")
    parser.add_argument("--max-grad-norm", type=_util.positive_float, default=10.0,
                        help="gradient clipping (default 10)")
    parser.add_argument("--window", type=_util.positive_int, default=100,
                        help="episodes in the mean return (default 100)")
    parser.add_argument("--target", type=_util.non_negative_float, default=195.0,
                        help="stop when the metric reaches this; 0: use the whole budget (default 195)")
    parser.add_argument("--rpc-timeout", type=_util.positive_float, default=120.0,
                        help="seconds per RPC wait (default 120)")
    parser.add_argument("--print-every", type=_util.positive_float, default=5.0,
                        help="seconds between progress lines (default 5)")
    args = parser.parse_args()
    start = time.monotonic()
    results = [r for r in _util.run(worker, 1 + args.num_workers, args, chaos_ok=True) if r]
    for result in results:
        if result.get("name") == "0":
            # The ranks are done: plot here (see _util.plot_csv).
            result["png"] = _util.plot_csv(args.out, "env_steps", ["return", "mean_return_all", "mean_return"],
                                           f"Ape-X DQN on {ENV}: episode returns (mean_return: low-epsilon actors)")
            # Launched here: every rank's time plus this parent's. Under torchrun: this rank's.
            # (With --chaos: the ranks that returned; a killed actor's time is not reported.)
            cpu = sum(r["cpu"] for r in results) + (cpu_seconds() if len(results) > 1 or args.chaos else 0.0)
            _util.summary("Ape-X DQN on " + ENV, {
                "stopped": result["reason"],
                f"metric: mean return, last {args.window} episodes of actor(s) {', '.join(result['counted'])}":
                    format_mean(result["mean_return"]),
                f"mean return, last {args.window} episodes of all actors": format_mean(result["mean_return_all"]),
                "episodes (all actors)": result["episodes_all"],
                "environment steps": f"{result['env_steps']:,}",
                "learner updates": result["updates"],
                "training time (incl. set-up)": f"{result['train_time']:.1f} s",
                "wall time": _util.wall_time(start),
                "CPU time, all processes" + ("" if len(results) > 1 else " (this rank)"): f"{cpu:.1f} s",
                **({"chaos": (f"every {args.chaos:g} s: {result['losses']} actors lost, {result['rejoins']} "
                              f"rejoined, {result['missed']} shard calls found their actor gone")}
                   if args.chaos is not None else {}),
                "learning curve": args.out + (f", {result['png']}" if result["png"] else ""),
                **_util.metrics_summary(args, f"Ape-X DQN on {ENV}"),
            })


if __name__ == "__main__":
    main()
