"""Parameter-server training: an MLP learns scikit-learn's digits through a gradient server.

Run it locally (spawns the server and the trainers itself):
    python examples/param_server.py
    python examples/param_server.py --num-workers 4 --epochs 40
The managed model, its optimizer and the evaluation on a GPU (trainers stay on the CPU):
    python examples/param_server.py --device cuda
or under torchrun, unchanged (rank 0 serves, the other ranks train):
    torchrun --standalone --nproc-per-node 4 examples/param_server.py

Roles. Rank 0 hosts the primary reducer of a ``PushPullGradServer``: it owns the model and
its Adam optimizer, and evaluates the newest parameters on a held-out test split while
training runs. Every other rank is a trainer and hosts a secondary reducer of the same
server. A trainer takes mini-batches from its shard of the training split, computes
gradients, pushes them and pulls the newest parameters::

    trainer 1 ── push ──► secondary on 1 ─┐  (sums --reduce-batch pushes, forwards)
    trainer 2 ── push ──► secondary on 2 ─┼──► primary on rank 0: Adam step, new version
    trainer 3 ── push ──► secondary on 3 ─┘          │
        ▲                                            ▼
        └─────────── pull (only when a newer version exists) ◄── ordered server

A trainer pushes to the secondary reducer in its own process (no RPC); the secondaries
forward partial sums to the primary, which combines ``--reduce-batch`` of them into one
optimizer step, so each step averages ``--reduce-batch ** 2`` mini-batches ("mean"
reduction). The data set ships with scikit-learn (1797 8x8 images, no download); the
train/test split is fixed (``--seed`` changes it, the model's initialisation and the
mini-batch order; the asynchronous interleaving still varies from run to run).
"""

from __future__ import annotations

import argparse
import signal
import threading
import time
from typing import Any, Dict, List, Optional

import numpy as np
import torch
import torch.nn.functional as F

import _util  # the examples' shared plumbing, beside this script
import machinlike
from _metrics import fresh_logdir, logdir_of
from machinlike.metrics import Metrics, WorldFigures, flatten_stats
from machinlike.server import grad_server_helper

GROUP = "ps"
SERVER = "digits"  # grad_server_helper names the server "digits_0"
ELASTIC_SERVER = f"{SERVER}_0"  # the same name with --chaos: both runs share a --checkpoint-dir


def make_model(hidden: int = 128) -> torch.nn.Module:
    """The classifier: 64 pixels -> hidden -> hidden -> 10 digits."""
    return torch.nn.Sequential(
        torch.nn.Linear(64, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, 10),
    )


def _as_tensors(arrays: Dict[str, np.ndarray]) -> Dict[str, torch.Tensor]:
    """The split as tensors; an array Ray handed over read-only (from its object store) is
    copied first, as torch would warn on sharing it."""
    return {k: torch.from_numpy(v if v.flags.writeable else v.copy()) for k, v in arrays.items()}


def load_digits_split(seed: int) -> Dict[str, np.ndarray]:
    """The digits, scaled to [0, 1], split 80/20 (stratified; fixed for a given seed)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=0.2, random_state=seed, stratify=y)
    return {"x_train": x_train, "y_train": y_train.astype(np.int64),
            "x_test": x_test, "y_test": y_test.astype(np.int64)}


def evaluate(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> tuple:
    """(mean cross-entropy, accuracy) of ``model`` on ``x``, ``y``."""
    with torch.no_grad():
        logits = model(x)
        return F.cross_entropy(logits, y).item(), (logits.argmax(1) == y).float().mean().item()


class Finished:
    """Rank 0's record of the trainers that are done (a registered service fills it)."""

    def __init__(self, trainers: List[str]) -> None:
        self.expected = set(trainers)
        self.reports: Dict[str, Dict[str, Any]] = {}
        self.all_done = threading.Event()
        self._lock = threading.Lock()

    def report(self, member: str, info: Dict[str, Any]) -> None:
        with self._lock:
            self.reports[member] = info
            if self.expected <= set(self.reports):
                self.all_done.set()


