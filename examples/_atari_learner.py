"""The learner of ``impala_atari.py``: V-trace (``--algo impala``) or PPO's clipped surrogate
(``--algo appo``, see ``_ppo.py``) on stacked uint8 frames, the actors' reports, the first
times the mean return reached the milestones, and the choice between local and central
inference.

Not part of the library: the example imports it from its own folder. Everything here lives
in rank 0's process:

    actors ──► Inbox ──► learn(): take B; impala: per minibatch of their games, vtrace_loss
                                   and an optimizer step; appo: ppo_update (epochs over
                                   shuffled minibatches); then publish version v:
                                   model server (local inference) and/or
                                   InferenceServerImpl.update (central inference)
    actors ──► Reports.report(): EpisodeLog (metric, CSV, stop), Milestones (first mean
                                 >= 0, >= 18), the policy calls' p95, and the reply: the
                                 inference mode from ModeChooser
    learn() ──every --metrics-every s──► RunMetrics: runs/<name>/ (TensorBoard, metrics.csv)
"""

from __future__ import annotations

import argparse
import collections
import threading
import time
from typing import Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

import _util
import machinlike
from _episodes import EpisodeLog, collect_columns, format_mean
from _impala_core import Inbox, vtrace
from _metrics import RunMetrics, logdir_of
from _ppo import Normalizers, ppo_init, ppo_update
from machinlike.metrics import flatten_stats
from machinlike.server import PushPullModelServerImpl

__all__ = ["ModeChooser", "Milestones", "Reports", "vtrace_loss", "make_optimizer", "env_slices", "learn"]

GROUP = "atari"
SERVER = "atari_model"
INFER = "atari_infer"


class ModeChooser:
    """Which inference mode the actors use; for ``auto``, a trial of both, then the faster.

    Trial: ``local`` for ``settle + measure`` seconds, then ``central`` as long; agent steps
    per second are counted over each ``measure`` window only (the first ``settle`` seconds
    let every actor switch and the queues refill). The clock starts with the first steps.
    """

    def __init__(self, requested: str, settle: float, measure: float) -> None:
        self._lock = threading.Lock()
        self._auto = requested == "auto"
        self._mode = "local" if self._auto else requested
        self._settle, self._measure = settle, measure
        self._phase_start: Optional[float] = None
        self._window: Optional[Tuple[float, int]] = None  # (start time, steps then)
        self._rates: Dict[str, float] = {}

    def mode(self) -> str:
        with self._lock:
            return self._mode

    @property
    def deciding(self) -> bool:
        """Whether the trial still runs (its numbers are not the run's steady throughput)."""
        with self._lock:
            return self._auto and len(self._rates) < 2

    def observe(self, steps: int) -> Optional[str]:
        """Feed the total agent steps so far; returns a line to print when a decision falls."""
        with self._lock:
            if not self._auto or len(self._rates) == 2 or steps == 0:
                return None
            now = time.monotonic()
            if self._phase_start is None:
                self._phase_start = now
            elapsed = now - self._phase_start
            if self._window is None and elapsed >= self._settle:
                self._window = (now, steps)
            if self._window is None or elapsed < self._settle + self._measure:
                return None
            self._rates[self._mode] = (steps - self._window[1]) / (now - self._window[0])
            self._phase_start, self._window = now, None
            if len(self._rates) == 1:
                self._mode = "central"
                return f"auto: local inference trained at {self._rates['local']:,.0f} agent steps/s; trying central"
            self._mode = max(self._rates, key=self._rates.__getitem__)
            return (f"auto: local {self._rates['local']:,.0f}, central {self._rates['central']:,.0f} agent steps/s: "
                    f"keeping {self._mode} inference")


