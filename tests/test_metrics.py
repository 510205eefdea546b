"""machinlike.metrics: what is logged reaches the CSV and TensorBoard's own reader, a slow sink
drops (counted) instead of blocking the caller, and bad input is refused at the call."""

from __future__ import annotations

import csv
import pickle
import threading
import time

import pytest

from machinlike.metrics import Metrics, flatten_stats, rss_bytes, tensorboard_available

needs_tensorboard = pytest.mark.skipif(not tensorboard_available(), reason="tensorboard is not installed")


def _scalars(logdir):
    """{tag: [(step, value), ...]} of the TensorBoard event files in ``logdir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(logdir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


@needs_tensorboard
def test_points_reach_tensorboard_and_the_csv(tmp_path):
    with Metrics(tmp_path) as metrics:
        for step in range(50):
            metrics.scalars({"loss/policy": 1.0 / (step + 1), "env/steps_per_s": 100.0 + step}, step * 10)
        metrics.scalar("world/deaths", 2, 490)
        assert metrics.flush(timeout=10)
        assert metrics.dropped == 0 and metrics.sink_errors == 0
    read = _scalars(tmp_path)
    assert sorted(read) == ["env/steps_per_s", "loss/policy", "world/deaths"]
    assert read["loss/policy"][:2] == [(0, 1.0), (10, 0.5)] and len(read["loss/policy"]) == 50
    assert read["world/deaths"] == [(490, 2.0)]
    with open(tmp_path / "metrics.csv", newline="") as stream:
        rows = list(csv.DictReader(stream))
    assert len(rows) == 101 and rows[0]["tag"] == "loss/policy" and float(rows[-1]["value"]) == 2.0


class _Gate:
    """A sink whose first write blocks until released: a sink slower than the loop."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.points = []

    def write(self, points):
        self.release.wait(30)
        self.points += points

    def flush(self):
        pass

    def close(self):
        pass


def test_a_slow_sink_drops_and_counts_instead_of_blocking(tmp_path):
    gate = _Gate()
    metrics = Metrics(tmp_path, sinks=[gate], max_pending=10)
    try:
        metrics.scalar("x/a", 0, 0)
        deadline = time.monotonic() + 10
        while metrics.pending and time.monotonic() < deadline:  # the thread took it and is stuck in write
            time.sleep(0.01)
        start = time.perf_counter()
        for step in range(1, 1001):
            metrics.scalar("x/a", step, step)
        assert time.perf_counter() - start < 1.0  # never waited for the sink
        assert metrics.dropped == 990 and metrics.pending == 10
        assert metrics.flush(timeout=0.2) is False  # the writer is stuck: flush says so
    finally:
        gate.release.set()
        metrics.close(timeout=10)
    assert [p[2] for p in gate.points] == list(range(11))  # what was kept, in order


def test_a_failing_sink_is_counted_and_the_others_keep_writing(tmp_path):
    class Broken(_Gate):
        def write(self, points):
            raise OSError("disk full")

    metrics = Metrics(tmp_path, sinks=["csv", Broken()])
    metrics.scalar("x/a", 1.5, 3)
    assert metrics.flush(timeout=10)
    metrics.close()
    assert metrics.sink_errors >= 1
    with open(tmp_path / "metrics.csv", newline="") as stream:
        assert [r["value"] for r in csv.DictReader(stream)] == ["1.5"]