def train(world: machinlike.World, server: Any, args: argparse.Namespace, data: Dict[str, torch.Tensor],
          trainers: List[str], group: machinlike.RpcGroup) -> Dict[str, Any]:
    """A trainer: its shard of the training split, ``args.epochs`` times, push and pull."""
    index = trainers.index(world.name)
    shard = torch.arange(index, len(data["y_train"]), len(trainers))
    x, y = data["x_train"], data["y_train"]
    model = make_model(args.hidden)
    server.pull(model)
    generator = torch.Generator().manual_seed(args.seed * 1000 + world.rank)
    deadline = time.monotonic() + args.time_budget
    pushes = rejected = batches = 0
    out_of_time = False
    for _ in range(args.epochs):
        order = shard[torch.randperm(len(shard), generator=generator)]
        for start in range(0, len(order), args.batch_size):
            batch = order[start:start + args.batch_size]
            model.zero_grad(set_to_none=False)
            F.cross_entropy(model(x[batch]), y[batch]).backward()
            if server.push(model, pull=False):
                pushes += 1
            else:  # the local secondary's queue was full: this gradient is not applied
                rejected += 1
            server.pull(model)
            batches += 1
            if time.monotonic() > deadline:
                out_of_time = True
                break
        if out_of_time:
            break
    return {"pushes": pushes, "rejected": rejected, "batches": batches, "out_of_time": out_of_time}


def serve(world: machinlike.World, servers: Any, args: argparse.Namespace, data: Dict[str, torch.Tensor],
          finished: Finished, started: float) -> Dict[str, Any]:
    """Rank 0: evaluate the newest parameters while the trainers train; write the curve."""
    (server,) = servers
    curve = _util.Curve(args.out, ["seconds", "version", "pushes_applied", "epochs", "train_loss",
                                   "test_loss", "test_accuracy"])
    model = make_model(args.hidden).to(args.device)  # the evaluation copy, beside the managed model
    data = {key: value.to(args.device) for key, value in data.items()}
    train_size = len(data["y_train"])
    progress = _util.Progress(args.print_every)
    deadline = time.monotonic() + args.time_budget + 60.0  # the trainers stop at the budget
    last = {"steps": 0, "t": 0.0}
    # The library's writer used directly (the RL examples wrap it in _metrics.RunMetrics):
    # x = pushes applied, the supervised run's "environment steps".
    if not args.no_metrics:
        fresh_logdir(logdir_of(args))  # this run's points only, not an earlier run's before them
    metrics = None if args.no_metrics else Metrics(logdir_of(args))
    figures = None if metrics is None else WorldFigures(world)
    _util.announce_watch(world, logdir_of(args), args.no_metrics, "server")

    def measure(final: bool = False) -> Dict[str, Any]:
        server.pull(model)
        stats = servers.stats()[0]["primary"]
        train_loss, train_acc = evaluate(model, data["x_train"], data["y_train"])
        test_loss, test_acc = evaluate(model, data["x_test"], data["y_test"])
        seconds = time.monotonic() - started
        epochs = stats["applied"] * args.batch_size / train_size
        curve.add(seconds=f"{seconds:.2f}", version=model.pp_grad_version, pushes_applied=stats["applied"],
                  epochs=f"{epochs:.2f}", train_loss=f"{train_loss:.4f}", test_loss=f"{test_loss:.4f}",
                  test_accuracy=f"{test_acc:.4f}")
        last["epochs"] = epochs
        if metrics is not None:
            metrics.scalars({"eval/test_accuracy": test_acc, "eval/test_loss": test_loss, "eval/train_loss": train_loss,
                             "eval/train_accuracy": train_acc, "eval/epochs": epochs,
                             **flatten_stats(stats, "server/primary"), **figures.sample()}, int(stats["applied"]))
        if test_acc >= args.target and "target_at" not in last:
            last["target_at"] = seconds
            print(f"[{seconds:6.1f} s] target test accuracy {100 * args.target:.0f}% reached", flush=True)
        if progress.due() or final:
            rate = (stats["steps"] - last["steps"]) / max(1e-9, seconds - last["t"])
            last.update(steps=stats["steps"], t=seconds)
            print(f"[{seconds:6.1f} s] version {model.pp_grad_version:5d}  pushes applied {stats['applied']:6d}  "
                  f"epoch {epochs:5.1f}  updates/s {rate:6.1f}  lag mean {stats['lag_mean']:.2f} "
                  f"max {stats['lag_max']}  train loss {train_loss:.3f}  test acc {100 * test_acc:5.1f}%",
                  flush=True)
        return {"stats": stats, "train_loss": train_loss, "train_acc": train_acc, "test_loss": test_loss,
                "test_acc": test_acc, "seconds": seconds, "epochs": epochs, "target_at": last.get("target_at")}

    told_to_stop = _stop_on_sigterm(args)
    measure()
    while not finished.all_done.wait(args.eval_every):
        if told_to_stop.is_set():  # a scheduler's stop, preemption, or torchrun restarting the workers
            paths = servers.checkpoint(timeout=30)
            print(f"[{time.monotonic() - started:6.1f} s] told to stop (SIGTERM; a Ctrl-C reaches the ranks as "
                  f"SIGTERM): checkpoint written ({', '.join(paths)}); a run with the same --checkpoint-dir resumes "
                  f"from it", flush=True)
            raise SystemExit(128 + signal.SIGTERM)
        if args.chaos is not None and (last.get("epochs", 0.0) >= args.epochs
                                       or time.monotonic() - started >= args.time_budget):
            # With chaos the run ends once --epochs epochs of pushes are applied, or at the
            # budget: a restarted trainer's own clock starts again, so the server keeps it.
            break
        if time.monotonic() > deadline:
            missing = sorted(finished.expected - set(finished.reports))
            raise TimeoutError(f"trainers {missing} did not finish within the time budget plus 60 s")
        servers.watch()  # a failed reducer thread ends the run with its own error
        if not world.elastic:  # (srun, unlike torchrun and launch(), lets the other tasks run on)
            lost = sorted(finished.expected - set(finished.reports) - set(world.get_members()))
            if lost:
                raise RuntimeError(f"trainers {lost} died before they finished, and a static world cannot take them "
                                   f"back: start the job again (under srun, --kill-on-bad-exit ends every task "
                                   f"at the first failure; torchrun --max-restarts restarts the workers)")
        measure()
    server.flush()  # apply every push still queued, partial batches included
    final = measure(final=True)
    if metrics is not None:
        figures.close()
        metrics.close()
    final["trainers"] = dict(sorted(finished.reports.items(), key=lambda kv: int(kv[0])))
    final["cpu"] = time.process_time() + sum(t["cpu"] for t in finished.reports.values())
    return final


