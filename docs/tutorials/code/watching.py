"""Watching a run: a learner writes metrics for TensorBoard while a worker dies and comes back.

Run it:  python docs/tutorials/code/watching.py
then:    tensorboard --logdir /tmp/machinlike_watching
"""

from __future__ import annotations

import csv
import os
import shutil
import signal
import tempfile
import threading

import torch

import machinlike
from machinlike.metrics import Metrics, WorldFigures

LOGDIR = os.path.join(tempfile.gettempdir(), "machinlike_watching")


# [learner]
def learn(world: machinlike.World, logdir: str) -> int:
    rejoined = threading.Event()
    world.on_member_change(lambda e: rejoined.set() if e.kind == "join" and e.incarnation > 1 else None)
    if (world.get_incarnation("1") or 1) > 1:  # back before the line above: its event came earlier
        rejoined.set()
    metrics = Metrics(logdir)  # TensorBoard event files (if installed) and metrics.csv
    figures = WorldFigures(world)  # members alive, deaths, rejoins, each local member's RSS

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(256, 4)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    step = 0
    while step < 200 or not rejoined.is_set():  # train until the worker has come back
        loss = torch.nn.functional.mse_loss(model(x).squeeze(1), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 10 == 0:  # a point every 10 updates: cheap, and enough for a curve
            metrics.scalars({"loss/train": loss.item(), **figures.sample()}, step)
        step += 1
        if step > 100_000:
            raise TimeoutError("the worker did not come back")
    metrics.scalars({"loss/train": loss.item(), **figures.sample()}, step)  # the last point
    figures.close()
    metrics.close()  # writes what is queued, flushes and closes the files
    return step
# [/learner]


def worker(world: machinlike.World, logdir: str) -> object:
    if world.name == "0":
        return learn(world, logdir)
    if world.name == "1" and world.incarnation == 1:
        os.kill(os.getpid(), signal.SIGKILL)  # dies once; the launcher restarts it
    world.wait_for_members(["0"], timeout=60, gone=True)  # stay until the learner is done
    return None


# [main]
def main() -> None:
    shutil.rmtree(LOGDIR, ignore_errors=True)  # the CSV sink appends to an existing file
    results = machinlike.launch(worker, 3, args=(LOGDIR,), max_restarts=1, essential=[0], timeout=120)
    with open(os.path.join(LOGDIR, "metrics.csv"), newline="") as stream:
        last = {row["tag"]: float(row["value"]) for row in csv.DictReader(stream)}
    print(f"{results[0]} updates; loss {last['loss/train']:.4f}; deaths {last['world/deaths']:g}, "
          f"rejoins {last['world/rejoins']:g}; restarts: {[r.name for r in results.restarts]}")
    assert last["world/deaths"] >= 1 and last["world/rejoins"] >= 1 and last["loss/train"] < 0.1
# [/main]


if __name__ == "__main__":
    main()
