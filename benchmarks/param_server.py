"""machinlike's servers against the parameter servers a user would otherwise write, in one run.

Run:  python benchmarks/param_server.py [--quick]

Three local processes (the launcher's warm forkserver): rank 0 is the parameter server,
ranks 1 and 2 are trainers. Every process runs torch with one intra-op thread (three
processes share the machine's cores; both contenders get the same setting).

1. Gradient parameter server. The peer is written the way PyTorch's "Batch RPC
   Processing Using Asynchronous Executions" tutorial does it: each trainer sends its
   gradients with ``rpc_async`` to an ``@async_execution`` function on the server, which
   accumulates them under a lock; when every trainer's gradients arrived it averages
   them, steps SGD and answers all trainers with the new parameters. Against it,
   :class:`PushPullGradServer` with tree reduction: each trainer hosts a secondary
   reducer (it pushes to its own), secondaries reduce 2 pushes and forward the sum to
   the primary on rank 0, which reduces 2 of those, steps the same SGD and publishes;
   trainers pull before each step (nothing travels when they are up to date). Same
   ~1M-parameter MLP, same batch, same number of iterations per trainer. Rounds of the
   two alternate so that machine noise hits both; figures are medians over rounds.
2. Ordered server: push+pull of a small value against raw ``rpc_sync`` calls of a plain
   dict store on the same host.
3. Model server: push of a 4 MB model plus pull into a model that is behind, against raw
   ``rpc_sync`` calls moving the same state dict there and back (load included in both).
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
from typing import Any, Callable, Dict, List, Tuple

import torch
from torch import nn
from torch.distributed import rpc

from machinlike import launch
from machinlike.server import (
    OrderedServerSimple,
    OrderedServerSimpleImpl,
    PushPullGradServerImpl,
    PushPullModelServerImpl,
)

TRAINERS = ("1", "2")
BATCH = 32
LR = 0.01
ITERATIONS = {False: 300, True: 100}  # per trainer and round; key: --quick
ROUNDS = {False: 3, True: 2}


def make_model() -> nn.Module:
    """About 1.06M parameters (4.2 MB of float32)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.ReLU(), nn.Linear(1024, 512), nn.ReLU(), nn.Linear(512, 10))


def _train_step(model: nn.Module, data: Tuple[torch.Tensor, torch.Tensor]) -> None:
    model.zero_grad(set_to_none=False)
    nn.functional.cross_entropy(model(data[0]), data[1]).backward()


def _data(seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, 512, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)


# ------------------------------------------------------------------------ the peer
class _BatchUpdatePS:
    """Tutorial-style batch-update parameter server (lives on rank 0)."""

    def __init__(self, trainers: int) -> None:
        self.model = make_model()
        self.params = list(self.model.parameters())
        for p in self.params:
            p.grad = torch.zeros_like(p)
        self.optimizer = torch.optim.SGD(self.params, lr=LR, momentum=0.9)
        self.trainers = trainers
        self.arrived = 0
        self.updates = 0
        self.lock = threading.Lock()
        self.answer: torch.futures.Future = torch.futures.Future()


_peer: Dict[str, _BatchUpdatePS] = {}


def peer_start(trainers: int) -> None:
    _peer["ps"] = _BatchUpdatePS(trainers)


def peer_params() -> List[torch.Tensor]:
    return [p.detach() for p in _peer["ps"].params]


def peer_updates() -> int:
    return _peer["ps"].updates


@rpc.functions.async_execution
def peer_update_and_fetch(grads: List[torch.Tensor]) -> torch.futures.Future:
    ps = _peer["ps"]
    with ps.lock:
        for p, g in zip(ps.params, grads, strict=True):
            p.grad += g
        ps.arrived += 1
        answer = ps.answer
        if ps.arrived == ps.trainers:
            for p in ps.params:
                p.grad /= ps.trainers
            ps.optimizer.step()
            ps.optimizer.zero_grad(set_to_none=False)
            ps.arrived = 0
            ps.updates += 1
            ps.answer = torch.futures.Future()
            answer.set_result([p.detach() for p in ps.params])
    return answer


def _load(model: nn.Module, tensors: List[torch.Tensor]) -> None:
    with torch.no_grad():
        for p, t in zip(model.parameters(), tensors, strict=True):
            p.copy_(t)


def _peer_trainer(iterations: int) -> Dict[str, float]:
    model = make_model()
    _load(model, rpc.rpc_sync("0", peer_params))
    data = _data(1)
    start = time.perf_counter()
    for _ in range(iterations):
        _train_step(model, data)
        grads = [p.grad for p in model.parameters()]
        _load(model, rpc.rpc_async("0", peer_update_and_fetch, args=(grads,)).wait())
    return {"elapsed": time.perf_counter() - start, "pushes": iterations}