def _stop_on_sigterm(args: argparse.Namespace) -> threading.Event:
    """With --checkpoint-dir: an event SIGTERM sets, so that the server writes its
    checkpoint before it goes (without, SIGTERM ends the process at once, as by default)."""
    told = threading.Event()
    if args.checkpoint_dir is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: told.set())
    return told


class _Hosted:
    """The server's handles in an elastic run, shaped as ``serve()`` expects them."""

    def __init__(self, impl: Any, accessor: Any) -> None:
        self.impl, self.accessor = impl, accessor

    def __iter__(self) -> Any:
        return iter([self.accessor])

    def stats(self) -> List[Dict[str, Any]]:
        return [self.impl.stats()]

    def watch(self) -> None:
        self.impl.watch()

    def checkpoint(self, timeout: float) -> List[str]:
        return [self.impl.checkpoint(timeout)] if self.impl.checkpoint_path is not None else []


def worker_elastic(world: machinlike.World, args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    """``--chaos``: an elastic world where trainers die (SIGKILL) and come back.

    Rank 0 ("0") is essential. Each trainer hosts a secondary reducer; one that dies takes
    its queued pushes with it (the server counts them as dropped) and its replacement
    rejoins the running server and trains its shard again. A trainer, first or restarted,
    waits at a :class:`_util.ReadyGate` that rank 0 opens once the server exists. The run
    ends once ``--epochs`` epochs of pushes were applied (or every trainer finished its epochs).
    """
    from machinlike.exception import PeerLostError
    from machinlike.server import PushPullGradServerImpl

    torch.set_num_threads(1)
    started = time.monotonic()
    data = _as_tensors(args.data)
    server_member, trainers = "0", [str(r) for r in range(1, args.num_workers + 1)]
    options = dict(primary_reducer=server_member, reduce_method="mean", reduce_batch_size=args.reduce_batch,
                   max_queue_size=args.max_queue, checkpoint_dir=args.checkpoint_dir)
    group = world.create_rpc_group(GROUP)  # open: a restarted trainer rejoins at once
    gate = _util.ReadyGate(world, group, f"{GROUP}/ready")
    if world.name == server_member:
        _util.member_printer(world, "server")
        finished = Finished(trainers)
        group.register("done", finished.report)
        torch.manual_seed(args.seed)
        impl = PushPullGradServerImpl(ELASTIC_SERVER, group, **options)
        model = make_model(args.hidden).to(args.device)
        impl.manage_model(model, torch.optim.Adam(model.parameters(), lr=args.lr))
        impl.start()
        print(f"digits: {len(data['y_train'])} training and {len(data['y_test'])} test images; "
              f"{len(trainers)} trainers, server on rank 0 ({args.device}), chaos every {args.chaos:g} s", flush=True)
        accessor = group.get_paired(ELASTIC_SERVER).to_here()
        gate.open()  # the server and the "done" service exist: trainers may start
        result = serve(world, _Hosted(impl, accessor), args, data, finished, started)
        gate.close()
        result["members"] = impl.stats()["members"]
        result["dropped"] = impl.stats()["primary"]["dropped_dead_reducer"]
        impl.close()
        return result
    if world.membership.gone(server_member):
        return None  # restarted after the server finished
    impl = _util.after_host(world, gate, server_member, "trainer", "server",
                            lambda: PushPullGradServerImpl(ELASTIC_SERVER, group, **options))
    if impl is None:
        return None
    impl.start()
    info: Dict[str, Any] = {"incarnation": world.incarnation}
    try:
        info.update(train(world, group.get_paired(ELASTIC_SERVER, timeout=60.0).to_here(), args, data, trainers, group))
        info["secondary"] = impl.stats()["secondary"]
        info["cpu"] = time.process_time()
        group.registered_sync("done", (world.name, info))
        # Stay (hosting the secondary) until the server has flushed it and left.
        world.wait_for_members([server_member], timeout=args.time_budget + 120.0, gone=True)
    except PeerLostError as err:
        if err.member != server_member:
            raise
    except KeyError:  # past the gate, a missing service means the server withdrew it: finishing
        print(f"[trainer {world.name}] stopped: the server finished (it withdrew its services)", flush=True)
    impl.close()
    return None


def worker(world: machinlike.World, args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    if world.elastic:
        return worker_elastic(world, args)
    torch.set_num_threads(1)  # 2 cores shared by every rank
    if world.world_size < 2:
        raise ValueError(f"param_server needs at least 2 processes (a server and a trainer), got "
                         f"{world.world_size}")
    started = time.monotonic()
    data = _as_tensors(args.data)
    members = world.get_members()
    server_member, trainers = members[0], members[1:]
    group = world.create_rpc_group(GROUP, members)
    finished = Finished(trainers)
    if world.name == server_member:
        group.register("done", finished.report)
        torch.manual_seed(args.seed)  # the managed model's initial weights
        print(f"digits: {len(data['y_train'])} training and {len(data['y_test'])} test images; "
              f"{len(trainers)} trainers, server on rank 0 ({args.device})", flush=True)
    servers = grad_server_helper(
        # Only the primary (rank 0) builds it: the managed model lives on --device; the
        # trainers' copies stay on the CPU (pushes and pulls cast between them).
        [lambda: make_model(args.hidden).to(args.device)], group=group, optimizer=torch.optim.Adam, learning_rate=args.lr,
        server_name=SERVER, primary_reducer=server_member, secondary_reducers=trainers,
        reduce_method="mean", reduce_batch_size=args.reduce_batch, max_queue_size=args.max_queue,
        checkpoint_dir=args.checkpoint_dir)
    # No try/finally around close(): it waits for every member, so after a failure it
    # would only hide the error; the launcher stops every rank when one raises.
    result: Optional[Dict[str, Any]] = None
    if world.name == server_member:
        result = serve(world, servers, args, data, finished, started)
    else:
        info = train(world, servers[0], args, data, trainers, group)
        info["secondary"] = servers.stats()[0]["secondary"]
        info["cpu"] = time.process_time()
        group.registered_sync("done", (world.name, info))
    # Rank 0 flushes the trainers' secondaries before anyone stops them (close() does).
    group.barrier()
    servers.close()
    group.destroy()
    return result


def main() -> None:
    p = _util.parser(__doc__.splitlines()[0], workers=3, budget=120.0, out="runs/param_server.csv")
    p.add_argument("--epochs", type=_util.positive_int, default=30,
                   help="passes over the training split, shared among the trainers (default 30)")
    p.add_argument("--batch-size", type=_util.positive_int, default=16, help="mini-batch of one push (default 16)")
    p.add_argument("--lr", type=_util.positive_float, default=1e-3,
                   help="Adam learning rate on the server (default 1e-3)")
    p.add_argument("--hidden", type=_util.positive_int, default=128, help="hidden units per layer (default 128)")
    p.add_argument("--reduce-batch", type=_util.positive_int, default=2,
                   help="pushes each reducer combines; a step averages its square (default 2)")
    p.add_argument("--max-queue", type=_util.positive_int, default=32,
                   help="pushes a secondary reducer may hold before refusing more; a refused push is counted "
                        "and its gradient dropped (default 32)")
    p.add_argument("--checkpoint-dir", default=None,
                   help="the server's checkpoints: a run (or a torchrun restart) with the same directory resumes "
                        "the model and optimizer where the last one stopped (--epochs then counts this run's "
                        "pushes only); SIGTERM to the server writes one first (default: none)")
    p.add_argument("--eval-every", type=_util.positive_float, default=0.5,
                   help="seconds between evaluations (default 0.5)")
    p.add_argument("--print-every", type=_util.positive_float, default=2.0,
                   help="seconds between progress lines (default 2)")
    p.add_argument("--target", type=_util.fraction, default=0.95,
                   help="test accuracy reported as the target: the time it is first reached is printed; the run "
                        "goes on to --epochs or --time-budget (default 0.95)")
    args = p.parse_args()
    if args.max_queue < args.reduce_batch:
        p.error("--max-queue must be at least --reduce-batch")
    start = time.monotonic()
    args.data = load_digits_split(args.seed)
    results = _util.run(worker, args.num_workers + 1, args, chaos_ok=True)
    final = results[0] if results else None
    if final is None:  # a torchrun rank other than 0: rank 0 prints the summary
        return
    stats = final["stats"]
    png = _util.plot_csv(args.out, "epochs", ["test_accuracy", "train_loss"], "param_server: MLP on digits")
    if final.get("trainers") is None or args.chaos is not None:
        final["trainers"] = {m: t for m, t in final.get("trainers", {}).items() if "secondary" in t}
    refused = sum(t["secondary"]["rejected"] for t in final["trainers"].values() if "secondary" in t)
    per_trainer = ", ".join(f"{m}: {t['secondary']['accepted']} pushes taken, {t['secondary']['rejected']} refused"
                            for m, t in final["trainers"].items())
    _util.summary("param_server", {
        "test accuracy": f"{100 * final['test_acc']:.2f}% ({len(args.data['y_test'])} held-out images)",
        "train accuracy": f"{100 * final['train_acc']:.2f}%",
        "epochs": f"{final['epochs']:.1f} (of {args.epochs})" + (
            f"; {refused} pushes were refused by full queues and dropped (a larger --max-queue than "
            f"{args.max_queue} holds more)" if refused else ""),
        "server": (f"{stats['steps']} optimizer steps from {stats['applied']} pushes, version "
                   f"{stats['version']}, lag mean {stats['lag_mean']:.2f} max {stats['lag_max']}"),
        "secondary reducers": per_trainer or "not reported (with --chaos the run ends while they train)",
        "updates/s": f"{stats['steps'] / max(1e-9, final['seconds']):.1f}",
        "time to target": (f"{final['target_at']:.1f} s ({100 * args.target:.0f}% test accuracy)"
                           if final.get("target_at") is not None else "not reached"),
        **({"chaos": (f"every {args.chaos:g} s: {final['members']['losses']} trainers lost, "
                      f"{final['members']['rejoins']} rejoined, {_util.plural(final['dropped'], 'push', 'pushes')} dropped with them")}
           if args.chaos is not None else {}),
        "curve": args.out + (f" and {png}" if png else ""),
        **_util.metrics_summary(args, "param_server: MLP on digits", x="pushes applied"),
        "CPU time": f"{final['cpu'] + time.process_time():.1f} s (this process and the ranks, user+sys)",
        "wall time": _util.wall_time(start),
    })


if __name__ == "__main__":
    main()