class Milestones:
    """When the metric (the mean return of the last ``window`` episodes, a full window)
    first reached each of ``levels``: seconds since ``launched`` and frames.

    Args:
        levels: Mean returns to time (e.g. 0 and 18 for Pong).
        window: Episodes the mean needs before it counts (as the target's).
        launched: ``time.time()`` when the command started (a wall clock: the launcher
            and this process share it, a monotonic clock's origin is not promised).
        frames_per_step: Frames in one agent step (ale-py's frameskip).
    """

    def __init__(self, levels: Sequence[float], window: int, launched: float, frames_per_step: int = 4) -> None:
        self._levels = sorted(levels)
        self._window, self._launched, self._fps = window, launched, frames_per_step
        self._lock = threading.Lock()
        self._reached: Dict[float, Tuple[float, int]] = {}

    def observe(self, snapshot: Dict[str, Any]) -> List[str]:
        """Feed an EpisodeLog snapshot; returns a line for each level reached for the first time."""
        if snapshot["episodes"] < self._window:
            return []
        new = []
        with self._lock:
            for level in self._levels:
                if level not in self._reached and snapshot["mean_return"] >= level:
                    self._reached[level] = (time.time() - self._launched, self._fps * snapshot["env_steps"])
                    new.append(level)
        return [self.line(level) for level in new]  # outside the lock: line() takes it

    def line(self, level: float) -> str:
        """'first mean >= 18 at 171.2 s / 3,911,040 frames', or '... not reached'."""
        with self._lock:
            got = self._reached.get(level)
        if got is None:
            return f"first mean >= {level:g}: not reached"
        return f"first mean >= {level:g} at {got[0]:.1f} s / {got[1]:,} frames"

    def lines(self) -> List[str]:
        return [self.line(level) for level in self._levels]


