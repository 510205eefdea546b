"""The episode log of the reinforcement-learning examples: the metric, the CSV and when to stop.

Not part of the library: ``impala.py`` and ``dqn_apex.py`` import it from their own folder.
It lives in the process of rank 0; actors reach :meth:`EpisodeLog.report` as a registered
RpcGroup service, and its answer ("keep going?") tells them that training stopped (the
Ape-X actors stop on it; the IMPALA actors wait for their learner's word instead).
"""

from __future__ import annotations

import collections
import math
import resource
import threading
import time
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Sequence

from _util import Curve

__all__ = ["EpisodeLog", "format_mean", "collect_columns", "cpu_seconds"]


class EpisodeLog:
    """Finished training episodes, reported by the actors; thread-safe (RPC threads call it).

    Args:
        curve: Where every reported episode becomes a row (columns: ``COLUMNS``, then
            ``extra``'s); ``mean_return`` is filled on the rows of counted actors.
        window: Episodes in the moving mean (the metric: mean return of the last ``window``).
        target: Stop once the moving mean over a full window reaches it; 0: never.
        budget: Seconds from construction after which training stops.
        counted: Actors whose episodes make the metric; None: every actor. Episodes of the
            others still count in ``mean_return_all`` and the step counts.
        extra: Called under the lock for each CSV row; returns the learner's columns
            (updates, version lag, ...).
        listener: Called with each report's returns and lengths (the run's metrics).
    """

    COLUMNS = ("time_s", "env_steps", "episode", "actor", "policy_version", "return", "mean_return",
               "mean_return_all")

    def __init__(self, curve: Curve, window: int, target: float, budget: float,
                 counted: Optional[Iterable[str]] = None,
                 extra: Optional[Callable[[], Dict[str, Any]]] = None,
                 listener: Optional[Callable[[Sequence[float], Sequence[int]], None]] = None) -> None:
        self._curve = curve
        self._window = window
        self._target = target
        self._start = time.monotonic()
        self._deadline = self._start + budget
        self._counted = None if counted is None else set(counted)
        self._extra = extra or dict
        self._listener = listener
        self._lock = threading.Lock()
        self._returns: Deque[float] = collections.deque(maxlen=window)
        self._returns_all: Deque[float] = collections.deque(maxlen=window)
        self._episodes = 0
        self._episodes_all = 0
        self._env_steps = 0
        self._versions: Dict[str, int] = {}
        self._reason: Optional[str] = None

    def report(self, actor: str, returns: Sequence[float], steps: int, version: int,
               lengths: Sequence[int] = ()) -> bool:
        """Record an actor's finished episodes and its environment steps since its last report.

        Args:
            actor: The actor's member name.
            returns: Returns of the episodes it finished since its last report (maybe none).
            steps: Environment steps it took since its last report.
            version: Model-server version of the policy it acted with.
            lengths: Lengths (steps) of those episodes, when the actor counts them.

        Returns:
            Whether the actor should keep going (False once training stopped).
        """
        if self._listener is not None and returns:
            self._listener(returns, lengths)
        with self._lock:
            self._env_steps += int(steps)
            self._versions[actor] = int(version)
            # Episodes that end after the stop was decided are not counted: the summary's
            # mean is then the one that stopped training (cold trial 25: "reached 195"
            # above a final mean of 192.3).
            for value in (returns if self._reason is None else ()):
                self._episodes_all += 1
                self._returns_all.append(float(value))
                counted = self._counted is None or actor in self._counted
                if counted:
                    self._episodes += 1
                    self._returns.append(float(value))
                row = {"time_s": f"{time.monotonic() - self._start:.2f}", "env_steps": self._env_steps,
                       "episode": self._episodes_all, "actor": actor, "policy_version": version, "return": value,
                       "mean_return": f"{self._mean(self._returns):.2f}" if counted else "",
                       "mean_return_all": f"{self._mean(self._returns_all):.2f}"}
                row.update(self._extra())
                self._curve.add(**row)
            if self._reason is None and self._target > 0 and len(self._returns) == self._window \
                    and self._mean(self._returns) >= self._target:
                self._reason = f"solved: mean return of the last {self._window} episodes reached {self._target:g}"
            return self._reason is None

    @staticmethod
    def _mean(values: Iterable[float]) -> float:
        values = list(values)
        return sum(values) / len(values) if values else float("nan")

    def should_stop(self) -> bool:
        """Whether training is over: solved, out of time, or stopped by :meth:`stop`."""
        with self._lock:
            if self._reason is None and time.monotonic() >= self._deadline:
                self._reason = "time budget used up"
            return self._reason is not None

    def stop(self, reason: str) -> None:
        """End training now (e.g. a step budget); actors learn it from their next report."""
        with self._lock:
            if self._reason is None:
                self._reason = reason

    @property
    def reason(self) -> Optional[str]:
        """Why training stopped; None while it runs."""
        with self._lock:
            return self._reason

    def snapshot(self) -> Dict[str, Any]:
        """The current figures: episodes (counted), episodes_all, env_steps, mean_return (the
        metric), mean_return_all, and versions (each actor's last reported policy version)."""
        with self._lock:
            return {"episodes": self._episodes, "episodes_all": self._episodes_all, "env_steps": self._env_steps,
                    "mean_return": self._mean(self._returns), "mean_return_all": self._mean(self._returns_all),
                    "versions": dict(self._versions)}


def format_mean(value: float) -> str:
    """A mean return for a progress line ('-' before the first episode)."""
    return "-" if math.isnan(value) else f"{value:.1f}"


def collect_columns(*groups: List[str]) -> List[str]:
    """EpisodeLog's columns followed by the example's own, without duplicates."""
    columns = list(EpisodeLog.COLUMNS)
    for group in groups:
        columns += [c for c in group if c not in columns]
    return columns



def cpu_seconds() -> float:
    """User + system CPU time of this process so far (all its threads), seconds.

    The examples add these up over their ranks: ``time`` on the launching command does not
    see the ranks, which are children of the forkserver, not of the command.
    """
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime
