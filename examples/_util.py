"""Plumbing shared by the example scripts: common arguments, the learning curve, launching.

Not part of the library: the examples import it from their own folder.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import faulthandler
import math
import os
import signal
import sys
import time
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence

import torch

import machinlike


def _checked(convert: Callable[[str], Any], ok: Callable[[Any], bool], allowed: str) -> Callable[[str], Any]:
    """An argparse ``type``: ``convert(text)`` when it is a finite number and ``ok``, else
    argparse's error, which names the flag (``argument --steps: must be an integer >= 1, got '0'``)."""

    def check(text: str) -> Any:
        try:
            value = convert(text)
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {allowed}, got {text!r}")
        return value

    check.__name__ = allowed
    return check


# The examples' numeric flags take one of these as their argparse ``type``: a bad value is
# refused while parsing, before any process starts, in a message naming the flag.
positive_int = _checked(int, lambda v: v >= 1, "an integer >= 1")
non_negative_int = _checked(int, lambda v: v >= 0, "an integer >= 0")
positive_float = _checked(float, lambda v: v > 0, "a number > 0")
non_negative_float = _checked(float, lambda v: v >= 0, "a number >= 0")
fraction = _checked(float, lambda v: 0 <= v <= 1, "a number in [0, 1]")
open_fraction = _checked(float, lambda v: 0 < v < 1, "a number in (0, 1), 0 and 1 excluded")
number = _checked(float, lambda v: True, "a finite number")


class _Parser(argparse.ArgumentParser):
    """The training examples' parser: refuses, as argparse does, the common options that
    cannot go together."""

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace: Any = None) -> Any:  # type: ignore[override]
        parsed = super().parse_args(args, namespace)
        # A Ray run has no launcher of ours to kill ranks and restart them: refused rather
        # than a whole run without the kills asked for.
        if parsed.chaos is not None and parsed.engine == "ray":
            self.error("--chaos needs --engine local: the launcher that kills and restarts ranks is the local "
                       "engine's (Ray actors are not restarted)")
        launcher = machinlike.distributed.external_launcher()  # (as launch() tells)
        if parsed.chaos is not None and launcher is not None:
            self.error(f"--chaos needs the local engine's launcher, which kills and restarts ranks, but {launcher} "
                       f"started this process: run it as `python {os.path.basename(sys.argv[0])} --chaos ...` "
                       f"without {launcher}")
        return parsed


def parser(description: str, *, workers: int, budget: float, out: str) -> argparse.ArgumentParser:
    """An argument parser with the options every training example takes."""
    p = _Parser(description=description)
    p.add_argument("--num-workers", type=positive_int, default=workers,
                   help=f"worker processes besides the learner/server (default {workers})")
    p.add_argument("--time-budget", type=positive_float, default=budget,
                   help=f"stop training after this many seconds (default {budget:g})")
    p.add_argument("--seed", type=non_negative_int, default=0, help="random seed (default 0)")
    p.add_argument("--out", default=out, help=f"learning-curve CSV path; a PNG goes beside it (default {out})")
    p.add_argument("--engine", choices=("local", "ray"), default="local",
                   help="where the ranks run: local processes, or Ray actors (default local; under "
                        "torchrun or srun the ranks are theirs whatever this says)")
    p.add_argument("--ray-address", default=None,
                   help="Ray cluster for --engine ray ('host:port' or 'auto'; default: a new local Ray)")
    p.add_argument("--ray-cpus", type=positive_float, default=1.0,
                   help="CPUs each rank reserves on Ray (default 1; fractions share a core)")
    p.add_argument("--logdir", default=None,
                   help="folder of the run's metrics (TensorBoard event files, metrics.csv, metrics.png; "
                        "default: --out without its extension, e.g. runs/<name>; <out>.metrics for an --out "
                        "without one); a run first removes those "
                        "files of an earlier run there: pass another --logdir to keep runs apart")
    p.add_argument("--metrics-every", type=positive_float, default=1.0,
                   help="seconds between metric points (> 0; default 1)")
    p.add_argument("--no-metrics", action="store_true", help="write no metrics (the CSV curve stays)")
    p.add_argument("--chaos", type=positive_float, default=None, metavar="SECONDS",
                   help="every SECONDS, SIGKILL a random rank other than the learner/server; the launcher "
                        "restarts it and training goes on (an elastic world; local engine only; torch's C++ "
                        "warnings about the broken connections are off: TORCH_CPP_LOG_LEVEL=ERROR unless set)")
    p.add_argument("--device", type=device_arg, default="cpu",
                   help="where the learner (and an inference server) trains and runs: cpu, cuda, cuda:N, or "
                        "auto (cuda:0 when torch sees a CUDA device, else cpu); actors stay on the CPU "
                        "(default cpu)")
    return p


