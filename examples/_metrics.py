"""The training examples' metrics: what a run writes under ``runs/<name>/`` for TensorBoard.

Not part of the library (the examples import it from their own folder); it shows how a
program uses :mod:`machinlike.metrics`. The process that trains (rank 0) makes one
:class:`RunMetrics` and calls :meth:`RunMetrics.log` from its loop; everything else is
optional. A run starts its folder afresh: an earlier run's metrics.csv, metrics.png and event
files there are removed (:func:`fresh_logdir`); pass another ``--logdir`` to keep both. Tags,
by TensorBoard panel:

    env/       steps, steps_per_s (and frames_per_s where a step is several frames)
    episode/   return_mean100, length_mean100, episodes
    learner/   updates, updates_per_s, policy_lag, losses (loss_*), entropy, grad_norm
    inference/ batch (rows per forward), call_p95_ms (an actor's policy call), where measured
    server/    the servers' stats(): pushes applied / dropped, versions, lag
    world/     members_alive, deaths, rejoins, leaves
    rss_mb/    each local member's resident memory (MB)

The x axis of every tag is environment steps, so panels line up.
"""

from __future__ import annotations

import collections
import glob
import os
import threading
import time
from typing import Any, Deque, Dict, List, Mapping, Optional, Sequence

from machinlike.metrics import Metrics, WorldFigures

__all__ = ["RunMetrics", "fresh_logdir", "logdir_of"]


def logdir_of(args: Any) -> str:
    """``--logdir``, or the folder named after ``--out`` (``runs/impala.csv`` -> ``runs/impala``;
    ``runs/impala``, with no extension, -> ``runs/impala.metrics``: the curve's own path
    cannot be its folder too)."""
    if args.logdir:
        return args.logdir
    stem, ext = os.path.splitext(args.out)
    return stem if ext else args.out + ".metrics"


def fresh_logdir(logdir: str) -> List[str]:
    """Remove an earlier run's metrics from ``logdir``: its ``metrics.csv``, ``metrics.png``
    and TensorBoard event files (``events.out.tfevents.*``), nothing else.

    Why: the CSV sink appends and TensorBoard reads every event file of the folder, so a
    re-run with the same ``--logdir`` drew each earlier run too, going back to step 0 (while
    the curve, ``--out``, is written afresh). A run that should be kept needs another ``--logdir``.

    Returns:
        The paths removed.
    """
    earlier = [os.path.join(logdir, name) for name in ("metrics.csv", "metrics.png")]
    earlier += glob.glob(os.path.join(glob.escape(logdir), "events.out.tfevents.*"))
    removed = []
    for path in earlier:
        try:
            os.remove(path)
        except FileNotFoundError:
            continue
        removed.append(path)
    return removed


class RunMetrics:
    """Rank 0's writer: episode windows, rates, the learner's figures and the world's.

    Thread-safe: actors' reports arrive on RPC threads (:meth:`episodes`) while the loop
    calls :meth:`log`.

    Args:
        logdir: The run's folder (TensorBoard's ``--logdir``).
        world: The World (for members, deaths, rejoins and memory); None: no world figures.
        every: Seconds between logged points (:meth:`due`); 0: every call.
        window: Episodes in the moving means.
        frames_per_step: Frames in one environment step (Atari's frame skip); 0: no frames/s.
        enabled: False: every call is a no-op (``--no-metrics``); True: the folder starts
            afresh (:func:`fresh_logdir`).
    """

    def __init__(self, logdir: str, world: Any = None, every: float = 1.0, window: int = 100,
                 frames_per_step: int = 0, enabled: bool = True) -> None:
        self.every = every
        self.frames_per_step = frames_per_step
        if enabled:
            fresh_logdir(logdir)  # this run's points only, not an earlier run's before them
        self._metrics = Metrics(logdir) if enabled else None
        self._figures = WorldFigures(world) if enabled and world is not None else None
        self._lock = threading.Lock()
        self._returns: Deque[float] = collections.deque(maxlen=window)
        self._lengths: Deque[int] = collections.deque(maxlen=window)
        self._episodes = 0
        self._last_due = -float("inf")
        self._last: Optional[Dict[str, float]] = None  # time, env steps, updates at the last log
        self._has_rates = False  # whether any point had rates yet

    def episodes(self, returns: Sequence[float], lengths: Sequence[int] = ()) -> None:
        """Finished episodes' returns and (when known) lengths."""
        with self._lock:
            self._episodes += len(returns)
            self._returns.extend(float(r) for r in returns)
            self._lengths.extend(int(n) for n in lengths)

    def due(self) -> bool:
        """Whether ``every`` seconds passed since the last true answer."""
        now = time.monotonic()
        if self._metrics is None or now - self._last_due < self.every:
            return False
        self._last_due = now
        return True

    def log(self, env_steps: int, updates: Optional[int] = None, learner: Optional[Mapping[str, float]] = None,
            servers: Optional[Mapping[str, float]] = None) -> None:
        """One point of every tag at x = ``env_steps``.

        Args:
            env_steps: Environment steps so far (all actors).
            updates: Learner updates so far; None: not tracked.
            learner: ``{"loss_policy": ..., "entropy": ..., "grad_norm": ..., "policy_lag": ...}``
                (each becomes ``learner/<key>``).
            servers: Already tagged figures (``flatten_stats`` of the servers' stats()).
        """
        if self._metrics is None:
            return
        now = time.monotonic()
        out: Dict[str, float] = {"env/steps": env_steps}
        with self._lock:
            out["episode/episodes"] = self._episodes
            if self._returns:
                out["episode/return_mean100"] = sum(self._returns) / len(self._returns)
            if self._lengths:
                out["episode/length_mean100"] = sum(self._lengths) / len(self._lengths)
        # A rate over a span much shorter than ``every`` (the last point, logged just after a
        # due one) would be noise, a dip to 0 at the end of every curve: such a point has no
        # rates, and the next rate starts where the last one ended. A run whose only due point
        # was its first (one shorter than ``every``, or slow to its first update) still gets
        # one rate, over whatever span it had: a short span's rate beats none.
        span = now - self._last["t"] if self._last is not None else 0.0
        rated = self._last is None or span >= max(self.every / 2, 1e-6) or (not self._has_rates and span > 0)
        if self._last is not None and rated:
            self._has_rates = True
            out["env/steps_per_s"] = (env_steps - self._last["steps"]) / span
            if self.frames_per_step:
                out["env/frames_per_s"] = out["env/steps_per_s"] * self.frames_per_step
            if updates is not None:
                out["learner/updates_per_s"] = (updates - self._last["updates"]) / span
        if updates is not None:
            out["learner/updates"] = updates
        for key, value in (learner or {}).items():
            out[f"learner/{key}"] = value
        out.update(servers or {})
        if self._figures is not None:
            out.update(self._figures.sample())
        self._metrics.scalars(out, int(env_steps))
        if rated:
            self._last = {"t": now, "steps": env_steps, "updates": updates or 0}

    @property
    def dropped(self) -> int:
        return self._metrics.dropped if self._metrics is not None else 0

    def close(self) -> None:
        if self._figures is not None:
            self._figures.close()
        if self._metrics is not None:
            self._metrics.close()


