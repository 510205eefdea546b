"""The Ray launcher: ranks as Ray actors on a Ray cluster, a World in each, one function run.

    driver (the caller of launch_ray)               rank r: a Ray actor (_RankActor)
    ---------------------------------               --------------------------------
    connect to Ray (the address probed first)
    every rank fits a node, all fit the cluster
    placement group, one bundle per rank  ───────►  reserved at once: all ranks or none
    host the store on the driver's node address
    actor.run(rank, name, store address)  ───────►  connect; World(name, r, n, store=...)
    ray.wait on the run results                     result = fn(world, *args, **kwargs)
         ◄────────────────────────────────────────  (ok, result | exception + traceback)
    all done: actor.stop() on every rank  ───────►  world.stop(stop_timeout)
    first failure / a dead actor: kill every actor, re-raise it (remote traceback as cause)
    timeout: actor.stacks() (the actor's second thread) to stderr, kill, TimeoutError

The driver holds the store, as the local launcher's parent does: it is the one process
every actor can reach (it is connected to the cluster), and it outlives every rank. Nothing
polls: the driver blocks in ``ray.wait`` with what is left of one deadline.

Restarts (``max_restarts=K``): Ray restarts a dead actor, in the same placement-group
bundle, and sends the unfinished ``run(rank, name, ...)`` to it again, so the rank comes
back under its own name. With ``max_restarts`` above 0 the ranks form an *elastic* world
(as ``launch(max_restarts=...)`` does), so the restarted rank rejoins it as the next
incarnation of its name while the others go on.
"""

from __future__ import annotations

import math
import os
import socket
import sys
import threading
import time
import traceback
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from ... import _checks
from ...exception import ExceptionWithTraceback, ProcessExitedError
from ...pickle import dumps, loads
from .rank_fn import check_rank_call, check_rank_fn, check_world_kwargs, rank_names, run_rank_fn

__all__ = ["launch_ray"]

# launch_ray's resource keys that are Ray's own (actor options); the rest are custom resources.
_BUILTIN = {"num_cpus": "CPU", "num_gpus": "GPU", "memory": "memory"}
Resources = Mapping[str, float]


def _actor_died(name: str, pid: Optional[int], detail: str) -> ProcessExitedError:
    """A rank's actor that ended without reporting: a ProcessExitedError (by that name in a
    traceback) that says so, as Ray knows no exit code, only a reason."""
    err = ProcessExitedError(name, pid, None, detail)
    err.args = (f"{name} (pid {pid}) died without reporting a result: {detail}",)
    return err


def _node_address() -> str:
    """This process's Ray node address."""
    import ray

    return str(ray.util.get_node_ip_address())