def check_device(value: str, device_count: int) -> str:
    """The ``--device`` value ``value`` as a device string (``"cpu"``, ``"cuda:N"``).

    Pure: the caller says how many CUDA devices torch sees, so this is testable anywhere.

    Args:
        value: ``cpu``, ``cuda`` (``cuda:0``), ``cuda:N`` or ``auto``.
        device_count: CUDA devices visible to torch here (``torch.cuda.device_count()``).

    Raises:
        ValueError: not a device, not a CPU or CUDA device, or a CUDA device that does not
            exist here; the message names the value and the fix.
    """
    if value == "auto":
        return "cuda:0" if device_count > 0 else "cpu"
    try:
        device = torch.device(value)
    except (RuntimeError, TypeError, ValueError):
        raise ValueError(f"{value!r} is not a device: use cpu, cuda, cuda:N or auto") from None
    if device.type == "cpu":
        return "cpu"
    if device.type != "cuda":
        raise ValueError(f"{value!r} is a {device.type} device; the examples train on cpu or cuda: use cpu, "
                         f"cuda, cuda:N or auto")
    index = 0 if device.index is None else device.index
    if device_count == 0:
        raise ValueError(f"{value!r}: torch sees no CUDA device here (torch {torch.__version__}, "
                         f"{'a CUDA build' if torch.version.cuda else 'a CPU-only build'}); use --device cpu, or "
                         f"--device auto to take a GPU only where there is one")
    if index >= device_count:
        raise ValueError(f"{value!r}: no such device, torch sees {device_count} CUDA device(s) "
                         f"(cuda:0..cuda:{device_count - 1}, numbered after CUDA_VISIBLE_DEVICES); pick one "
                         f"of them or use --device auto")
    return f"cuda:{index}"


def device_arg(value: str) -> str:
    """argparse ``type`` of ``--device``: the checked device string (see :func:`check_device`).

    Checked while parsing, in the launching process, before any rank starts; argparse's
    message names the flag. ``torch.cuda.device_count`` asks NVML first, so the
    launcher does not create a CUDA context of its own.
    """
    try:
        return check_device(value, 0 if value == "cpu" else torch.cuda.device_count())
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def reuse_large_buffers() -> bool:
    """Have glibc's malloc keep freed large blocks for reuse instead of unmapping them.

    Why: glibc hands blocks of more than 32 MiB (its largest dynamic mmap threshold) to
    ``mmap`` and gives them back with ``munmap`` when freed. A learner step on a batch of
    Atari frames allocates several such blocks (the float frames alone are 60 MB at 528
    frames), so every step paid the page faults of fresh zeroed pages and a TLB shootdown
    per unmap in a process of many threads. Measured on the 2-core development machine:
    converting 528 frames to float 87 -> 19 ms, and the Atari learner thread's CPU time
    per 512-sample step 0.53 -> 0.41 s.
    Cost: the process keeps its peak heap (a few hundred MB for the Atari learner).

    Returns:
        Whether the settings took (False off glibc: nothing is changed).
    """
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): leave the allocator alone
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # <malloc.h>
    return bool(mallopt(m_mmap_threshold, 1 << 30)) and bool(mallopt(m_trim_threshold, 1 << 30))


def to_device(trajectory: Dict[str, Any], device: str) -> Dict[str, Any]:
    """``trajectory`` with its tensors on ``device`` (other values as they are)."""
    if device == "cpu":
        return trajectory
    return {key: value.to(device, non_blocking=True) if isinstance(value, torch.Tensor) else value
            for key, value in trajectory.items()}


class MemberLog:
    """A ``world.on_member_change`` callback: prints a line when a member is lost or rejoins
    and counts both (``losses``, ``rejoins``) for the example's summary."""

    def __init__(self, role: str) -> None:
        self.role = role
        self.losses = 0
        self.rejoins = 0

    def __call__(self, event: Any) -> None:
        if event.kind == "lost":
            self.losses += 1
            print(f"[{self.role}] member {event.member!r} (incarnation {event.incarnation}) was lost", flush=True)
        elif event.kind == "join" and event.incarnation > 1:
            self.rejoins += 1
            print(f"[{self.role}] member {event.member!r} rejoined (incarnation {event.incarnation})", flush=True)


def member_printer(world: Any, role: str) -> MemberLog:
    """Subscribe a :class:`MemberLog` to ``world``'s member changes and return it."""
    show = MemberLog(role)
    world.on_member_change(show)
    return show


def after_host(world: Any, gate: "ReadyGate", host: str, who: str, host_role: str,
               build: Callable[[], Any]) -> Any:
    """``build()`` once ``host`` has opened ``gate`` (its services exist); None, said
    aloud, when the host finished before this member could start.

    Args:
        who: How this member calls itself in messages (``"worker"``).
        host_role: How the host is called (``"learner"``).
    """
    late = f"[{who} {world.name}] the {host_role} finished before this {who} could start"
    try:
        world.wait_for_members([host], timeout=60.0)
        # The host may be a member still building its services: wait until it says they exist.
        if not gate.wait(host, timeout=60.0):
            print(late, flush=True)
            return None
        return build()
    except (ValueError, TimeoutError):
        if world.get_incarnation(host) is None:
            print(late, flush=True)
            return None  # restarted after the host finished
        raise


class ReadyGate:
    """An elastic world's start line: members that join at any time wait, without polling,
    until a host has set up its services, and do not start once it is finishing.

    Two values the host pairs: ``<key>/open`` once its services exist (:meth:`open`), and
    ``<key>/closed`` once it is finishing (:meth:`close`). A member waits for the first
    with ``group.wait_paired`` (the store wakes it; a host that left the world took its
    values along, which ends the wait by name) and starts only while the second is not
    paired.
    """

    def __init__(self, world: Any, group: Any, key: str) -> None:
        self.world, self.group = world, group
        self._open, self._closed = f"{key}/open", f"{key}/closed"

    def open(self) -> None:
        """Host: its services exist; members, present and future, may start."""
        self.group.pair(self._open, True)

    def close(self) -> None:
        """Host: it is finishing; members that arrive from now on do not start."""
        self.group.pair(self._closed, True)

    def wait(self, host: str, timeout: float) -> bool:
        """Member: block until ``host`` opened the gate.

        Returns:
            True once open; False when ``host`` closed it, or left the world first (it
            finished).

        Raises:
            TimeoutError: neither within ``timeout`` seconds.
        """
        from machinlike.exception import PeerLostError

        try:
            self.group.wait_paired(self._open, timeout=timeout)
        except PeerLostError as err:
            if err.member != host:
                raise
            return False  # it paired the value and left: finished
        return not self.group.is_paired(self._closed)


class Curve:
    """A learning curve written to CSV row by row (a crash keeps what was written).

    ``plot()`` draws the PNG beside the CSV when matplotlib is installed (the ``examples``
    extra); without it, it says so and returns None.
    """

    def __init__(self, path: str, columns: Sequence[str]) -> None:
        self.path = path
        self.columns = list(columns)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w", newline="") as stream:
            csv.writer(stream).writerow(self.columns)

    def add(self, **row: Any) -> None:
        with open(self.path, "a", newline="") as stream:
            csv.writer(stream).writerow([row.get(c, "") for c in self.columns])

    def plot(self, x: str, y: Sequence[str], title: str) -> Optional[str]:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed (pip install '.[examples]'): no PNG plot")
            return None
        with open(self.path, newline="") as stream:
            rows = list(csv.DictReader(stream))
        figure, axis = plt.subplots(figsize=(7, 4))
        for column in y:
            points = [(float(r[x]), float(r[column])) for r in rows if r.get(column) not in ("", None)]
            if points:
                axis.plot(*zip(*points), label=column)
        axis.set_xlabel(x)
        axis.set_title(title)
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:  # no rows yet (a short run): no legend, no warning
            axis.legend()
        png = os.path.splitext(self.path)[0] + ".png"
        figure.tight_layout()
        figure.savefig(png, dpi=100)
        plt.close(figure)
        return png


class Progress:
    """Prints at most every ``every`` seconds (and always when forced)."""

    def __init__(self, every: float = 5.0) -> None:
        self.every = every
        self.start = time.monotonic()
        self._last = -every

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def due(self) -> bool:
        now = self.elapsed()
        if now - self._last >= self.every:
            self._last = now
            return True
        return False


def run(worker: Callable[..., Any], world_size: int, args: argparse.Namespace,
        timeout_margin: float = 180.0, chaos_ok: bool = False) -> List[Any]:
    """Run ``worker(world, args)`` on ``world_size`` ranks: spawned locally, as Ray actors
    (``--engine ray``), or in place under torchrun or srun.

    Ctrl-C or a crashed rank stops every process: the launcher kills the rest and the
    error is printed with the failing rank's traceback.

    With ``--chaos SECONDS`` (local engine): the ranks form an elastic world (no
    collectives), rank 0 (the learner/server) is essential, and every SECONDS another rank
    is SIGKILLed and restarted; the restarts are printed at the end.
    """
    # A run that hangs can be asked where (kill -USR1): every thread's stack to stderr, as
    # each rank does already (see machinlike.launch).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    timeout = args.time_budget + timeout_margin
    chaos = getattr(args, "chaos", None)
    if chaos is not None and not chaos_ok:
        raise SystemExit(f"{os.path.basename(sys.argv[0])}: --chaos is not supported by this example yet")
    with interruptible():
        if getattr(args, "engine", "local") == "ray":  # the API tours take no --engine
            if chaos is not None:  # the parser refuses it (see _Parser)
                raise SystemExit(f"{os.path.basename(sys.argv[0])}: --chaos needs --engine local")
            cores = os.cpu_count() or 1
            if args.ray_address is None and "RAY_ADDRESS" not in os.environ and world_size * args.ray_cpus > cores:
                # A new local Ray has this machine's cores: say so before it spends seconds starting.
                raise SystemExit(f"{os.path.basename(sys.argv[0])}: the {world_size} ranks ask for "
                                 f"{world_size * args.ray_cpus:g} CPUs (--ray-cpus {args.ray_cpus:g} each) and a "
                                 f"local Ray has {cores}: --ray-cpus {cores / world_size:g} fits them")
            try:
                return machinlike.launch_ray(worker, world_size, args=(args,), timeout=timeout,
                                             address=args.ray_address, resources={"num_cpus": args.ray_cpus})
            except ValueError as err:  # (the cluster is too small for the ranks: say which flag asks less)
                if "need more than the Ray cluster has" not in str(err):
                    raise
                raise SystemExit(f"{os.path.basename(sys.argv[0])}: {err} (each rank asks for --ray-cpus "
                                 f"{args.ray_cpus:g}; --ray-cpus {args.ray_cpus / 2:g} asks half)") from None
        if chaos is not None:
            # Each kill makes torch's RPC agents log the broken connection (two C++ warnings
            # a kill, which the user cannot act on: the kills are the point); the ranks,
            # forked from a server started after this, read the level as torch loads.
            os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
            # Enough restarts for every kill the budget allows (one rank may draw them all).
            restarts = int((args.time_budget + timeout_margin) / chaos) + 2
            results = machinlike.launch(worker, world_size, args=(args,), timeout=timeout,
                                        max_restarts=restarts, essential=[0], chaos=chaos, chaos_seed=args.seed)
            print(f"chaos: {len(results.restarts)} ranks killed and restarted "
                  f"({', '.join(r.name for r in results.restarts) or 'none'})", flush=True)
            # A rank killed after rank 0 (essential) returned is not restarted: launch gives
            # its exception as its result. Its report died with it: None, as for a rank
            # that reported nothing (the summaries skip those).
            for rank, result in enumerate(results):
                if isinstance(result, BaseException):
                    print(f"chaos: rank {rank} was lost after rank 0 finished, without its report "
                          f"({type(result).__name__}: {result})", flush=True)
                    results[rank] = None
            return results
        return machinlike.launch(worker, world_size, args=(args,), timeout=timeout)


def plural(count: int, noun: str, nouns: Optional[str] = None) -> str:
    """``"1 worker"``, ``"3 workers"``: a count with its noun (``nouns``: the plural, when
    not ``noun`` + "s")."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def wall_time(start: float) -> str:
    """The run's wall time: since this process started, its imports included, as
    ``/usr/bin/time`` counts it (README's figures); where ``/proc`` cannot say, since
    ``start`` (a ``time.monotonic()``)."""
    try:
        with open("/proc/self/stat") as stat:
            started = int(stat.read().rpartition(")")[2].split()[19])  # (field 22: clock ticks since boot)
        with open("/proc/uptime") as uptime:
            seconds = float(uptime.read().split()[0]) - started / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        seconds = time.monotonic() - start
    return f"{seconds:.1f} s"


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """Ctrl-C inside ends the example with one line instead of a traceback (exit status
    130): the launcher has stopped every rank by the time the KeyboardInterrupt gets here.
    So does a rank that died without a word (killed, out of memory: exit status 1); one
    that raised keeps its traceback."""
    try:
        yield
    except KeyboardInterrupt:
        print("\ninterrupted: all worker processes were stopped", file=sys.stderr)
        raise SystemExit(130) from None
    except machinlike.ProcessExitedError as err:
        print(f"\nstopped: {err}; the other ranks were stopped, and what was written so far is kept "
              f"(--chaos runs the example through such deaths)", file=sys.stderr)
        raise SystemExit(1) from None


def announce_watch(world: Any, logdir: str, off: bool, who: str) -> None:
    """Print how to watch this run from another terminal (the status view, TensorBoard)."""
    print(f"[{who}] watch it: python -m machinlike status {world.store_address}"
          + ("" if off else f"   |   tensorboard --logdir {logdir}"), flush=True)


def metrics_summary(args: argparse.Namespace, title: str, x: str = "environment steps") -> Dict[str, str]:
    """The summary's metrics line, after drawing ``metrics.png`` (here, in the launching
    process: see :func:`plot_csv`); empty with ``--no-metrics``."""
    if args.no_metrics:
        return {}
    from _metrics import logdir_of, plot_metrics

    logdir = logdir_of(args)
    png = plot_metrics(logdir, title, x)
    return {"metrics (tensorboard --logdir)": logdir + (f", {png}" if png else "")}


def summary(title: str, values: Dict[str, Any]) -> None:
    width = max(len(k) for k in values)
    print(f"== {title}")
    for key, value in values.items():
        print(f"   {key:<{width}}  {value}")


def plot_csv(path: str, x: str, y: Sequence[str], title: str) -> Optional[str]:
    """``Curve.plot`` of a curve CSV that another process wrote (read, not started afresh).

    The training examples write their curve on rank 0 and draw it here, in the launching
    process, once the ranks are done: importing matplotlib inside a rank would hold up
    every other rank's World shutdown.
    """
    curve = Curve.__new__(Curve)  # not __init__: that would truncate the file
    curve.path = path
    with open(path, newline="") as stream:
        curve.columns = next(csv.reader(stream))
    return curve.plot(x, y, title)
