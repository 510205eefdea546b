"""A tour of machinlike's pools: lambdas, tensors by copy or by reference, per-worker contexts, crashes.

Run it:  python examples/pool.py [--time-budget 60]

1. ``Pool.apply_async`` and ``Pool.map`` take lambdas and closures (dill carries them by
   value); a map of many small tasks is sent in chunks.
2. A 64 MB CPU tensor is passed in copy mode (the worker edits a copy) and in share mode
   (the worker edits the caller's tensor through shared memory); both are timed.
3. ``CtxPool``: worker ``i`` holds its own model replica and calls ``func(replica_i, x)``.
4. ``ThreadPool`` writes checkpoint shards durably (fsync: the threads wait on the disk,
   and nothing is pickled); ``CtxThreadPool`` gives each thread its own open log file,
   which no process could receive.
5. A worker killed by SIGKILL mid-task fails that task with ``WorkerLostError`` naming the
   worker and the signal; the pool replaces the worker and keeps serving.
6. An exception raised in a worker reaches the caller with its own type, the worker's
   traceback chained as ``__cause__``.

Every wait is bounded by ``--time-budget``. Nothing here is distributed: no World is created.
"""

from __future__ import annotations

import argparse
import os
import pickle
import signal
import tempfile
import threading
import time
from collections import Counter
from contextlib import ExitStack
from typing import Any

import torch

import _util  # the examples' shared plumbing, beside this script
from machinlike.exception import WorkerLostError
from machinlike.pool import CtxPool, CtxThreadPool, Pool, ThreadPool

TENSOR_MB = 64
INPUTS = 24  # inputs scored by the CtxPool replicas
SHARDS, SHARD_KB = 16, 256  # files the ThreadPool writes durably
RECORDS = 300  # lines the CtxThreadPool writes


def first_line(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text.splitlines()[0] if text else ''}"


# ------------------------------------------------------- functions the workers run
# A worker imports this script (as with spawn: hence the __main__ guard at the bottom),
# and these functions run there with the script's globals; lambdas and closures,
# further down, travel by value.


def add_one_and_read(tensor: torch.Tensor) -> float:
    """Edit the tensor in place and report what this worker now sees in it."""
    tensor.add_(1)
    return float(tensor[0])


def make_replica(name: str, seed: int) -> dict[str, Any]:
    """A worker context: a small model (its own weights), a name and a task counter."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 1))
    return {"name": name, "model": model, "served": 0}


def score_on(model: torch.nn.Module, x: int) -> float:
    with torch.no_grad():
        return float(model(torch.full((64, 256), x / INPUTS)).mean())


def predict(replica: dict[str, Any], x: int) -> tuple[str, int, int, float]:
    """Score one input on this worker's own replica (the context comes first)."""
    replica["served"] += 1  # the worker's copy of the context keeps its state between tasks
    return replica["name"], os.getpid(), replica["served"], score_on(replica["model"], x)


def write_durably(path: str, data: memoryview) -> int:
    """Write ``data`` to ``path`` and return once the disk has it (fsync).

    The thread spends that time waiting on the device without the GIL, so the writes of
    several threads overlap.
    """
    with open(path, "wb") as stream:
        written = stream.write(data)
        stream.flush()
        os.fsync(stream.fileno())
    return written


class ConfigError(ValueError):
    """A user-defined exception type: the caller catches it by its own name."""


def parse_port(setting: str) -> int:
    key, _, value = setting.partition("=")
    if not value.isdigit():
        raise ConfigError(f"{key} must be a number, got {value!r}")
    return int(value)


# ------------------------------------------------------------------------ the tour
def functions(wait: float) -> None:
    print("1. lambdas, closures and chunked maps (dill carries functions by value)")
    try:
        pickle.dumps(lambda x: x)
    except (pickle.PicklingError, AttributeError) as err:
        print(f"   the standard pickle refuses a lambda: {first_line(err)}")
    with Pool(2) as pool:
        squared = pool.apply_async(lambda x: x * x, (12,)).get(wait)
        print(f"   apply_async(lambda x: x * x, (12,)).get() -> {squared}")
        scale, offset = 3, 0.5

        def affine(x: int) -> float:  # a closure over two locals of this function
            return scale * x + offset

        print(f"   apply_async(affine, (2,)).get() with scale={scale}, offset={offset} captured -> "
              f"{pool.apply_async(affine, (2,)).get(wait)}")
        n, chunksize = 100_000, 2_000
        # map_async(...).get(timeout) is map(...) with a bound on the wait.
        begin = time.monotonic()
        values = pool.map_async(affine, range(n), chunksize=chunksize).get(wait)
        elapsed = time.monotonic() - begin
        matches = values == [affine(x) for x in range(n)]
        print(f"   map(affine, range({n}), chunksize={chunksize}): {n // chunksize} tasks, "
              f"{elapsed * 1e3:.0f} ms, matches the serial result: {matches}")
        if not matches:
            raise RuntimeError("the pool's map differs from the serial computation")
        pids = set(pool.map_async(lambda _: os.getpid(), range(8), chunksize=1).get(wait))
        print(f"   ran in worker processes {sorted(pids)}, not in this process ({os.getpid()}): "
              f"{os.getpid() not in pids}")


