"""Watching a run: scalars to TensorBoard, CSV and W&B, written off the training loop.

:class:`Metrics` queues points and writes them from a thread of its own (see
``_writer``); :class:`WorldFigures` and :func:`flatten_stats` turn the library's own state
(members, deaths, rejoins, memory, the servers' ``stats()``) into scalars for it::

    from machinlike.metrics import Metrics, WorldFigures, flatten_stats

    metrics = Metrics("runs/my_run")  # TensorBoard (if installed) + metrics.csv
    figures = WorldFigures(world)
    metrics.scalars({"loss/policy": 0.3, **figures.sample(),
                     **flatten_stats(server.stats(), "grad_server")}, step=env_steps)
    metrics.close()
"""

from ._figures import WorldFigures, flatten_stats, rss_bytes
from ._sinks import CsvSink, Sink, TensorBoardSink, WandbSink, tensorboard_available
from ._writer import Metrics

__all__ = ["Metrics", "WorldFigures", "flatten_stats", "rss_bytes", "Sink", "CsvSink", "TensorBoardSink",
           "WandbSink", "tensorboard_available"]
