"""Process start-up and event wake-up, side by side with what a user would pick instead.

Run:  python benchmarks/process.py [--quick]

* Process: start a child (in a parent that imported torch), let it import torch and
  return, join it. machinlike's Process (warm forkserver, torch preloaded) against
  ``multiprocessing`` spawn, ``torch.multiprocessing`` spawn and the standard forkserver.
* Events: a thread sets one of several events; the waiter wakes up on "any of them".
  machinlike's OrEvent against a single ``threading.Event`` (the floor) and polling each
  of several ``threading.Event`` objects every millisecond (what machin's OrEvent did).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import threading
import time
from typing import Callable, List

import torch
import torch.multiprocessing as torch_mp

from machinlike.event import Event, OrEvent
from machinlike.process import Process


def child() -> None:
    import torch  # noqa: F401  (what a real worker does first)


def _start_join(make: Callable[[], object], rounds: int) -> List[float]:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        p = make()
        p.start()
        p.join(120)
        times.append(time.perf_counter() - start)
    return times


def _wake(waiter: Callable[[float], object], setter: Callable[[], None], reset: Callable[[], None],
          rounds: int) -> float:
    """Median seconds from set() in another thread to the waiter's return."""
    lags = []
    for _ in range(rounds):
        reset()
        stamp: List[float] = []
        ready = threading.Event()

        def fire() -> None:
            ready.wait()
            stamp.append(time.perf_counter())
            setter()

        t = threading.Thread(target=fire, name="machinlike-bench-setter")
        t.start()
        ready.set()
        waiter(5.0)
        lags.append(time.perf_counter() - stamp[0])
        t.join()
    return statistics.median(lags)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    args = parser.parse_args()
    rounds = 3 if args.quick else 8
    assert torch.ones(1).sum() == 1  # the parent has torch loaded and used, as in real jobs

    spawn = multiprocessing.get_context("spawn")
    forkserver = multiprocessing.get_context("forkserver")
    torch_spawn = torch_mp.get_context("spawn")
    contenders = {
        "machinlike Process (warm)": lambda: Process(target=child),
        "multiprocessing spawn": lambda: spawn.Process(target=child),
        "torch.multiprocessing spawn": lambda: torch_spawn.Process(target=child),
        "multiprocessing forkserver": lambda: forkserver.Process(target=child),
    }
    first = {name: _start_join(make, 1)[0] for name, make in contenders.items()}
    later = {name: statistics.median(_start_join(make, rounds)) for name, make in contenders.items()}
    ours = later["machinlike Process (warm)"]
    print(f"{'process start+join (s)':<30}  {'first':>7}  {'later':>7}  {'later vs ours':>13}")
    for name in contenders:
        print(f"{name:<30}  {first[name]:>7.3f}  {later[name]:>7.3f}  {later[name] / ours:>12.1f}x")

    wake_rounds = 50 if args.quick else 300
    floor_event = threading.Event()
    floor = _wake(floor_event.wait, floor_event.set, floor_event.clear, wake_rounds)
    children = [Event() for _ in range(4)]
    either = OrEvent(*children)

    def reset_ours() -> None:
        for e in children:
            e.clear()

    ours_lag = _wake(either.wait, children[2].set, reset_ours, wake_rounds)
    plain = [threading.Event() for _ in range(4)]

    def poll(timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(e.is_set() for e in plain):
                return True
            time.sleep(0.001)
        return False

    def reset_plain() -> None:
        for e in plain:
            e.clear()

    poll_lag = _wake(poll, plain[2].set, reset_plain, wake_rounds)
    print()
    print(f"{'wake-up after set() (us)':<30}  {'median':>7}  {'vs ours':>8}")
    print(f"{'threading.Event (one event)':<30}  {floor * 1e6:>7.1f}  {floor / ours_lag:>7.2f}x")
    print(f"{'machinlike OrEvent of 4':<30}  {ours_lag * 1e6:>7.1f}  {1:>7.2f}x")
    print(f"{'polling 4 Events every 1 ms':<30}  {poll_lag * 1e6:>7.1f}  {poll_lag / ours_lag:>7.2f}x")


if __name__ == "__main__":
    main()
