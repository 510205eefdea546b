"""Where scalars end up: a CSV file (always), TensorBoard event files, Weights & Biases.

A sink is written by one thread only (the writer's, see ``_writer``), so none takes a
lock. Each is handed whole batches: one call per batch keeps the per-point cost of a
slow backend (W&B's ``log``) off the training loop and amortised.
"""

from __future__ import annotations

import csv
import importlib.util
import os
from typing import Any, Dict, List, Mapping, Optional, Protocol, Sequence, Tuple

__all__ = ["Point", "Sink", "CsvSink", "TensorBoardSink", "WandbSink", "tensorboard_available"]

#: One scalar: (tag, value, step, wall time in seconds since the epoch).
Point = Tuple[str, float, int, float]


class Sink(Protocol):
    """What :class:`~machinlike.metrics.Metrics` writes to; implement it for another backend."""

    def write(self, points: Sequence[Point]) -> None:
        """Record ``points`` (in the order they were logged)."""

    def flush(self) -> None:
        """Make what was written so far visible to readers (files on disk, a dashboard)."""

    def close(self) -> None:
        """Flush and release the backend (called once)."""


def tensorboard_available() -> bool:
    """Whether the ``tensorboard`` package is installed (what :class:`TensorBoardSink` needs)."""
    return importlib.util.find_spec("tensorboard") is not None


class CsvSink:
    """``<logdir>/metrics.csv``, one row per point: ``wall_time,step,tag,value``.

    Long format, so that tags may come and go during a run; a crash keeps every flushed
    row. An existing file is appended to (a restarted process adds to its run).
    """

    COLUMNS = ("wall_time", "step", "tag", "value")

    def __init__(self, logdir: str, filename: str = "metrics.csv") -> None:
        os.makedirs(logdir, exist_ok=True)
        self.path = os.path.join(logdir, filename)
        fresh = not os.path.exists(self.path) or os.path.getsize(self.path) == 0
        self._stream = open(self.path, "a", newline="")
        self._csv = csv.writer(self._stream)
        if fresh:
            self._csv.writerow(self.COLUMNS)

    def write(self, points: Sequence[Point]) -> None:
        self._csv.writerows((f"{wall:.3f}", step, tag, repr(value)) for tag, value, step, wall in points)

    def flush(self) -> None:
        self._stream.flush()

    def close(self) -> None:
        self._stream.close()


class TensorBoardSink:
    """TensorBoard event files in ``logdir`` (torch's ``FileWriter``).

    Points of one batch that share a step and wall time become one event holding all
    their values (as ``SummaryWriter.add_scalars`` does, without its per-tag folders):
    one protobuf per logged step instead of one per point.

    Raises:
        ImportError: ``tensorboard`` is not installed (``pip install tensorboard``).
    """

    def __init__(self, logdir: str) -> None:
        if not tensorboard_available():
            raise ImportError("the 'tensorboard' sink needs the tensorboard package: pip install tensorboard "
                              "(or machinlike[examples]); or pass sinks=('csv',)")
        from tensorboard.compat.proto.summary_pb2 import Summary
        from torch.utils.tensorboard.writer import FileWriter

        self._summary = Summary
        # flush_secs: Metrics flushes on its own schedule (flush_every) as well.
        self._writer = FileWriter(logdir, max_queue=1000, flush_secs=30)

    def write(self, points: Sequence[Point]) -> None:
        values: List[Any] = []
        for i, (tag, value, step, wall) in enumerate(points):
            values.append(self._summary.Value(tag=tag, simple_value=value))
            nxt = points[i + 1] if i + 1 < len(points) else None
            if nxt is None or nxt[2] != step or nxt[3] != wall:
                self._writer.add_summary(self._summary(value=values), step, wall)
                values = []

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """A Weights & Biases run; ``wandb`` is imported here, only when this sink is asked for.

    Points of one batch that share a step go to W&B as one ``log`` call.

    Args:
        logdir: Where W&B keeps its local files (``dir=``).
        options: Keyword arguments for ``wandb.init`` (``project``, ``name``, ``config``,
            ``mode="offline"``, ...); None: none.

    Raises:
        ImportError: ``wandb`` is not installed (``pip install wandb``).
    """

    def __init__(self, logdir: str, options: Optional[Mapping[str, Any]] = None) -> None:
        if importlib.util.find_spec("wandb") is None:
            raise ImportError("the 'wandb' sink needs the wandb package: pip install wandb; or leave 'wandb' "
                              "out of sinks")
        import wandb

        os.makedirs(logdir, exist_ok=True)
        self._run = wandb.init(**{"dir": logdir, **dict(options or {})})

    def write(self, points: Sequence[Point]) -> None:
        by_step: Dict[int, Dict[str, float]] = {}
        order: List[int] = []
        for tag, value, step, _ in points:
            if step not in by_step:
                by_step[step] = {}
                order.append(step)
            by_step[step][tag] = value
        for step in order:
            self._run.log(by_step[step], step=step)

    def flush(self) -> None:
        pass  # wandb uploads on its own schedule

    def close(self) -> None:
        self._run.finish()
