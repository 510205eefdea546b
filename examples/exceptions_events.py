"""A tour of failure reporting and waiting: Process / Thread outcomes, watch(), cleaners, OrEvent / AndEvent.

Run it:  python examples/exceptions_events.py [--num-workers 3]

1. Five child processes end five ways (return, raise, sys.exit, os._exit, SIGKILL from
   outside); ``Process.exception`` tells them apart.
2. A supervisor waits on its workers' sentinels and calls ``watch()`` on each one that
   ends: a worker's ZeroDivisionError is re-raised in the parent, with the worker's
   traceback as ``__cause__``.
3. Cleaners run in the child (or thread) after the target, even when it raised.
4. Worker threads signal through ``machinlike.event.Event``; the main thread waits on
   "all finished OR one failed" (``OrEvent(AndEvent(...), failed)``) with one timeout.

Children that raise also print their traceback on stderr, as with ``multiprocessing``;
the tour's own report goes to stdout. Nothing here is distributed: no World is created.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from multiprocessing.connection import wait
from typing import Dict, List

import _util  # the examples' shared plumbing, beside this script
from machinlike.event import AndEvent, Event, OrEvent
from machinlike.exception import ProcessExitedError
from machinlike.process import Process
from machinlike.queue import SimpleQueue
from machinlike.thread import Thread


def first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def cause_summary(exc: BaseException) -> str:
    """The header and the last frame of a remote traceback chained as ``__cause__``."""
    cause = exc.__cause__
    if cause is None:
        return "no remote traceback (the process could not say anything)"
    lines = [line for line in str(cause).splitlines() if line.strip()]
    frames = [line.strip() for line in lines if line.strip().startswith("File ")]
    return f"{lines[0]} ... {frames[-1] if frames else ''}"


# -------------------------------------------------------------- child targets
def parse_port(text: str) -> int:
    key, _, value = text.partition("=")
    return int(value)  # "eighty" is no number: ValueError in the child


def wait_until_released(ready: SimpleQueue, release: SimpleQueue, timeout: float) -> None:
    ready.put(os.getpid())
    release.get(timeout=timeout)  # the parent kills us long before this returns


def harmonic_sum(values: List[int]) -> float:
    return sum(1.0 / v for v in values)


def fill_scratch(path: str) -> None:
    with open(path, "w") as scratch:
        scratch.write("half-written results")
    raise RuntimeError(f"the job failed after creating {os.path.basename(path)}")


def remove_scratch(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)


# ------------------------------------------------------------------ the tour
def outcomes(timeout: float) -> None:
    print("1. five children, five ways to end (Process.exception tells them apart)")
    ready, release = SimpleQueue(), SimpleQueue()
    children: Dict[str, Process] = {
        "returns": Process(target=harmonic_sum, args=([1, 2, 4],), name="returns"),
        "raises": Process(target=parse_port, args=("port=eighty",), name="raises"),
        "sys.exit(3)": Process(target=lambda: sys.exit(3), name="sys.exit"),  # lambdas work as targets
        "os._exit(7)": Process(target=lambda: os._exit(7), name="os._exit"),
        "SIGKILL": Process(target=wait_until_released, args=(ready, release, timeout), name="killed"),
    }
    for child in children.values():
        child.start()
    victim = ready.get(timeout=timeout)  # it is running: kill it the way the OOM killer would
    os.kill(victim, signal.SIGKILL)
    for how, child in children.items():
        child.join(timeout)
        error = child.exception
        if error is None:
            print(f"   {how:<12} exit code {child.exitcode:>3}  exception None")
            continue
        extra = f", signal {error.signal_name}" if isinstance(error, ProcessExitedError) and error.signal_name else ""
        print(f"   {how:<12} exit code {child.exitcode:>3}  {first_line(error)}{extra}")
        print(f"   {'':<12} cause: {cause_summary(error)}")
        child.close()
    release.close()
    ready.close()


def supervise(workers: int, timeout: float) -> None:
    print(f"2. a supervisor watches {workers} workers; worker 1 meets a zero")
    jobs = [[1, 2, 3], [4, 0, 5]] + [[k + 1, k + 2] for k in range(2, workers)]
    procs = [Process(target=harmonic_sum, args=(jobs[i],), name=f"worker-{i}") for i in range(workers)]
    for p in procs:
        p.start()
    running = {p.sentinel: p for p in procs}
    deadline = time.monotonic() + timeout
    while running:
        ended = wait(list(running), timeout=max(0.0, deadline - time.monotonic()))
        if not ended:
            raise TimeoutError(f"workers {[p.name for p in running.values()]} did not end within {timeout:g} s")
        for sentinel in ended:
            p = running.pop(sentinel)
            p.join(timeout)
            try:
                p.watch()  # raises the worker's exception here, if it had one
                print(f"   {p.name} finished cleanly")
            except ZeroDivisionError as err:
                print(f"   {p.name} failed: caught {first_line(err)} in the parent")
                print(f"   {'':<8} its traceback: {cause_summary(err)}")
            p.close()


def cleaners(timeout: float) -> None:
    print("3. cleaners run after the target, even when it raised")
    path = os.path.join(tempfile.gettempdir(), f"machinlike-tour-{os.getpid()}.scratch")
    p = Process(target=fill_scratch, args=(path,), cleaner=lambda: remove_scratch(path), name="cleaned")
    p.start()
    p.join(timeout)
    print(f"   process: {first_line(p.exception)}; scratch file left behind: {os.path.exists(path)}")
    p.close()

    def failing_cleaner() -> None:
        raise OSError("the cleaner could not reach the disk either")

    t = Thread(target=fill_scratch, args=(path,), cleaner=failing_cleaner)
    t.start()
    t.join(timeout)
    error = t.exception  # the very object the target raised (a thread shares our memory)
    print(f"   thread {t.name!r}: {first_line(error)}")
    print(f"   {'':<8} the cleaner's failure is kept as a note: {getattr(error, '__notes__', [])}")
    remove_scratch(path)


def events(workers: int, timeout: float) -> None:
    print(f"4. events: wait for all {workers} threads OR the first failure, with one timeout")
    try:
        OrEvent(threading.Event())
    except TypeError as err:
        print(f"   a plain threading.Event is refused: {str(err).split(';')[1].strip()}")

    def run_round(fail: bool) -> None:
        done = [Event() for _ in range(workers)]
        failed, release = Event(), Event()
        all_done = AndEvent(*done)
        finished_or_failed = OrEvent(all_done, failed)

        failed_by: List[int] = []

        def work(index: int) -> None:
            if fail and index == workers - 1:
                raise ValueError(f"thread {index} found corrupt input")
            if fail and not release.wait(timeout):  # the others are slow: they wait to be released
                raise TimeoutError("never released")

        def job(index: int) -> None:
            try:
                work(index)
            except BaseException:
                failed_by.append(index)  # before set(): whoever wakes up finds the culprit
                failed.set()
                raise

        # The cleaner sets the thread's done event, also when its target raised.
        threads = [Thread(target=job, args=(i,), cleaner=done[i].set) for i in range(workers)]
        begin = time.monotonic()
        for t in threads:
            t.start()
        if not finished_or_failed.wait(timeout):
            raise TimeoutError(f"neither all threads finished nor one failed within {timeout:g} s")
        waited = time.monotonic() - begin
        if all_done.is_set():
            print(f"   round without failures: all {workers} finished; the wait returned after {waited:.3f} s")
        else:
            culprit = threads[failed_by[0]]
            culprit.join(timeout)  # it set `failed` just before its exception left the target
            print(f"   round with a failure: the wait returned after {waited:.3f} s, "
                  f"{sum(d.is_set() for d in done)} of {workers} threads done; {culprit.name} raised "
                  f"{first_line(culprit.exception)}")
            print(f"   AndEvent(release, failed).wait(0.1) -> {AndEvent(release, failed).wait(0.1)} "
                  f"(release is not set: the wait times out)")
            release.set()  # let the others finish
            if not all_done.wait(timeout):
                raise TimeoutError("the released threads did not finish")
            print(f"   after release: all done -> {all_done.is_set()}")
        for t in threads:
            t.join(timeout)

    run_round(fail=False)
    run_round(fail=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--num-workers", type=_util.positive_int, default=3,
                        help="workers in parts 2 and 4 (at least 2; default 3)")
    parser.add_argument("--time-budget", type=_util.positive_float, default=60.0,
                        help="limit of every wait, in seconds (default 60)")
    args = parser.parse_args()
    if args.num_workers < 2:
        parser.error("--num-workers must be at least 2 (one of them fails)")
    start = time.monotonic()
    outcomes(args.time_budget)
    supervise(args.num_workers, args.time_budget)
    cleaners(args.time_budget)
    events(args.num_workers, args.time_budget)
    print(f"done in {time.monotonic() - start:.1f} s")


if __name__ == "__main__":
    main()