def tensors(wait: float) -> None:
    numel = TENSOR_MB * 2 ** 20 // 4
    print(f"2. a {TENSOR_MB} MB float32 tensor, edited in place by the worker (t.add_(1)) three times")
    modes = [("copy ", {}), ("share", {"is_copy_tensor": False, "share_method": "cpu"})]
    for label, options in modes:
        with Pool(1, **options) as pool:
            # Warm-up: the worker is up and the process's shared-memory path is set up
            # (the first large tensor of a process pays that once), so that the timings
            # below are the transfers alone.
            begin = time.monotonic()
            pool.apply_async(add_one_and_read, (torch.zeros(2 ** 19),)).get(wait)
            warm_ms = (time.monotonic() - begin) * 1e3
            tensor = torch.full((numel,), 0.0)  # written now: no page faults in the timings
            seen: list[float] = []
            times: list[str] = []
            for _ in range(3):
                begin = time.monotonic()
                seen.append(pool.apply_async(add_one_and_read, (tensor,)).get(wait))
                times.append(f"{(time.monotonic() - begin) * 1e3:.0f}")
            here = float(tensor[0])
        print(f"   {label} mode: calls took {', '.join(times)} ms (warm-up with 2 MB: {warm_ms:.0f} ms); "
              f"the worker saw {seen}; the caller's tensor now holds {here}")
    print("   copy mode: every call copies the tensor once and the caller's tensor never changes;")
    print("   share mode: the first call moves the tensor into shared memory, later calls send only a handle")


def contexts(wait: float) -> None:
    print("3. CtxPool: each worker holds its own model replica; func(replica, x) runs on it")
    replicas = [make_replica(f"replica-{i}", seed=i) for i in range(2)]
    with CtxPool(2, worker_contexts=replicas) as pool:
        name = pool.apply_async(lambda replica: replica["name"]).get(wait)
        print(f"   apply_async(lambda replica: replica['name']) -> {name!r}: the worker's context comes first")
        results = pool.map_async(predict, range(INPUTS), chunksize=1).get(wait)
    by_name = {replica["name"]: replica for replica in replicas}
    for x, (name, _, _, score) in enumerate(results):
        expected = score_on(by_name[name]["model"], x)
        if abs(score - expected) > 1e-3 * max(1.0, abs(expected)):
            raise RuntimeError(f"input {x}: {name} answered {score}, its model gives {expected}")
    for name in sorted(by_name):
        mine = [(x, pid, served) for x, (who, pid, served, _) in enumerate(results) if who == name]
        pids = sorted({pid for _, pid, _ in mine})
        print(f"   {name}: {len(mine)} of {INPUTS} inputs, in process(es) {pids}, "
              f"its own task counter reached {max((s for *_, s in mine), default=0)}")
    print(f"   every answer equals the answer of the replica that served it (the replicas differ: "
          f"x=1 gives {score_on(replicas[0]['model'], 1):+.4f} vs {score_on(replicas[1]['model'], 1):+.4f})")
    print(f"   the caller's contexts are untouched (copy mode): served = {[r['served'] for r in replicas]}")


