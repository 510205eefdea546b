"""One-call set-up of model and gradient servers, entered by every member of the group.

    servers = grad_server_helper([lambda: MLP()], optimizer=torch.optim.SGD, learning_rate=0.1)
    (server,) = servers                  # machin style: a tuple of accessors
    ... server.push(model); server.pull(model) ...
    servers.close()                      # every member: stop reducers, withdraw, leave

Unlike machin's helper, every member's secondary reducer is started (not only the
primary's), the lr scheduler is stepped, and the managed model stays where its creator
put it.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..distributed import RpcGroup, get_world
from ._common import check_count, check_group, check_name, check_timeout, current_world
from ._grad import grad_settings
from ._host import host_checkpoint
from .grad import PushPullGradServerImpl
from .model import PushPullModelServerImpl

__all__ = ["ServerHandles", "grad_server_helper", "model_server_helper"]

log = logging.getLogger(__name__)


class ServerHandles(tuple):
    """The accessors a helper returns (a tuple, as in machin), plus this member's share.

    Attributes:
        group: The RpcGroup the servers live in.
        impls: The server implementations hosted by this member (possibly none).
    """

    group: RpcGroup
    impls: Tuple[Any, ...]
    _owns_group: bool  # destroy the group on close (the helper created it)
    _closed: bool

    def __new__(cls, accessors: Sequence[Any], group: RpcGroup, impls: Sequence[Any],
                owns_group: bool) -> "ServerHandles":
        self = super().__new__(cls, accessors)
        self.group = group
        self.impls = tuple(impls)
        self._owns_group = owns_group
        self._closed = False
        return self

    def __reduce__(self) -> Any:
        raise TypeError("ServerHandles belong to their process; send the accessors (tuple(handles)) instead")

    def watch(self) -> None:
        """Re-raise the error of a failed reducer thread of this member, if any."""
        for impl in self.impls:
            if hasattr(impl, "watch"):
                impl.watch()

    def stats(self) -> List[Dict[str, Any]]:
        """``stats()`` of each server hosted here (model and gradient servers alike; an
        empty dict for one that has none)."""
        return [impl.stats() if hasattr(impl, "stats") else {} for impl in self.impls]

    def checkpoint(self, timeout: Optional[float] = None) -> List[str]:
        """Write the checkpoint of each server hosted here that keeps one (``checkpoint_dir``),
        e.g. when the job is told to stop; every member may call it (the others have none).

        Args:
            timeout: Seconds for all of them; None: the world's ``rpc_timeout``.

        Returns:
            The paths written (empty on a member that hosts no checkpointed server).

        Raises:
            TimeoutError, OSError: as :meth:`PushPullGradServerImpl.checkpoint`.
        """
        wait = check_timeout(timeout) or current_world().rpc_timeout
        deadline = time.monotonic() + wait
        paths = []
        for impl in self.impls:
            if impl.checkpoint_path is None:
                continue
            if isinstance(impl, PushPullGradServerImpl):
                paths.append(impl.checkpoint(max(0.001, deadline - time.monotonic())))
            else:
                paths.append(impl.checkpoint())
        return paths

    def close(self, timeout: Optional[float] = None) -> None:
        """Stop this member's servers, wait for every member, withdraw them, leave the group.

        Every member must call it (it contains group barriers): all secondary reducers
        stop, then all primaries, then the services are withdrawn. A member that died or
        left is not waited for: the survivors close together. The group is destroyed
        when the helper created it. Safe to call twice.

        Args:
            timeout: Seconds for the whole shutdown; None: the world's ``dist_timeout``.

        Raises:
            TimeoutError: a member did not arrive within ``timeout`` seconds.
        """
        if self._closed:
            return
        wait = check_timeout(timeout) or current_world().dist_timeout
        deadline = time.monotonic() + wait

        def left() -> float:
            return max(0.001, deadline - time.monotonic())

        # Every secondary stops before any primary, so no forward in flight meets a
        # stopped primary; and nobody withdraws a service another member may still call.
        for roles in (("secondary",), ("primary",)):
            for impl in self.impls:
                if isinstance(impl, PushPullGradServerImpl):
                    impl._stop_roles(roles, left())
            # (skip_gone: a member that died does not fail the survivors' close; the
            # host that closes first would otherwise leave the others' pulls failing)
            self.group.barrier(timeout=left(), skip_gone=True)
        self._closed = True
        for accessor in self:  # (a later call says it was closed, not that a service is missing)
            accessor._closed_here = True
        for impl in self.impls:
            impl.close()
        if self._owns_group:
            self.group.destroy()


def _resolve_group(group: Union[None, RpcGroup, str], group_name: Optional[str], members: Union[str, Sequence[str]],
                   name: str, timeout: Optional[float]) -> Tuple[RpcGroup, bool]:
    """The helper's group, and whether it made it: ``group``, or a new one of ``members``
    named ``group_name`` (machin's parameter, also given as ``group``), else ``name``."""
    if isinstance(group, str):  # machin's second parameter: the name of the group to create
        if group_name is not None:
            raise TypeError(f"group={group!r} and group_name={group_name!r}: pass the new group's name once")
        group, group_name = None, group
    if group_name is not None:
        if group is not None:
            raise TypeError(f"group_name={group_name!r} names a group to create, and group={group!r} is one: "
                            f"pass one of them")
        name = check_name(group_name, "group_name")
    if group is not None:
        if check_group(group).is_open():
            raise ValueError(f"group={group!r} is open (created without members), and a helper's barriers wait "
                             f"for a fixed set of members: create the group with members=[...], or build the "
                             f"server on its host (PushPullModelServerImpl(name, group), PushPullGradServerImpl"
                             f"(name, group, ...)) and look its accessor up elsewhere with "
                             f"group.get_paired(name).to_here(), as examples/impala.py does")
        if not isinstance(members, str) and sorted(members) != sorted(group.get_group_members()):
            # (members was ignored: the helper uses the group's)
            raise ValueError(f"members={list(members)!r} differs from the members of group={group!r} "
                             f"({group.get_group_members()}): the helper serves the group's; leave members out")
        return group, False
    world = get_world()
    if world is None:
        raise RuntimeError("no World in this process: create one first (or use machinlike.launch)")
    if isinstance(members, str):
        if members != "all":
            raise ValueError(f"members={members!r} must be 'all' or a list of member names")
        members = world.get_members()
        if world.elastic:
            # A silent one-member server on the first rank up, and the others failing a
            # minute later, was what a static program saw once it added max_restarts.
            log.warning("%s: members='all' in an elastic world is who has joined so far (%s), which differs "
                        "between members that start at their own pace: wait for them first and pass the list "
                        "(world.wait_for_members(names); members=names), or build the server on its host and "
                        "look its accessor up with group.get_paired(name) (examples/impala.py)", name, members)
    return world.create_rpc_group(name, list(members), timeout=timeout), True


def _per_model(value: Any, count: int, param: str, default: Callable[[], Any], single: Tuple[type, ...]) -> List[Any]:
    """One value per model: None -> defaults; a ``single`` value -> repeated; a list -> checked."""
    if value is None:
        return [default() for _ in range(count)]
    if single and isinstance(value, single) and not isinstance(value, bool):
        return [value] * count
    if isinstance(value, (list, tuple)):
        if len(value) != count:
            raise ValueError(f"{param} has {len(value)} entries; give one per model creator ({count})")
        return list(value)
    raise TypeError(f"{param} must be a list with one entry per model creator, not {type(value).__name__}")


def model_server_helper(model_num: int = 1, group: Union[None, RpcGroup, str] = None,
                        members: Union[str, Sequence[str]] = "all", *, server_name: str = "model_server",
                        group_name: Optional[str] = None, timeout: Optional[float] = None,
                        checkpoint_dir: Any = None, checkpoint_every: int = 100,
                        checkpoint_interval: Optional[float] = None) -> ServerHandles:
    """Create ``model_num`` model servers hosted by the group's first member.

    Every member calls it and gets the accessors; servers are named
    ``"<server_name>_<i>"`` (machin: ``model_server_0``, ...).

    Args:
        model_num: Number of servers (one per model).
        group: Group to host them in, with fixed members (not an open one); None: create
            one named ``server_name`` from ``members``; a str: create one of that name
            (machin's ``group_name``).
        members: ``"all"`` (every world member) or member names; used when ``group`` is None.
        server_name: Prefix of the servers' names (and the created group's name).
        group_name: machin's keyword: the name of the group to create (as a str ``group``).
        timeout: Seconds for group creation and the barriers; None: the world's dist_timeout.
        checkpoint_dir, checkpoint_every, checkpoint_interval: As for
            :class:`PushPullModelServerImpl`: the host checkpoints each server's chain (one
            file per server, ``<server_name>_<i>``), resumes from it, and
            ``ServerHandles.checkpoint()`` writes them now.

    Returns:
        :class:`ServerHandles`: a tuple of :class:`PushPullModelServer` accessors.

    Raises:
        ValueError, TypeError: invalid arguments.
        RuntimeError: ``group`` is None and this process has no World; or the host failed
            to build its servers (naming it, quoting its error; the host raises the error).
        TimeoutError: a member did not arrive within ``timeout``.
    """
    check_count(model_num, "model_num", 1)
    timeout = check_timeout(timeout)
    check_name(server_name, "server_name")
    names = [f"{server_name}_{i}" for i in range(model_num)]
    # (checked on every member, before any group exists: a mistake is named everywhere)
    checkpoints = [host_checkpoint(checkpoint_dir, "model-server", n, checkpoint_every, checkpoint_interval)
                   for n in names]
    group, owned = _resolve_group(group, group_name, members, server_name, timeout)
    host = group.get_group_members()[0]
    impls: List[PushPullModelServerImpl] = []
    if group.get_cur_name() == host:
        try:
            for n, c in zip(names, checkpoints):
                impls.append(PushPullModelServerImpl._checked(n, group, checkpoint=c))
        except BaseException as err:  # (the others are told at the barrier, not by its timeout)
            for impl in impls:
                impl.close()
            group.fail_barrier(err)
            raise
    group.barrier(timeout=timeout)
    accessors = [group.get_paired(n).to_here() for n in names]
    return ServerHandles(accessors, group, impls, owned)


def grad_server_helper(model_creators: Sequence[Callable[[], torch.nn.Module]],
                       group: Union[None, RpcGroup, str] = None,
                       members: Union[str, Sequence[str]] = "all", optimizer: Any = torch.optim.Adam,
                       learning_rate: Union[float, Sequence[float]] = 1e-3,
                       optimizer_kwargs: Optional[Sequence[Dict[str, Any]]] = None, lr_scheduler: Any = None,
                       lr_scheduler_args: Optional[Sequence[Tuple]] = None,
                       lr_scheduler_kwargs: Optional[Sequence[Dict[str, Any]]] = None, *,
                       server_name: str = "grad_server", primary_reducer: Optional[str] = None,
                       secondary_reducers: Optional[Sequence[str]] = None, reduce_method: str = "sum",
                       reduce_device: Any = "cpu", reduce_batch_size: int = 4, max_queue_size: int = 64,
                       group_name: Optional[str] = None, timeout: Optional[float] = None,
                       checkpoint_dir: Any = None, checkpoint_every: int = 100,
                       checkpoint_interval: Optional[float] = None) -> ServerHandles:
    """Create and start one gradient server per model creator; every member calls it.

    Only the primary reducer calls the creators, building the managed models (clients
    build their own); it creates ``optimizer(model.parameters(), lr=learning_rate,
    **optimizer_kwargs)`` and, if given, ``lr_scheduler(optimizer, *args, **kwargs)``.
    Every reducer member constructs and starts its share. Servers are named
    ``"<server_name>_<i>"``.

    Args:
        model_creators: One zero-argument callable per model.
        group: Group to use, with fixed members (not an open one); None: create one
            named ``server_name`` from ``members``; a str: create one of that name
            (machin's ``group_name``).
        members: ``"all"`` or member names; used when ``group`` is None.
        optimizer: Optimizer class.
        learning_rate: One for all models, or one per model.
        optimizer_kwargs: Extra optimizer arguments: one dict for all, or one per model.
        lr_scheduler: Scheduler class; None: no scheduler.
        lr_scheduler_args: Its extra positional arguments: a list with one tuple per model.
        lr_scheduler_kwargs: Its extra keyword arguments: one dict for all, or one per model.
        primary_reducer: None: the group's first member.
        secondary_reducers: None: every group member (each pushes to its own reducer).
        reduce_method, reduce_device, reduce_batch_size, max_queue_size: See
            :class:`PushPullGradServerImpl`.
        group_name: machin's keyword: the name of the group to create (as a str ``group``).
        timeout: Seconds for group creation and the barriers; None: the world's dist_timeout.
        checkpoint_dir, checkpoint_every, checkpoint_interval: The primary's checkpoints,
            one file per server in ``checkpoint_dir`` (see :class:`PushPullGradServerImpl`):
            a job started again with the same directory resumes every model. None: none.

    Returns:
        :class:`ServerHandles`: a tuple of :class:`PushPullGradServer` accessors, which
        also stops and closes this member's reducers (``close()``).

    Raises:
        ValueError, TypeError: invalid arguments (e.g. per-model lists of the wrong length).
        RuntimeError: ``group`` is None and this process has no World; or a member failed
            to build its share (naming it, quoting its error; that member raises the error).
        TimeoutError: a member did not arrive within ``timeout``.
    """
    if isinstance(model_creators, (str, bytes)) or not isinstance(model_creators, (list, tuple)) \
            or not model_creators or not all(callable(c) for c in model_creators):
        fix = " (one server per creator: pass [model_creator])" if callable(model_creators) else ""
        raise TypeError(f"model_creators must be a non-empty list of callables that build a model each, not "
                        f"{type(model_creators).__name__}{fix}")
    if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
        raise TypeError(f"optimizer must be an optimizer class (such as torch.optim.Adam), not "
                        f"{type(optimizer).__name__}: the helper builds it on the primary over the model it "
                        f"creates; pass its other arguments as optimizer_kwargs={{...}}")
    if lr_scheduler is not None and (isinstance(lr_scheduler, torch.optim.lr_scheduler.LRScheduler)
                                     or not callable(lr_scheduler)):
        raise TypeError(f"lr_scheduler must be a scheduler class (such as torch.optim.lr_scheduler.StepLR), not "
                        f"{type(lr_scheduler).__name__}; pass its arguments as lr_scheduler_args / "
                        f"lr_scheduler_kwargs")
    count = len(model_creators)
    rates = _per_model(learning_rate, count, "learning_rate", lambda: 1e-3, (int, float))
    for i, rate in enumerate(rates):
        # (torch's own check ran on the primary only: the others were told through the barrier)
        if isinstance(rate, bool) or not (rate >= 0 and rate != float("inf")):
            where = "learning_rate" if len(rates) == 1 else f"learning_rate[{i}]"
            raise ValueError(f"{where}={rate!r} must be a finite number >= 0")
    opt_kwargs = _per_model(optimizer_kwargs, count, "optimizer_kwargs", dict, (dict,))
    # A tuple would be ambiguous (arguments, or one entry per model): only lists here.
    sched_args = _per_model(lr_scheduler_args, count, "lr_scheduler_args", tuple, ())
    sched_kwargs = _per_model(lr_scheduler_kwargs, count, "lr_scheduler_kwargs", dict, (dict,))
    timeout = check_timeout(timeout)
    check_name(server_name, "server_name")
    group, owned = _resolve_group(group, group_name, members, server_name, timeout)
    names = [f"{server_name}_{i}" for i in range(count)]
    # Checked once for all models (every member checks, reducer or not). The secondaries
    # are always listed: a helper's servers use the members it was given, never discover.
    settings = grad_settings(names[0], group, primary_reducer=primary_reducer,
                             secondary_reducers=(group.get_group_members() if secondary_reducers is None
                                                 else secondary_reducers),
                             reduce_method=reduce_method, reduce_device=reduce_device,
                             reduce_batch_size=reduce_batch_size, max_queue_size=max_queue_size,
                             checkpoint_dir=checkpoint_dir, checkpoint_every=checkpoint_every,
                             checkpoint_interval=checkpoint_interval)
    primary, secondaries = settings.primary, settings.secondaries
    me = group.get_cur_name()
    impls: List[PushPullGradServerImpl] = []
    arrived = False
    try:
        if me == primary or me in secondaries:
            for i, name in enumerate(names):
                impl = PushPullGradServerImpl._checked(settings._replace(server_name=name))
                impls.append(impl)
                if me == primary:
                    model = model_creators[i]()
                    opt = optimizer(model.parameters(), lr=rates[i], **opt_kwargs[i])
                    sched = None if lr_scheduler is None else lr_scheduler(opt, *sched_args[i], **sched_kwargs[i])
                    impl.manage_model(model, opt, sched)
                impl.start()
        arrived = True
        group.barrier(timeout=timeout)
        accessors = [group.get_paired(n).to_here() for n in names]
    except BaseException as err:
        for impl in impls:
            impl.close()
        if not arrived:  # (the others are told at the barrier, not by its timeout)
            group.fail_barrier(err)
        raise
    return ServerHandles(accessors, group, impls, owned)