def _store_address(ray: Any) -> str:
    """Where the driver's store listens: loopback when the whole cluster is this machine."""
    here = _node_address()
    nodes = {str(n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive")}
    return "127.0.0.1" if nodes <= {here} else here


class _RankActor:
    """One rank. Ray runs it with two threads, so that ``stacks`` answers while ``run`` works."""

    def __init__(self) -> None:
        self._world: Any = None

    def pid(self) -> int:
        return os.getpid()

    def run(self, rank: int, world_size: int, name: str, host: str, port: int, payload: Tuple[Any, ...],
            world_kwargs: Dict[str, Any]) -> bytes:
        where = f"rank {rank} ({name!r}) on Ray node {_node_address()}"
        try:
            fn, args, kwargs = payload
            self._world = self._join(rank, world_size, name, host, port, world_kwargs)
            message = (True, run_rank_fn(fn, self._world, args, kwargs, reported_as=where))
        except BaseException as exc:  # reported to the driver, which decides what to raise
            message = (False, ExceptionWithTraceback(exc, where=where))  # (run_rank_fn recorded fn's as the exit cause)
        try:
            return dumps(message)
        except Exception as exc:
            return dumps((False, ExceptionWithTraceback(
                TypeError(f"rank {rank} returned a result that cannot be pickled: {exc}"), where=where)))

    @staticmethod
    def _join(rank: int, world_size: int, name: str, host: str, port: int, world_kwargs: Dict[str, Any]) -> Any:
        """The World of this rank: static, or elastic (``elastic`` in ``world_kwargs``) so
        that a rank Ray restarted rejoins under its name as the next incarnation."""
        from .._store import connect_store
        from .._world import World

        store = connect_store(host, port, world_kwargs.get("dist_timeout", 60.0))
        if world_kwargs.get("elastic"):
            return World(name, rank, store=store, **world_kwargs)
        return World(name, rank, world_size, store=store, **world_kwargs)

    def stop(self, timeout: float) -> None:
        world, self._world = self._world, None
        if world is not None:
            world.stop(timeout)

    def stacks(self) -> str:
        """Every other thread's stack, as faulthandler would print them."""
        names = {t.ident: t.name for t in threading.enumerate()}
        parts = []
        for ident, frame in sys._current_frames().items():
            if ident != threading.get_ident():
                parts.append(f"Thread {names.get(ident, ident)!r}:\n{''.join(traceback.format_stack(frame))}")
        return "\n".join(parts)


def _bundles(resources: Union[None, Resources, Sequence[Resources]], world_size: int) -> List[Dict[str, float]]:
    """One Ray resource bundle (``{"CPU": 1, "learner": 1}``) per rank, validated."""
    if resources is None:
        per_rank: Sequence[Resources] = [{"num_cpus": 1}] * world_size
    elif isinstance(resources, Mapping):
        per_rank = [resources] * world_size
    elif isinstance(resources, Sequence) and not isinstance(resources, str):
        per_rank = list(resources)
        if len(per_rank) != world_size:
            raise ValueError(f"resources has {len(per_rank)} entries; world_size is {world_size} "
                             f"(give one mapping per rank, or one mapping for all)")
    else:
        raise TypeError(f"resources must be a mapping or a sequence of mappings, not {type(resources).__name__}")
    bundles = []
    for rank, wanted in enumerate(per_rank):
        if not isinstance(wanted, Mapping):
            raise TypeError(f"resources[{rank}] must be a mapping like {{'num_cpus': 1}}, not {type(wanted).__name__}")
        bundle: Dict[str, float] = {}
        for key, amount in wanted.items():
            if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not math.isfinite(amount) \
                    or amount < 0:
                raise ValueError(f"resources[{rank}][{key!r}]={amount!r} must be a non-negative number")
            if key in ("CPU", "GPU"):
                raise ValueError(f"resources[{rank}]: write {key!r} as {'num_cpus' if key == 'CPU' else 'num_gpus'!r}")
            if amount:
                bundle[_BUILTIN.get(key, key)] = float(amount)
        if not bundle:
            raise ValueError(f"resources[{rank}]={dict(wanted)!r} asks for nothing; Ray places an actor by what "
                             f"it asks for (e.g. {{'num_cpus': 1}})")
        bundles.append(bundle)
    return bundles


def _connect(ray: Any, address: Optional[str], timeout: float) -> bool:
    """Connect this process to Ray; whether it was connected here (and must disconnect)."""
    if ray.is_initialized():
        if address is not None:
            raise ValueError(f"address={address!r}, but this process is already connected to Ray: pass "
                             f"address=None to use that connection, or ray.shutdown() first")
        return False
    # (address None takes RAY_ADDRESS, as ray.init does: `ray job submit` and cluster set-ups
    # export it, and a dead one held ray.init for minutes past start_timeout: cold trial 32)
    probed = address if address is not None else (os.environ.get("RAY_ADDRESS") or None)
    if probed not in (None, "auto", "local"):
        said = f"address={address!r}" if address is not None else f"RAY_ADDRESS={probed!r} (address=None)"
        if probed.startswith("ray://"):
            raise ValueError(f"{said}: Ray Client drivers are not supported (the ranks must reach "
                             f"the driver's store); run the driver on a cluster node, e.g. with `ray job submit`")
        host, _, port = probed.rpartition(":")
        if not host or not port.isdecimal():
            raise ValueError(f"{said} must be 'host:port' of the Ray head (its GCS), 'auto' or None")
        # ray.init retries an address nobody answers at for minutes; a refused or silent port is named now.
        try:
            socket.create_connection((host, int(port)), timeout=timeout).close()
        except OSError as err:
            raise ConnectionError(f"no Ray cluster answers at {said} ({err}); start one with "
                                  f"`ray start --head` or give the head's address") from None
    ray.init(address=address, include_dashboard=False, log_to_driver=True)
    return True


def _check_fits(ray: Any, bundles: List[Dict[str, float]]) -> None:
    """Refuse ranks no node can hold, or more than the whole cluster has (Ray would wait forever)."""
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    for rank, bundle in enumerate(bundles):
        if not any(all(node.get(k, 0.0) >= v for k, v in bundle.items()) for node in nodes):
            offers = "; ".join(str({k: v for k, v in n.items() if not k.startswith("node:")}) for n in nodes)
            raise ValueError(f"resources: rank {rank} asks for {bundle}, which no node of the Ray cluster has "
                             f"(its nodes offer: {offers})")
    need: Dict[str, float] = {}
    for bundle in bundles:
        for key, amount in bundle.items():
            need[key] = need.get(key, 0.0) + amount
    total = ray.cluster_resources()
    short = {k: f"{v:g} asked, {total.get(k, 0.0):g} in the cluster" for k, v in need.items() if v > total.get(k, 0.0)}
    if short:
        raise ValueError(f"resources: the {len(bundles)} ranks need more than the Ray cluster has: {short}; "
                         f"ask for fewer ranks or resources, or add nodes")


def launch_ray(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: Optional[Dict[str, Any]] = None,
    *,
    resources: Union[None, Resources, Sequence[Resources]] = None,
    address: Optional[str] = None,
    timeout: Optional[float] = None,
    start_timeout: float = 60.0,
    names: Optional[Sequence[str]] = None,
    stop_timeout: float = 30.0,
    return_exceptions: bool = False,
    max_restarts: int = 0,
    master_addr: Optional[str] = None,
    **world_kwargs: Any,
) -> List[Any]:
    """Run ``fn(world, *args, **kwargs)`` in ``world_size`` Ray actors, a World in each.

    The same contract as :func:`launch`, on a Ray cluster: each rank is an actor placed
    by its resources, and the driver (this process) hosts the world's store.

    Args:
        fn: The function; lambdas and local functions work (sent by value). Modules it
            imports must be importable on the cluster's nodes. An ``async def``
            function runs in an event loop of its rank (``asyncio.run``).
        world_size: Number of ranks.
        args, kwargs: Extra arguments of ``fn`` (copied to each rank).
        resources: What each rank's actor needs: one mapping for all ranks or one per
            rank, with ``num_cpus``, ``num_gpus``, ``memory`` (bytes) and custom resources
            (``{"num_cpus": 2, "learner": 1}``). None: one CPU per rank.
        address: The Ray cluster (``"host:port"`` of its head, or ``"auto"``). None: the
            connection this process already has, else ``RAY_ADDRESS`` or a new local Ray.
            A cluster this call connects to is disconnected at the end.
        timeout: Seconds for the whole run; None waits as long as the ranks run.
        start_timeout: Seconds to reach the cluster and reserve every rank's resources.
        names: Member names per rank. None: ``"0"``, ``"1"``, ...
        stop_timeout: Seconds each rank's ``World.stop`` waits for its peers at the end.
        return_exceptions: A failed rank's slot holds its exception instead of ending the run.
        max_restarts: Times Ray may restart each rank's actor; the ranks then form an
            elastic World (no collectives) and a restarted rank rejoins it under its name
            as the next incarnation. 0: a dead actor ends the run. Only a dead actor is
            restarted: a rank whose ``fn`` raises ends the run (``launch`` restarts it).
        master_addr: The address the driver's store listens on, reachable from every
            node. None: 127.0.0.1 when the cluster is this machine alone, else the
            driver's Ray node address.
        **world_kwargs: Passed to :class:`World` (``rpc_timeout``, ``collective``, ...).

    Returns:
        ``fn``'s return value of each rank, in rank order.

    Raises:
        ModuleNotFoundError: Ray is not installed (``pip install 'machinlike[ray]'``).
        ValueError, TypeError: bad arguments, or resources no node / the cluster has.
        ConnectionError: nothing answers at ``address`` (or ``RAY_ADDRESS``).
        TimeoutError: the resources were not reserved within ``start_timeout``, or the
            run exceeded ``timeout`` (stacks of the unfinished ranks go to stderr).
        Exception: the first failure of any rank, with its traceback as cause; the other
            ranks are killed.
        ProcessExitedError: a rank's actor died without reporting.
    """
    check_rank_fn(fn)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a positive int")
    for param, value in (("timeout", timeout), ("start_timeout", start_timeout), ("stop_timeout", stop_timeout)):
        _checks.seconds_or_none(param, value)
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise ValueError(f"max_restarts={max_restarts!r} must be a non-negative int")
    check_world_kwargs("launch_ray()", world_kwargs)
    if max_restarts > 0:  # a restarted actor must be able to rejoin a running world
        world_kwargs = {k: v for k, v in world_kwargs.items() if k not in ("collective", "init_dist")}
        world_kwargs["elastic"] = True
    names = rank_names(names, world_size)
    bundles = _bundles(resources, world_size)
    check_rank_call(fn, args, kwargs)
    try:
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
    except ImportError as err:
        raise ModuleNotFoundError(f"launch_ray needs Ray: pip install 'machinlike[ray]' ({err})") from None
    from .._store import host_store

    deadline = None if timeout is None else time.monotonic() + timeout
    connected_here = _connect(ray, address, start_timeout)
    group, store, actors = None, None, []
    try:
        _check_fits(ray, bundles)
        group = placement_group(bundles, strategy="PACK")
        if not ray.wait([group.ready()], timeout=start_timeout)[0]:
            raise TimeoutError(f"launch_ray: the Ray cluster did not reserve the ranks' resources {bundles} "
                               f"within start_timeout={start_timeout:g} s (are other jobs holding them?)")
        store = host_store(master_addr or _store_address(ray), world_size,
                           world_kwargs.get("dist_timeout", 60.0))
        actor_class = ray.remote(_RankActor)
        # Ray's own serialiser (cloudpickle), as for any Ray task: a function of the driver's
        # __main__ travels by value with the globals it uses, imported modules by name.
        payload = ray.put((fn, tuple(args), dict(kwargs or {})))
        runs = {}
        pids = []
        for rank, bundle in enumerate(bundles):
            # Any: ray's stubs type an actor's methods as plain callables, without .remote
            actor: Any = actor_class.options(
                num_cpus=bundle.get("CPU", 0), num_gpus=bundle.get("GPU", 0), memory=bundle.get("memory"),
                resources={k: v for k, v in bundle.items() if k not in ("CPU", "GPU", "memory")},
                max_concurrency=2, max_restarts=max_restarts, max_task_retries=max_restarts,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=rank),
            ).remote()
            actors.append(actor)
            pids.append(actor.pid.remote())
            runs[actor.run.remote(rank, world_size, names[rank], store.host, store.port, payload,
                                  world_kwargs)] = rank
        results = _collect(ray, runs, actors, pids, names, deadline, timeout, return_exceptions)
        stops = [actor.stop.remote(stop_timeout) for actor in actors]
        ray.wait(stops, num_returns=len(stops), timeout=stop_timeout + 5.0)
        return results
    finally:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        if group is not None:
            remove_placement_group(group)
        del store
        if connected_here:
            ray.shutdown()


def _pid(ray: Any, ref: Any) -> Optional[int]:
    try:
        return ray.get(ref, timeout=0.5)
    except Exception:  # the actor died before it answered: no pid to name
        return None


def _collect(ray: Any, runs: Dict[Any, int], actors: List[Any], pids: List[Any], names: List[str],
             deadline: Optional[float], timeout: Optional[float], return_exceptions: bool) -> List[Any]:
    results: Dict[int, Any] = {}
    pending = list(runs)
    while pending:
        left = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, pending = ray.wait(pending, num_returns=1, timeout=left)
        if not ready:
            _timed_out(ray, [runs[ref] for ref in pending], actors, names, len(results), timeout)
        for ref in ready:
            rank = runs[ref]
            try:
                ok, value = loads(ray.get(ref))
            except ray.exceptions.RayActorError as err:
                ok, value = False, _actor_died(f"rank {rank} ({names[rank]!r})", _pid(ray, pids[rank]),
                                               f"its Ray actor died ({str(err).strip().splitlines()[0]})")
                value.__cause__ = err
            except ray.exceptions.RayTaskError as err:  # Ray could not even call run (e.g. unpickling fn)
                ok, value = False, err
            if not ok and not return_exceptions:
                raise value
            results[rank] = value
    return [results[rank] for rank in range(len(actors))]


def _timed_out(ray: Any, ranks: List[int], actors: List[Any], names: List[str], reported: int,
               timeout: Optional[float]) -> None:
    asked = {rank: actors[rank].stacks.remote() for rank in ranks}
    ray.wait(list(asked.values()), num_returns=len(asked), timeout=5.0)
    for rank, ref in asked.items():
        try:
            text = ray.get(ref, timeout=0.1)
        except Exception as err:  # a rank stuck holding the GIL cannot answer
            text = f"(no answer: {type(err).__name__})"
        print(f"--- launch_ray: stacks of rank {rank} ({names[rank]!r})\n{text}", file=sys.stderr, flush=True)
    late = ", ".join(f"rank {rank} ({names[rank]!r})" for rank in ranks)
    raise TimeoutError(f"launch_ray: {late} did not finish within {timeout:g} s ({reported} of {len(actors)} "
                       f"ranks reported); their stacks were dumped to stderr")