def threads(wait: float, folder: str) -> None:
    print("4. ThreadPool / CtxThreadPool for I/O: nothing is pickled, objects are shared")
    payload = memoryview(os.urandom(SHARDS * SHARD_KB * 1024))
    size = SHARD_KB * 1024
    shards = [(os.path.join(folder, f"shard-{i}.bin"), payload[i * size:(i + 1) * size]) for i in range(SHARDS)]
    begin = time.monotonic()
    for i, (_, data) in enumerate(shards):  # the same writes, one after the other, for comparison
        write_durably(os.path.join(folder, f"serial-{i}.bin"), data)
    serial_s = time.monotonic() - begin
    with ThreadPool(8) as pool:
        begin = time.monotonic()
        # The slices of one buffer go to the threads as they are: no pickling, no copy.
        written = pool.starmap_async(write_durably, shards, chunksize=1).get(wait)
        threaded_s = time.monotonic() - begin
        intact = sum(written) == len(payload)
        for path, data in shards:
            with open(path, "rb") as stream:
                intact = intact and stream.read() == data
        print(f"   write + fsync of {SHARDS} checkpoint shards of {SHARD_KB} KB: serial {serial_s * 1e3:.0f} ms, "
              f"ThreadPool(8) {threaded_s * 1e3:.0f} ms (x{serial_s / threaded_s:.1f}; the threads wait for the "
              f"disk side by side); read back intact: {intact}")
        if not intact:
            raise RuntimeError("a shard written by the thread pool does not hold its data")
        lock = threading.Lock()  # a process pool could not even pickle this
        returned = pool.apply_async(lambda: lock).get(wait)
        print(f"   a task returns the caller's own lock object, not a copy: {returned is lock}")

    # The first three records meet at a barrier: a thread waiting there cannot take
    # another task, so each of the three threads writes at least one record.
    meet = threading.Barrier(3, timeout=wait)

    def write_record(log: Any, n: int) -> str:
        if n < 3:
            meet.wait()
        log.write(f"record {n}\n")  # only this thread writes to this file: no lock needed
        return os.path.basename(log.name)

    with ExitStack() as files:  # the contexts are this function's own file objects
        logs = [files.enter_context(open(os.path.join(folder, f"thread-{i}.log"), "w")) for i in range(3)]
        with CtxThreadPool(3, worker_contexts=logs) as pool:
            written = Counter(pool.map_async(write_record, range(RECORDS), chunksize=1).get(wait))
            pool.close()
            pool.join(wait)
    lines = {}
    for log in logs:
        with open(log.name) as stream:
            lines[os.path.basename(log.name)] = sum(1 for _ in stream)
    print(f"   CtxThreadPool(3), one open log file per thread: the tasks reported {dict(sorted(written.items()))}")
    print(f"   read back from disk: {lines}, total {sum(lines.values())} of {RECORDS} records, "
          f"every file written: {all(lines.values())}")


def crash(wait: float) -> None:
    print("5. a worker killed by SIGKILL in the middle of its task")
    with Pool(2) as pool:
        doomed = pool.apply_async(lambda: os.kill(os.getpid(), signal.SIGKILL))
        bystanders = [pool.apply_async(lambda x: x * x, (i,)) for i in range(6)]
        try:
            doomed.get(wait)
        except WorkerLostError as err:
            lost = err
            print(f"   doomed.get() raised {first_line(err)}")
            print(f"   err.name={err.name!r}  err.pid={err.pid}  err.exitcode={err.exitcode}  "
                  f"err.signal_name={err.signal_name!r}")
        else:
            raise RuntimeError("a task whose worker was killed reported success")
        print(f"   the tasks submitted beside it still complete: {[r.get(wait) for r in bystanders]}")
        pids = set(pool.map_async(lambda _: os.getpid(), range(16), chunksize=1).get(wait))
        print(f"   the pool keeps serving: a new map ran on workers {sorted(pids)}; "
              f"the dead worker {lost.pid} is among them: {lost.pid in pids}; size() = {pool.size()}")


def remote_exception(wait: float) -> None:
    print("6. an exception raised in a worker keeps its type; the worker's traceback is its __cause__")
    with Pool(1) as pool:
        try:
            pool.apply_async(parse_port, ("port=eighty",)).get(wait)
        except ConfigError as err:  # the script's own exception class, caught by name
            cause = err.__cause__
            frames = [line.strip() for line in str(cause).splitlines() if line.strip().startswith("File ")]
            print(f"   caught {type(err).__name__}, the very class of this script: {type(err) is ConfigError}; "
                  f"message: {err}")
            print(f"   __cause__ is {type(cause).__name__}; its first line: {str(cause).splitlines()[0]}")
            print(f"   and the frame that raised: {frames[-1] if frames else '?'}")
        print(f"   the worker that raised serves on: parse_port('port=8080') -> "
              f"{pool.apply_async(parse_port, ('port=8080',)).get(wait)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-budget", type=_util.positive_float, default=60.0,
                        help="limit of every wait, in seconds (default 60)")
    args = parser.parse_args()
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="machinlike-pool-tour-") as folder:
        functions(args.time_budget)
        tensors(args.time_budget)
        contexts(args.time_budget)
        threads(args.time_budget, folder)
        crash(args.time_budget)
        remote_exception(args.time_budget)
    print(f"done in {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