def plot_metrics(logdir: str, title: str, x: str = "environment steps") -> Optional[str]:
    """``<logdir>/metrics.png`` from ``<logdir>/metrics.csv``: one panel per kind of figure
    (the tag's part before ``/``), x = the points' step (named ``x``), a red line at every death (a
    chaos kill) seen in ``world/deaths``. None when matplotlib or the CSV is missing."""
    import csv

    path = os.path.join(logdir, "metrics.csv")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install '.[examples]'): no metrics plot")
        return None
    if not os.path.exists(path):
        return None
    series: Dict[str, Dict[str, list]] = collections.defaultdict(lambda: collections.defaultdict(list))
    deaths = []
    with open(path, newline="") as stream:
        for row in csv.DictReader(stream):
            group, _, name = row["tag"].partition("/")
            step, value = int(row["step"]), float(row["value"])
            if row["tag"] == "world/deaths":
                deaths.append((step, value))
            if name in ("steps", "updates", "episodes") or "since_" in name:
                continue  # the x axis and the rates say it better; ages saw-tooth
            # A panel per kind: the learner's (and episodes') figures differ in scale, so each
            # has its own (the losses share one); a panel per server ("server/<which>/..."); the other
            # groups are one kind each.
            panel = group if group not in ("learner", "eval", "inference", "episode") else \
                f"{group}: " + ("losses" if "loss" in name else "accuracy" if "accuracy" in name else name)
            if group == "server" and "/" in name:
                which, _, name = name.partition("/")
                panel = f"server: {which}"
            series[panel][name].append((step, value))
    kills = [step for (step, n), (_, before) in zip(deaths[1:], deaths) if n > before]
    order = "eval episode env learner inference server world rss_mb".split()
    panels = sorted(series, key=lambda p: (order.index(p.split(":")[0]) if p.split(":")[0] in order else 99, p))
    if not panels:
        return None
    cols = min(3, len(panels))
    rows_n = (len(panels) + cols - 1) // cols
    figure, axes = plt.subplots(rows_n, cols, figsize=(5.2 * cols, 3.0 * rows_n), squeeze=False)
    for axis, panel in zip(axes.flat, panels):
        names = sorted(series[panel])
        for name in names[:12]:  # a panel of more lines is unreadable
            axis.plot(*zip(*series[panel][name]), label=name, linewidth=1.2)
        for i, step in enumerate(kills):
            axis.axvline(step, color="red", alpha=0.35, linestyle="--", linewidth=0.8,
                         label="member lost" if i == 0 else None)
        axis.set_title(panel)
        axis.set_xlabel(x)
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7, loc="best")
    for axis in list(axes.flat)[len(panels):]:
        axis.set_visible(False)
    figure.suptitle(title)
    # Fixed margins (inches over the figure's size) rather than tight_layout, which measures
    # every tick label: a third of the drawing time of a dozen panels.
    height = 3.0 * rows_n
    figure.subplots_adjust(left=0.6 / (5.2 * cols), right=1 - 0.15 / (5.2 * cols), bottom=0.5 / height,
                           top=1 - 0.75 / height, wspace=0.22, hspace=0.5)
    png = os.path.join(logdir, "metrics.png")
    figure.savefig(png, dpi=90)
    plt.close(figure)
    return png