def test_bad_input_is_refused_at_the_call(tmp_path):
    with pytest.raises(ValueError, match="unknown sink 'tensorbord'"):
        Metrics(tmp_path, sinks=["tensorbord"])
    with pytest.raises(TypeError, match="sinks must be a sequence"):
        Metrics(tmp_path, sinks="csv")
    with pytest.raises(ValueError, match="max_pending"):
        Metrics(tmp_path, max_pending=0)
    with Metrics(tmp_path, sinks=["csv"]) as metrics:
        with pytest.raises(TypeError, match="tag must be a non-empty string"):
            metrics.scalar("", 1.0, 0)
        with pytest.raises(TypeError, match="value of 'a/b' must be a real number"):
            metrics.scalars({"a/b": "high"}, 0)
        with pytest.raises(TypeError, match="step must be an int"):
            metrics.scalar("a/b", 1.0, 1.5)
        # Cold trial 30: accepted, then failed in the writer thread with the rest of its batch.
        with pytest.raises(ValueError, match="step=18446744073709551616 does not fit in 64 bits"):
            metrics.scalars({"a/b": 1.0}, 2 ** 64)
        with pytest.raises(ValueError, match="value of 'a/b' is too large for a float"):
            metrics.scalar("a/b", 10 ** 400, 0)
        with pytest.raises(TypeError, match="cannot be pickled"):
            pickle.dumps(metrics)
    with pytest.raises(RuntimeError, match="is closed"):
        metrics.scalar("a/b", 1.0, 0)


def test_wandb_asked_for_but_missing_says_how_to_get_it(tmp_path):
    try:
        import wandb  # noqa: F401
    except ImportError:
        with pytest.raises(ImportError, match="pip install wandb"):
            Metrics(tmp_path, sinks=["csv", "wandb"])
    else:
        pytest.skip("wandb is installed here")


def test_flatten_stats_and_rss():
    stats = {"primary": {"applied": 3, "state": "running", "lag": {"mean": 0.5}}, "ok": True, "names": ["a"]}
    assert flatten_stats(stats, "grad") == {"grad/primary/applied": 3.0, "grad/primary/lag/mean": 0.5, "grad/ok": 1.0}
    assert rss_bytes() > 10 * 2**20 and rss_bytes(2**22 + 12345) is None


KEPT = []


def _log_and_keep(logdir, points):
    # A writer kept to the end of the process (a module global, an actor's attribute) and
    # never closed: the child ends by os._exit, past atexit.
    KEPT.append(Metrics(logdir, sinks=["csv"]))
    for step in range(points):
        KEPT[-1].scalar("loss/train", 1.0 / (step + 1), step)


def _rank_logs(world, logdir):
    _log_and_keep(f"{logdir}/rank{world.rank}", 30)
    return world.rank


def _rows(path):
    with open(path, newline="") as stream:
        return list(csv.DictReader(stream))


@pytest.mark.parametrize("ctx", ["fork", "forkserver", "launch"])
def test_a_writer_kept_to_the_end_of_a_child_writes_its_points(tmp_path, ctx):
    # Cold trial 30: every point was lost (an empty metrics.csv), exit code 0, no word.
    from machinlike import launch
    from machinlike.process import Process

    if ctx == "launch":
        assert launch(_rank_logs, 2, args=(str(tmp_path),), timeout=60) == [0, 1]
        assert [len(_rows(tmp_path / f"rank{r}" / "metrics.csv")) for r in range(2)] == [30, 30]
        return
    child = Process(target=_log_and_keep, args=(str(tmp_path), 100), ctx=ctx)
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert [float(r["step"]) for r in _rows(tmp_path / "metrics.csv")] == list(range(100))


def test_a_forked_copy_of_a_writer_refuses_points_instead_of_dropping_them(tmp_path):
    import os

    metrics = Metrics(tmp_path, sinks=["csv"])
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only when both calls refused
        code = 1
        try:
            metrics.scalar("a/b", 1.0, 0)
        except RuntimeError as err:
            code = 0 if "forked copy" in str(err) and "make a Metrics in this process" in str(err) else 2
        metrics.close()  # (a forked copy's close leaves the parent's thread and files alone)
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    metrics.scalar("a/b", 2.0, 1)  # the parent's writer is untouched
    metrics.close()
    assert [r["value"] for r in _rows(tmp_path / "metrics.csv")] == ["2.0"]