class Reports:
    """The actors' report service: episodes into the EpisodeLog (and the milestones), the
    p95 of their policy calls kept for the progress line, and the reply: the mode to use next."""

    def __init__(self, log: EpisodeLog, chooser: ModeChooser, milestones: Optional[Milestones] = None) -> None:
        self._log, self._chooser, self._milestones = log, chooser, milestones
        self._lock = threading.Lock()
        self._p95: Deque[float] = collections.deque(maxlen=16)  # the latest unrolls' p95 (ms)

    def report(self, actor: str, returns: Sequence[float], steps: int, version: int, p95_ms: float,
               lengths: Sequence[int] = ()) -> str:
        self._log.report(actor, returns, steps, version, lengths)
        if self._milestones is not None and returns:
            for line in self._milestones.observe(self._log.snapshot()):
                print(f"[learner] {line}", flush=True)
        with self._lock:
            self._p95.append(float(p95_ms))
        return self._chooser.mode()

    def call_p95(self) -> float:
        """The median of the latest unrolls' p95 of the actors' policy calls, ms (0: none
        yet); the median, so that one actor's first, warm-up unroll does not stick."""
        with self._lock:
            recent = sorted(self._p95)
        return recent[len(recent) // 2] if recent else 0.0


def vtrace_loss(net: nn.Module, batch: List[Dict[str, torch.Tensor]],
                args: argparse.Namespace) -> Tuple[torch.Tensor, Dict[str, float]]:
    """The IMPALA loss, summed over the batch's T x N steps as in Espeholt et al. (2018):
    policy gradient with V-trace advantages, value regression onto v_s, entropy bonus.
    Rewards are clipped to [-1, 1]; ``--normalize-advantages`` scales the advantages of each
    (mini)batch to zero mean and unit spread (as Sample Factory's APPO does). The figures (policy and value loss, entropy) are per step:
    the sums over the batch divided by its T x N steps."""
    obs = torch.cat([t["obs"] for t in batch], dim=1)            # [T+1, N, 4, 84, 84] uint8
    actions = torch.cat([t["actions"] for t in batch], dim=1)    # [T, N]
    rewards = torch.cat([t["rewards"] for t in batch], dim=1).clamp(-1.0, 1.0)
    done = torch.cat([t["done"] for t in batch], dim=1)
    behaviour_logp = torch.cat([t["logp"] for t in batch], dim=1)
    length, width = actions.shape
    logits, values = net(obs.reshape(-1, *obs.shape[2:]))
    logits = logits.reshape(length + 1, width, -1)[:-1]
    values = values.reshape(length + 1, width)
    log_probs = F.log_softmax(logits, dim=-1)
    logp = log_probs.gather(2, actions.unsqueeze(2)).squeeze(2)
    with torch.no_grad():
        log_rhos = logp - behaviour_logp
        vs, advantages = vtrace(values[:-1], values[-1], rewards, args.gamma * (1.0 - done), log_rhos)
        if getattr(args, "normalize_advantages", False):
            # Pong's clipped rewards are rare: early advantages are ~0.01-0.1, small beside the
            # entropy bonus's pull; scaled to unit spread the policy gradient keeps its weight.
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    policy_loss = -(logp * advantages).sum()
    value_loss = 0.5 * (vs - values[:-1]).pow(2).sum()
    entropy = -(log_probs.exp() * log_probs).sum()
    loss = policy_loss + args.baseline_cost * value_loss - args.entropy_cost * entropy
    steps = length * width
    return loss, {"loss_policy": policy_loss.item() / steps, "loss_value": value_loss.item() / steps,
                  "entropy": entropy.item() / steps}


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """``--optimizer``: the IMPALA paper's RMSprop for Atari (decay 0.99, eps 0.01, on summed
    losses), or Adam (RLlib's IMPALA default, also on summed losses; for APPO's mean losses
    with eps 1e-5, as the PPO baselines for Atari)."""
    if args.optimizer == "adam":
        eps = 1e-5 if getattr(args, "algo", "impala") == "appo" else 1e-8
        return torch.optim.Adam(model.parameters(), lr=args.lr, eps=eps)
    return torch.optim.RMSprop(model.parameters(), lr=args.lr, alpha=0.99, eps=0.01)


def env_slices(batch: List[Dict[str, torch.Tensor]], parts: int) -> List[List[Dict[str, torch.Tensor]]]:
    """``batch`` cut along its games into ``parts`` minibatches (views, no copies), each
    with a slice of every message's games; ``versions`` (one per step) goes whole with
    each. Fewer than ``parts`` when the messages have fewer games."""
    out: List[List[Dict[str, torch.Tensor]]] = [[] for _ in range(parts)]
    for trajectory in batch:
        games = trajectory["actions"].shape[1]
        for i, index in enumerate(torch.arange(games).tensor_split(parts)):
            if len(index):
                lo, hi = int(index[0]), int(index[-1]) + 1
                out[i].append({key: value if key == "versions" else value[:, lo:hi]
                               for key, value in trajectory.items()})
    return [part for part in out if part]


def learn(world: machinlike.World, group: machinlike.RpcGroup, args: argparse.Namespace,
          net_class: Callable[[int], nn.Module], ready: Optional[Callable[[], None]] = None) -> Dict[str, Any]:
    """The learner; it also hosts the model server, the inference server (central or auto),
    the episode log and the report service, and decides when to stop.

    ``ready``: called once the services, the episode log and version 1 exist; None: a
    barrier of the group (the actors wait in theirs).

    Returns:
        The figures of the run, and ``close``: call it once no actor calls any more.
    """
    torch.manual_seed(args.seed)
    model = net_class(args.actions)
    algo = getattr(args, "algo", "impala")
    norms = None
    if algo == "appo":
        ppo_init(model)
        frame = tuple(model.get_buffer("obs_mean").shape) if getattr(args, "input_norm", True) else None
        norms = Normalizers(frame, values=getattr(args, "value_norm", True))  # type: ignore[arg-type]
    model = model.to(args.device)  # the actors' copies stay on the CPU (pull casts)
    optimizer = make_optimizer(model, args)
    inbox = Inbox(args.queue_size)
    group.register(f"{GROUP}/trajectories/{world.name}", inbox.put)
    state = {"updates": 0, "version_lag": "", "agent_steps_per_s": "", "inference": ""}
    curve = _util.Curve(args.out, collect_columns(["launch_s", "updates", "version_lag", "agent_steps_per_s",
                                                   "inference"]))
    launched = getattr(args, "launched", time.time())

    def row_extra() -> Dict[str, Any]:
        # Seconds since the command started (the curve's x axis and the milestones' clock;
        # the CSV's time_s counts from this learner's start, after the processes' set-up).
        return {**state, "launch_s": f"{time.time() - launched:.2f}"}

    # Agent steps on the x axis; each is 4 frames (ale-py's frameskip).
    metrics = RunMetrics(logdir_of(args), world, args.metrics_every, args.window, frames_per_step=4,
                         enabled=not args.no_metrics)
    log = EpisodeLog(curve, args.window, args.target, args.time_budget, extra=row_extra, listener=metrics.episodes)
    chooser = ModeChooser(args.inference, settle=min(5.0, args.auto_seconds), measure=args.auto_seconds)
    # 0 and 18: Pong's halfway and "solved" (the anchors' +18); the target too when another.
    milestones = Milestones(sorted({0.0, 18.0} | ({args.target} if args.target > 0 else set())), args.window, launched)
    reports = Reports(log, chooser, milestones)
    group.register(f"{GROUP}/report", reports.report)
    model_impl = PushPullModelServerImpl(SERVER, group)
    models = group.get_paired(SERVER).to_here()
    models.push(model)  # version 1: what the actors start from
    infer_impl = None
    if args.inference != "local":
        from machinlike.server import InferenceServerImpl

        # Its own copy of the weights: the batcher thread runs it while this one trains.
        acting = net_class(args.actions).to(args.device)
        acting.load_state_dict(model.state_dict())
        # On --device too: it moves each batch of observations there and the outputs back.
        infer_impl = InferenceServerImpl(INFER, group, acting, max_batch=args.max_batch, max_wait=args.max_wait,
                                         version=1, device=args.device)
    recipe = (f"APPO: {args.epochs}-{args.max_epochs} epochs x {args.minibatches} minibatches, {args.advantages} "
              f"advantages, clip {args.clip:g}, {args.lr_schedule} lr, normalised {norms.describe() if norms else '-'}"
              if algo == "appo" else "IMPALA: V-trace")
    print(f"[learner] {1 + args.num_workers} processes: 1 learner ({_util.plural(args.learner_threads, 'torch thread')}, "
          f"{args.device}; {recipe}; {args.optimizer} lr {args.lr:g}), "
          f"{args.num_workers} actors x {args.envs_per_worker} games of {args.game}; inference {args.inference}; "
          f"batch {args.batch_size} x {args.envs_per_worker} x {args.unroll} steps; metric: mean return of "
          f"the last {args.window} episodes", flush=True)
    _util.announce_watch(world, logdir_of(args), args.no_metrics, "learner")
    (ready or group.barrier)()  # services, the episode log and version 1 exist from here on
    # (the first progress line follows the first update: actors start their games and play
    # a whole unroll first, seconds on a CPU; cold trial 25 saw 15 s of silence)
    print(f"[learner] waiting for the actors' first batch ({args.batch_size} x {args.envs_per_worker} games x "
          f"{args.unroll} steps); progress every {args.print_every:g} s after it", flush=True)

    progress = _util.Progress(args.print_every)
    window = {"time": time.monotonic(), "steps": 0, "updates": 0}
    steady: List[Tuple[float, int]] = []  # (time, steps) after warm-up and any auto trial
    lags: List[float] = []
    stats: Dict[str, float] = {"entropy": float("nan")}
    figures: Dict[str, float] = {}

    def library_figures() -> Dict[str, float]:
        """The inference figures and the servers' stats(), as tags."""
        out = _infer_figures(chooser.mode(), infer_impl, reports, args)
        out.update(flatten_stats(model_impl.stats(), "server/model"))
        if infer_impl is not None:
            out.update(flatten_stats(infer_impl.stats(), "server/inference"))
        return out

    version = 1  # of the weights the actors were last given
    epochs: List[int] = []  # APPO: epochs of each batch since the last progress line
    while True:
        batch = _next_batch(inbox, log, args)
        if batch is None:
            break
        batch_lags = [version - t["versions"].double().mean().item() for t in batch]
        if algo == "appo":
            # Another epoch only while no next batch waits: the device's spare time, not the actors'.
            steps_done, epochs_done, stats = ppo_update(model, optimizer, batch, args,
                                                        spare=lambda: len(inbox) < args.batch_size, norms=norms)
            grad_norm = stats.pop("grad_norm")
            state["updates"] += steps_done
            epochs.append(epochs_done)
            stats["epochs"] = float(epochs_done)
        else:
            for part in env_slices(batch, args.minibatches):
                loss, stats = vtrace_loss(model, [_util.to_device(t, args.device) for t in part], args)
                optimizer.zero_grad()
                loss.backward()
                grad_norm = float(nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm))
                optimizer.step()
                state["updates"] += 1
        version += 1
        if args.inference != "central":  # only local inference reads the model server
            models.push(model)
        if infer_impl is not None:
            infer_impl.update(model, version)
        lags += batch_lags
        state["version_lag"] = f"{sum(batch_lags) / len(batch_lags):.2f}"
        steps = log.snapshot()["env_steps"]
        said = chooser.observe(steps)
        if said:
            print(f"[learner] {said}", flush=True)
        if steps and not chooser.deciding and progress.elapsed() > 15.0:
            steady.append((time.monotonic(), steps))
        figures = {**stats, "grad_norm": grad_norm, "policy_lag": sum(batch_lags) / len(batch_lags),
                   "queue": len(inbox)}
        if metrics.due():
            metrics.log(steps, state["updates"], learner=figures, servers=library_figures())
        if progress.due():
            now = time.monotonic()
            snap = log.snapshot()
            span = max(now - window["time"], 1e-9)
            rate = (snap["env_steps"] - window["steps"]) / span
            state["agent_steps_per_s"] = f"{rate:.0f}"
            state["inference"] = _infer_text(chooser.mode(), infer_impl, reports, args)
            print(f"[learner] {progress.elapsed():6.1f} s  frames {4 * snap['env_steps']:>10,} ({4 * rate:5,.0f}/s)  "
                  f"agent steps {rate:5,.0f}/s  episodes {snap['episodes']:>5}  mean return (last {args.window}) "
                  f"{format_mean(snap['mean_return']):>6}  updates {state['updates']:>5} "
                  f"({(state['updates'] - window['updates']) / span:4.2f}/s)  policy lag "
                  f"{sum(lags) / max(len(lags), 1):.1f}  inference {state['inference']}  queue "
                  f"{len(inbox)}/{args.queue_size}  entropy {stats['entropy']:.3f}"
                  + (f"  epochs {sum(epochs) / len(epochs):.1f}  clip {stats['clip_fraction']:.2f}  kl "
                     f"{stats['kl']:.4f}  lr {stats['lr']:.2e}" if epochs else ""), flush=True)
            window.update(time=now, steps=snap["env_steps"], updates=state["updates"])
            lags = []
            epochs = []
    inbox.close()  # parked and later sends answer "stop"
    snap = log.snapshot()
    if state["updates"]:  # the last point: a short run's curves end where training did
        metrics.log(snap["env_steps"], state["updates"], learner=figures, servers=library_figures())
    metrics.close()
    throughput = "not measured (too short)"
    if len(steady) > 1 and steady[-1][0] > steady[0][0]:
        rate = (steady[-1][1] - steady[0][1]) / (steady[-1][0] - steady[0][0])
        throughput = f"{rate:,.0f} agent steps/s ({4 * rate:,.0f} frames/s), after warm-up"

    def close() -> None:
        if infer_impl is not None:
            infer_impl.close()
        model_impl.close()

    return {"role": "learner", "name": world.name, "updates": state["updates"], "batches": version - 1,
            "milestones": milestones.lines(), "reason": log.reason,
            "throughput": throughput, "inference": _infer_text(chooser.mode(), infer_impl, reports, args),
            **snap, "close": close}


