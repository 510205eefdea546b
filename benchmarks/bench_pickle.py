"""Round-trip cost (dumps + loads in one process) of machinlike.pickle and its peers.

Peers: the standard ``pickle`` (protocol 5), ``dill``, and torch's multiprocessing
pickler (``ForkingPickler`` with the reducers ``import torch`` registers, which is what
``torch.multiprocessing.Queue`` uses). A peer that cannot do a case (the standard pickler
and lambdas; ``ForkingPickler`` only shares tensors, the others only copy them) shows
``n/a``. Ratios are peer time / machinlike time: above 1 means machinlike is faster.

The "lambda" and "closure" rows send the same function again and again, as a pool or an
RPC caller does; machinlike then reuses the bytes of functions whose state is immutable.
"closure, uncached" closes over a list, which rules that out: every call runs dill.

Run: ``python benchmarks/bench_pickle.py`` (``--quick`` for fewer repetitions). The file is
not called ``pickle.py`` on purpose: run as a script, its directory comes first on
``sys.path`` and would shadow the standard ``pickle`` module.
"""

from __future__ import annotations

import argparse
import gc
import pickle
import time
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Dict, Optional

import dill
import torch

from machinlike import pickle as mpickle

MB64 = 64 * 1024 * 1024 // 4  # float32 elements in 64 MB


def make_scaler(factor: float) -> Callable[[float], float]:
    return lambda x: x * factor


def per_op(fn: Callable[[], Any], number: int, repeat: int) -> float:
    """Best-of-``repeat`` mean seconds per call over ``number`` calls."""
    fn()  # warm-up: first-use costs (moving a tensor to shared memory) are not steady state
    best = float("inf")
    for _ in range(repeat):
        gc.collect()
        begin = time.perf_counter()
        for _ in range(number):
            fn()
        best = min(best, (time.perf_counter() - begin) / number)
    return best


def round_trips(case: str) -> Dict[str, Optional[Callable[[], Any]]]:
    """The four contenders' round-trip callables for one case (None: cannot do it)."""
    if case == "small tuple":
        obj: Any = (1, 2.0, "abc", (3, 4))
        return {
            "machinlike": lambda: mpickle.loads(mpickle.dumps(obj)),
            "pickle": lambda: pickle.loads(pickle.dumps(obj, protocol=5)),
            "dill": lambda: dill.loads(dill.dumps(obj)),
            "ForkingPickler": lambda: pickle.loads(ForkingPickler.dumps(obj)),
        }
    if case in ("lambda", "closure", "closure, uncached"):
        fn = {
            "lambda": lambda x: x + 1,
            "closure": make_scaler(3.0),
            "closure, uncached": make_scaler([3.0]),  # a list in the closure: no byte cache
        }[case]
        return {
            "machinlike": lambda: mpickle.loads(mpickle.dumps(fn)),
            "pickle": None,
            "dill": lambda: dill.loads(dill.dumps(fn)),
            "ForkingPickler": None,
        }
    if case == "64 MB tensor, copy":
        t = torch.rand(MB64)
        return {
            "machinlike": lambda: mpickle.loads(mpickle.dumps(t, copy_tensor=True)),
            "pickle": lambda: pickle.loads(pickle.dumps(t, protocol=5)),
            "dill": lambda: dill.loads(dill.dumps(t)),
            "ForkingPickler": None,
        }
    if case == "64 MB tensor, share":
        # separate tensors: whoever shares a tensor first decides its shared-memory kind
        ours, theirs = torch.rand(MB64), torch.rand(MB64)
        return {
            "machinlike": lambda: mpickle.loads(mpickle.dumps(ours, copy_tensor=False)),
            "pickle": None,
            "dill": None,
            "ForkingPickler": lambda: pickle.loads(ForkingPickler.dumps(theirs)),
        }
    raise ValueError(case)


CASES = {  # case: (calls per timing, repetitions)
    "small tuple": (20000, 5),
    "lambda": (2000, 5),
    "closure": (2000, 5),
    "closure, uncached": (300, 5),
    "64 MB tensor, copy": (5, 3),
    "64 MB tensor, share": (200, 3),
}


def fmt_time(seconds: Optional[float]) -> str:
    if seconds is None:
        return "n/a"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.2f} us"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions")
    options = parser.parse_args()
    peers = ["pickle", "dill", "ForkingPickler"]
    header = f"{'case':<22}{'machinlike':>12}" + "".join(f"{p:>16}" for p in peers)
    header += "".join(f"{p + '/ours':>20}" for p in peers)
    print(header)
    print("-" * len(header))
    for case, (number, repeat) in CASES.items():
        if options.quick:
            number, repeat = max(1, number // 10), 2
        timings = {
            name: None if fn is None else per_op(fn, number, repeat) for name, fn in round_trips(case).items()
        }
        ours = timings["machinlike"]
        row = f"{case:<22}{fmt_time(ours):>12}" + "".join(f"{fmt_time(timings[p]):>16}" for p in peers)
        row += "".join(
            f"{'n/a' if timings[p] is None else f'{timings[p] / ours:.2f}x':>20}" for p in peers
        )
        print(row, flush=True)


if __name__ == "__main__":
    main()