# --------------------------------------------------------------------------- ours
def _our_trainer(group: Any, name: str, iterations: int) -> Dict[str, float]:
    server = group.get_paired(name).to_here()
    model = make_model()
    data = _data(1)
    accepted = rejected = 0
    start = time.perf_counter()
    for _ in range(iterations):
        server.pull(model)
        _train_step(model, data)
        if server.push(model, pull=False):
            accepted += 1
        else:
            rejected += 1
    return {"elapsed": time.perf_counter() - start, "pushes": accepted, "rejected": rejected}


def _grad_round(world: Any, group: Any, kind: str, index: int, iterations: int) -> Dict[str, Any]:
    me = world.name
    if kind == "peer":
        if me == "0":
            peer_start(len(TRAINERS))
        group.barrier()
        out = _peer_trainer(iterations) if me in TRAINERS else {}
        group.barrier()
        if me == "0":
            out = {"updates": peer_updates(), "lag_mean": 0.0, "lag_max": 0}
        return out
    name = f"grad{index}"
    impl = None
    if me == "0" or me in TRAINERS:
        impl = PushPullGradServerImpl(name, group, primary_reducer="0", secondary_reducers=list(TRAINERS),
                                      reduce_method="mean", reduce_batch_size=2, max_queue_size=64)
        if me == "0":
            model = make_model()
            impl.manage_model(model, torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
        impl.start()
    group.barrier()
    out = _our_trainer(group, name, iterations) if me in TRAINERS else {}
    group.barrier()
    if me == "0":
        stats = impl.stats()["primary"]
        out = {"updates": stats["steps"], "lag_mean": stats["lag_mean"], "lag_max": stats["lag_max"]}
    group.barrier()
    if me == TRAINERS[0]:  # outside the measurement: apply the partial batches left over
        group.get_paired(name).to_here().flush()
    group.barrier()
    impl.close()
    return out


# ------------------------------------------------------------- ordered and model servers
_plain: Dict[Any, Any] = {}


def raw_put(key: Any, value: Any) -> bool:
    _plain[key] = value
    return True


def raw_get(key: Any) -> Any:
    return _plain.get(key)


def _paired_blocks(raw: Callable[[], None], ours: Callable[[], None], calls: int, blocks: int) -> Dict[str, float]:
    """Median seconds per call of each contender, alternating blocks of ``calls`` calls."""
    times: Dict[str, List[float]] = {"raw": [], "ours": []}
    for _ in range(blocks):
        for label, fn in (("raw", raw), ("ours", ours)):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times[label].append((time.perf_counter() - start) / calls)
    return {k: statistics.median(v) for k, v in times.items()}


def _ordered_bench(group: Any, quick: bool) -> Dict[str, float]:
    server = OrderedServerSimple("ordered", group)
    value = {"step": 1, "reward": 0.5, "epsilon": 0.1}
    state = {"v": 0}

    def ours() -> None:
        v = state["v"]
        assert server.push("k", value, v + 1, v)
        server.pull("k")
        state["v"] = v + 1

    def raw() -> None:
        rpc.rpc_sync("0", raw_put, args=("k", value))
        rpc.rpc_sync("0", raw_get, args=("k",))

    for _ in range(50):
        ours()
        raw()
    return _paired_blocks(raw, ours, 100 if quick else 300, 5 if quick else 11)


def _model_bench(group: Any, quick: bool) -> Dict[str, float]:
    server = group.get_paired("model").to_here()
    pusher, behind = make_model(), make_model()

    def ours() -> None:
        assert server.push(pusher)
        object.__setattr__(behind, "pp_version", -1)  # always behind: the pull must transfer
        assert server.pull(behind)

    def raw() -> None:
        rpc.rpc_sync("0", raw_put, args=("m", pusher.state_dict()))
        behind.load_state_dict(rpc.rpc_sync("0", raw_get, args=("m",)))

    def ours_push() -> None:
        assert server.push(pusher)

    def ours_pull() -> None:
        object.__setattr__(behind, "pp_version", -1)
        assert server.pull(behind)

    def raw_push() -> None:
        rpc.rpc_sync("0", raw_put, args=("m", pusher.state_dict()))

    def raw_pull() -> None:
        behind.load_state_dict(rpc.rpc_sync("0", raw_get, args=("m",)))

    for _ in range(3):
        ours()
        raw()
    calls, blocks = (5, 5) if quick else (10, 9)
    pairs = _paired_blocks(raw, ours, calls, blocks)
    # Apart: a model server is pushed by one learner and pulled by many actors, and the
    # two directions cost differently (a push lands in new shared memory on the host, so
    # that the pulls of this host read it in place).
    pushes = _paired_blocks(raw_push, ours_push, calls, blocks)
    pulls = _paired_blocks(raw_pull, ours_pull, calls, blocks)
    return {**pairs, "raw_push": pushes["raw"], "ours_push": pushes["ours"], "raw_pull": pulls["raw"],
            "ours_pull": pulls["ours"]}


# ---------------------------------------------------------------------------- driver
def _body(world: Any, quick: bool) -> Dict[str, Any]:
    torch.set_num_threads(1)
    group = world.create_rpc_group("bench", world.get_members())
    me = world.name
    results: Dict[str, Any] = {}
    if me == "0":
        OrderedServerSimpleImpl("ordered", group)
        PushPullModelServerImpl("model", group)
    group.barrier()
    if me == "1":
        results["ordered"] = _ordered_bench(group, quick)
        results["model"] = _model_bench(group, quick)
    group.barrier()
    results["grad"] = []
    for index in range(ROUNDS[quick]):
        for kind in ("peer", "ours"):
            results["grad"].append((kind, _grad_round(world, group, kind, index, ITERATIONS[quick])))
    group.barrier()
    group.destroy()
    return results


def _summarise_grad(per_rank: List[Dict[str, Any]]) -> Dict[str, Dict[str, float]]:
    rows: Dict[str, Dict[str, List[float]]] = {"peer": {}, "ours": {}}
    for i, (kind, server) in enumerate(per_rank[0]["grad"]):
        trainers = [per_rank[int(t)]["grad"][i][1] for t in TRAINERS]
        elapsed = max(t["elapsed"] for t in trainers)
        figures = {
            "pushes/s": sum(t["pushes"] for t in trainers) / elapsed,
            "rejected/s": sum(t.get("rejected", 0) for t in trainers) / elapsed,
            "updates/s": server["updates"] / elapsed,
            "lag_mean": server["lag_mean"],
            "lag_max": server["lag_max"],
        }
        for key, value in figures.items():
            rows[kind].setdefault(key, []).append(value)
    return {kind: {k: statistics.median(v) for k, v in row.items()} for kind, row in rows.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    args = parser.parse_args()
    load_before = os.getloadavg()[0]
    per_rank = launch(_body, 3, args=(args.quick,), timeout=900, rpc_timeout=120)
    grad = _summarise_grad(per_rank)
    ordered, model = per_rank[1]["ordered"], per_rank[1]["model"]
    peer, ours = grad["peer"], grad["ours"]
    mb = sum(p.numel() * p.element_size() for p in make_model().state_dict().values()) / 2 ** 20
    rows = [
        ("gradient pushes/s, 2 trainers", peer["pushes/s"], ours["pushes/s"], ours["pushes/s"] / peer["pushes/s"],
         ">= 1.30"),
        ("optimizer updates/s", peer["updates/s"], ours["updates/s"], ours["updates/s"] / peer["updates/s"], "report"),
        ("version lag of applied gradients, mean", peer["lag_mean"], ours["lag_mean"], None, "report"),
        ("version lag of applied gradients, max", peer["lag_max"], ours["lag_max"], None, "report"),
        ("pushes refused (queue full)/s", 0.0, ours["rejected/s"], None, "report"),
        ("ordered server push+pull, small value (ops/s)", 2 / ordered["raw"], 2 / ordered["ours"],
         ordered["raw"] / ordered["ours"], ">= 0.80"),
        (f"model server push+pull, {mb:.1f} MB model (pairs/s)", 1 / model["raw"], 1 / model["ours"],
         model["raw"] / model["ours"], ">= 0.80"),
        ("  of which push alone (pushes/s)", 1 / model["raw_push"], 1 / model["ours_push"],
         model["raw_push"] / model["ours_push"], "report"),
        ("  of which pull alone (pulls/s)", 1 / model["raw_pull"], 1 / model["ours_pull"],
         model["raw_pull"] / model["ours_pull"], "report"),
        ("  1 push + 8 pulls, an actor fleet's pattern (rounds/s)", 1 / (model["raw_push"] + 8 * model["raw_pull"]),
         1 / (model["ours_push"] + 8 * model["ours_pull"]),
         (model["raw_push"] + 8 * model["raw_pull"]) / (model["ours_push"] + 8 * model["ours_pull"]), "report"),
    ]
    width = max(len(r[0]) for r in rows)
    print(f"{'measure':<{width}}  {'peer / raw':>12}  {'machinlike':>12}  {'ratio':>7}  target")
    for name, raw, mine, ratio, target in rows:
        shown = f"{ratio:>7.2f}" if ratio is not None else f"{'-':>7}"
        print(f"{name:<{width}}  {raw:>12.1f}  {mine:>12.1f}  {shown}  {target}")
    params = sum(p.numel() for p in make_model().parameters())
    print(f"gradient servers: {params / 1e6:.2f}M-parameter MLP, batch {BATCH}, SGD(momentum=0.9), "
          f"{len(TRAINERS)} trainers x {ITERATIONS[args.quick]} iterations per round, medians of "
          f"{ROUNDS[args.quick]} alternating rounds; machinlike: reduce_batch_size=2, 'mean', a secondary "
          f"reducer in each trainer, the primary on the server.")
    print(f"peer: tutorial-style batch-update PS (rpc_async + @async_execution, SGD once both trainers sent); "
          f"raw: rpc_sync of a plain dict store. Ratios are machinlike / peer for rates. One torch thread per "
          f"process. Load average (1 min) before the run: {load_before:.1f} on {os.cpu_count()} cores.")


if __name__ == "__main__":
    main()
