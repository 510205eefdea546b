"""Runs a training example with ``--chaos`` as a user would, and checks that training went
on past the first member the launcher killed (shared by the examples' smoke tests)."""

from __future__ import annotations

import csv
import glob
import os
from collections.abc import Callable, Sequence

from example_run import run_example


def trains_through_chaos(script: str, args: Sequence[str], learner: str,
                         progress: Callable[[str], int | None]) -> list[str]:
    """Run ``examples/<script> *args`` and check it trained past the first loss.

    Args:
        learner: How the learner's lines start (``"[learner]"``); its "member ... was
            lost" line marks the kill.
        progress: A progress line's count (steps, updates), None for other lines.

    Returns:
        The example's output lines.
    """
    proc = run_example(script, args, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    lost = next(i for i, x in enumerate(lines) if x.startswith(f"{learner} member") and "was lost" in x)
    before = [n for n in map(progress, lines[:lost]) if n is not None]
    after = [n for n in map(progress, lines[lost + 1:]) if n is not None]
    # Training went on past the kill: later progress lines, with a larger count.
    assert after and after[-1] > (before[-1] if before else 0), proc.stdout
    assert "time budget used up" in proc.stdout
    chaos = next(x for x in lines if x.strip().startswith("chaos") and "actors lost" in x)
    assert " 0 actors lost" not in chaos
    killed = next(x for x in lines if x.startswith("chaos:") and "ranks killed" in x)
    assert not killed.startswith("chaos: 0 ")
    return lines


def read_scalars(logdir: str) -> dict:
    """``{tag: [(step, value), ...]}`` of the TensorBoard event files in ``logdir``, read with
    TensorBoard's own reader (``EventAccumulator``)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(logdir)
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def earlier_run(logdir: str) -> None:
    """Leave in ``logdir`` what an earlier run of an example left there: metrics.csv and
    TensorBoard event files (a point at step 10**9 of the tag ``earlier/run``), metrics.png,
    and a file of the user's (``notes.txt``)."""
    from machinlike.metrics import Metrics

    with Metrics(logdir) as metrics:
        metrics.scalars({"earlier/run": 1.0, "env/steps": 10**9}, 10**9)
    for name, text in (("metrics.png", "not a png"), ("notes.txt", "mine")):
        with open(os.path.join(logdir, name), "w") as stream:
            stream.write(text)


def only_this_run(logdir: str) -> None:
    """Check that ``logdir`` holds the metrics of the last run only (the example removed
    :func:`earlier_run`'s) and kept the user's own file."""
    with open(os.path.join(logdir, "metrics.csv"), newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert rows and not [r for r in rows if r["tag"] == "earlier/run" or int(r["step"]) >= 10**9], rows[:3]
    assert "earlier/run" not in read_scalars(logdir)
    assert len(glob.glob(os.path.join(logdir, "events.out.tfevents.*"))) == 1, os.listdir(logdir)
    with open(os.path.join(logdir, "notes.txt")) as stream:
        assert stream.read() == "mine"


#: What every training example writes (the field's usual set and the library's own figures).
COMMON_TAGS = ["env/steps", "env/steps_per_s", "episode/return_mean100", "episode/length_mean100",
               "world/members_alive", "world/deaths", "world/rejoins", "rss_mb/0"]