def _next_batch(inbox: Inbox, log: EpisodeLog, args: argparse.Namespace) -> Optional[List[Dict[str, Any]]]:
    """The next batch of trajectories, or None once training is over (checked every second
    while the inbox is short: a budget must not wait for a slow actor).

    Raises:
        TimeoutError: no batch for ``--rpc-timeout`` seconds.
    """
    deadline = time.monotonic() + args.rpc_timeout
    while not log.should_stop():
        try:
            return inbox.take(args.batch_size, timeout=max(0.0, min(1.0, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() >= deadline:
                raise
    return None


def _infer_figures(mode: str, impl: Any, reports: Reports, args: argparse.Namespace) -> Dict[str, float]:
    """``inference/batch`` (rows per forward) and ``inference/call_p95_ms`` (an actor's
    policy call, as in :func:`_infer_text`); no batch figure before central's first batch."""
    out = {"inference/call_p95_ms": reports.call_p95()}
    if mode == "local" or impl is None:
        out["inference/batch"] = float(args.envs_per_worker)
    elif impl.stats()["batches"]:
        out["inference/batch"] = float(impl.stats()["mean_batch"])
    return out


def _infer_text(mode: str, impl: Any, reports: Reports, args: argparse.Namespace) -> str:
    """'local batch 16 p95 1.9 ms' or 'central batch 23.5 p95 4.1 ms (wait p95 1.2 ms)':
    rows per forward and the p95 of an actor's policy call (forward and sampling; for
    central, the whole round trip)."""
    if mode == "local" or impl is None:
        return f"local batch {args.envs_per_worker} p95 {reports.call_p95():.1f} ms"
    stats = impl.stats()
    if not stats["batches"]:
        return "central (no batch yet)"
    return (f"central batch {stats['mean_batch']:.1f} p95 {reports.call_p95():.1f} ms "
            f"(server wait p95 {1e3 * (stats['queue_wait_p95'] or 0.0):.1f} ms)")
