"""The gradient server's accessor: what clients hold (see :mod:`machinlike.server.grad`)."""

from __future__ import annotations

import logging
import time
import zlib
from typing import AbstractSet, Any, Dict, List, Optional, Sequence, Set, Tuple

import torch

from ...distributed import RpcGroup, get_world
from ...exception import PeerLostError, raised_remotely
from .._budget import CallBudget
from .._errors import MissingGradientError, ServerStoppedError, closed_here
from .._common import check_group, check_members, check_name, check_timeout, rpc_timeout
from .hosted import hosted_secondary
from .items import wait_future
from .._finite import non_finite
from .reducer import SecondaryReducer
from .._spec import Spec, check_module, loadable, mismatch, spec_of, uncastable, unwrap
from .._model_version import GRAD_VERSION_ATTR, get_version, held_version, set_version
from .._state_pool import load_whole
from ..ordered import OrderedServerBase, OrderedServerSimple

__all__ = ["PushPullGradServer"]

log = logging.getLogger(__name__)


class PushPullGradServer:
    """Accessor of a gradient server; picklable, usable from any process of the world.

    Get it with ``group.get_paired(server_name).to_here()`` or
    :func:`~machinlike.server.grad_server_helper`.

    Args:
        server_name: Name of the server.
        group: Its RpcGroup.
        model_name: Key of the parameters in the ordered server.
        secondary_reducers: Members hosting secondary reducers; None: every group member,
            or in an elastic world whoever hosts one, now or later (found through the
            group, looked up again at most every second).
        o_server: Accessor of the ordered server the primary publishes to; None: the
            default one hosted by the primary.
        timeout: Seconds per RPC; None: the world's ``rpc_timeout``.
    """

    def __init__(self, server_name: str, group: RpcGroup, model_name: str = "model",
                 secondary_reducers: Optional[Sequence[str]] = None, o_server: Optional[OrderedServerBase] = None,
                 *, timeout: Optional[float] = None) -> None:
        check_name(server_name, "server_name")
        check_group(group)
        check_name(model_name, "model_name")
        world = get_world()
        discovered = secondary_reducers is None and world is not None and world.elastic
        members = None if discovered else check_members(group, secondary_reducers, "secondary_reducers")
        if o_server is not None and not isinstance(o_server, OrderedServerBase):
            raise TypeError(f"o_server must be an OrderedServerBase accessor or None, not {type(o_server).__name__}")
        self._init(server_name, group, model_name, members, o_server, check_timeout(timeout))

    @classmethod
    def _checked(cls, server_name: str, group: RpcGroup, model_name: str, secondary_reducers: Optional[List[str]],
                 o_server: Optional[OrderedServerBase], timeout: Optional[float]) -> "PushPullGradServer":
        """Built from values its host checked already (None secondaries: discovered)."""
        self = cls.__new__(cls)
        self._init(server_name, group, model_name, secondary_reducers, o_server, timeout)
        return self

    def _init(self, server_name: str, group: RpcGroup, model_name: str, secondary_reducers: Optional[List[str]],
              o_server: Optional[OrderedServerBase], timeout: Optional[float]) -> None:
        self.server_name = server_name
        self.group = group
        self.model_name = model_name
        #: None: discovered (elastic world, secondary_reducers=None).
        self.secondary_reducers = secondary_reducers
        self.o_server: OrderedServerBase = (
            OrderedServerSimple._checked(f"{server_name}/ordered", group, timeout) if o_server is None else o_server)
        self.timeout = timeout
        self._reset_caches()

    def _reset_caches(self) -> None:
        self._spec: Optional[Spec] = None
        # member -> its incarnation when it was found unreachable (None: static world,
        # where nobody comes back); an elastic member that came back is used again.
        self._lost: Dict[str, Optional[int]] = {}
        self._turn: Optional[int] = None
        self._hosts: Dict[str, Tuple[bool, float]] = {}  # discovered: member -> (hosts one, when seen)

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        for key in ("_spec", "_lost", "_turn", "_hosts"):
            state.pop(key)
        state.pop("_closed_here", None)  # (closed by this process's handles: not where it goes)
        return state

    def __setstate__(self, state: Dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_caches()

    def __repr__(self) -> str:
        return f"<PushPullGradServer {self.server_name!r} of group {self.group.get_group_name()!r}>"

    # ------------------------------------------------------------------ routing
    def _local_secondary(self) -> Optional[SecondaryReducer]:
        secondary = hosted_secondary(self.group, self.server_name)
        return secondary if secondary is not None and secondary.member not in self._lost else None

    def _mark_lost(self, member: str) -> None:
        world = get_world()
        self._lost[member] = world.get_incarnation(member) if world is not None and world.elastic else None

    def _candidates(self) -> List[str]:
        """Secondaries worth trying now: known, and (elastic world) live and not found lost."""
        world = get_world()
        if self.secondary_reducers is not None:
            members = self.secondary_reducers
        else:
            members = self.group.get_group_members()
            now = time.monotonic()
            for member in members:
                seen = self._hosts.get(member)
                if seen is None or (not seen[0] and now - seen[1] > 1.0):
                    self._hosts[member] = (self.group.is_registered(f"{self.server_name}/_push/{member}"), now)
            members = [m for m in members if self._hosts[m][0]]
        if world is None or not world.elastic:
            return [m for m in members if m not in self._lost]
        live = []
        for member in members:
            incarnation = world.get_incarnation(member)
            if incarnation is not None and (member not in self._lost or self._lost[member] != incarnation):
                live.append(member)
        return live

    def _route(self, exclude: AbstractSet[str] = frozenset()) -> str:
        live = [m for m in self._candidates() if m not in exclude]
        if not live and any(not hosts for hosts, _ in self._hosts.values()):
            # A secondary seen without its service a moment ago may be back: ask again now.
            self._hosts = {m: seen for m, seen in self._hosts.items() if seen[0]}
            live = [m for m in self._candidates() if m not in exclude]
        if not live:
            known = {m for m, (hosts, _) in self._hosts.items() if hosts}
            gone = sorted(set(self._lost) | set(exclude) | known | set(self.secondary_reducers or ()))
            if not gone:
                raise KeyError(f"no member of group {self.group.get_group_name()!r} serves gradient server "
                               f"{self.server_name!r} now: none has created it yet, or every one that did closed it")
            raise PeerLostError(gone[0], f"no secondary reducer of gradient server {self.server_name!r} is "
                                         f"reachable now (unreachable: {gone})")
        if self._turn is None:  # clients start at different secondaries
            self._turn = zlib.crc32(self.group.get_cur_name().encode())
        self._turn += 1
        return live[self._turn % len(live)]

    def _server_spec(self, budget: CallBudget) -> Spec:
        if self._spec is None:
            self._spec = self.group.registered_sync(f"{self.server_name}/_spec", timeout=budget.left())
        return self._spec

    #: Set by :meth:`ServerHandles.close` on this member: every later call is refused.
    _closed_here = False

    def _refuse_if_closed(self) -> None:
        if self._closed_here:
            raise ServerStoppedError(closed_here(f"gradient server {self.server_name!r}"))

    def _budget(self, timeout: Any, what: str) -> CallBudget:
        self._refuse_if_closed()
        return CallBudget(check_timeout(timeout) or self.timeout or rpc_timeout(),
                          f"{what} gradient server {self.server_name!r}")

    # ------------------------------------------------------------------ pushing
    def push(self, model: torch.nn.Module, *, none_as_zero: bool = False, pull: bool = True,
             timeout: Optional[float] = None) -> bool:
        """Send the model's gradients to a secondary reducer; by default then pull, as machin did.

        With ``pull=True`` (machin's contract): the gradients are queued (waiting for room
        when the reducer's queue is full, within the timeout), then the newest
        published parameters are loaded into ``model`` (:meth:`pull`) and its gradients
        are cleared (``model.zero_grad()``). The pushed gradients are applied later, with
        their batch: the parameters loaded here do not include them yet.

        With ``pull=False`` (the fast path): returns as soon as the gradients are queued,
        or refused because the queue was full; the model is left as it is. Call
        :meth:`pull` yourself before computing the next gradients, or they are computed
        on stale parameters.

        ``model.pp_grad_version`` (the version the gradients were computed on, set by
        :meth:`pull`) travels along for the server's staleness statistics.

        Gradients of another dtype or device than the managed model's are cast to its
        parameters' dtypes here (a float64 client of a float32 server sends float32) and
        moved to their device by the primary, as ``load_state_dict`` would.

        A sparse gradient (``nn.Embedding(sparse=True)``) travels and is summed sparse; the
        primary steps on it as it is when its optimizer takes one (torch's ``SparseAdam``,
        and ``SGD`` and ``Adagrad`` without weight decay), and made dense otherwise.

        Args:
            model: A model of the managed architecture, after ``backward()``; a
                compiled (``torch.compile``), ``DistributedDataParallel`` or ``DataParallel`` model
                counts as the module it wraps.
            none_as_zero: Treat parameters whose ``.grad`` is None as having a zero
                gradient (they are not sent). False: refuse such a push. A frozen
                parameter (``requires_grad=False``) without a gradient is never sent and
                needs no ``none_as_zero``. A parameter that no push of a batch had a
                gradient for keeps ``.grad = None`` on the primary, so its optimizer skips
                it as torch's optimizers skip it locally (AdamW's weight decay leaves a
                frozen encoder as it is).
            pull: Pull and clear the gradients after pushing (machin's behaviour).
            timeout: Seconds for the whole push's waits (for room, a push to another
                secondary after one that left, the pull; loading what arrived in time is
                not cut short); None: the accessor's.

        Returns:
            ``pull=True``: what :meth:`pull` returned (True if newer parameters were
            loaded). ``pull=False``: True if queued; False if the reducer's queue was full
            and the gradients were dropped (counted as ``rejected`` by the server).

        Raises:
            TypeError: ``model`` is not an ``nn.Module``, or a gradient is sparse in another
                layout than COO.
            ValueError: the parameters differ from the managed model's (names or shapes:
                the message lists them), a gradient cannot be cast to its parameter's
                dtype without losing meaning (complex to real, floating to integer), a
                gradient holds NaN or inf (nothing is sent: one such push would make the
                managed parameters NaN for good), or gradients are None without ``none_as_zero`` (:class:`MissingGradientError`,
                also a ``RuntimeError`` as in machin).
            ServerStoppedError: the chosen reducer is stopped or failed, or the helper's
                ``close()`` ran on this member.
            PeerLostError: the chosen secondary was lost during the push (later pushes
                avoid it; the push may have been accepted, and is then either applied or
                reported in the primary's ``dropped_by_client``), no secondary is
                reachable, or (elastic world) the primary reducer is gone (named). A
                secondary known gone before the push, or without the service any more, is
                skipped without an error: nothing was queued there.
            KeyError: no member serves the gradient server (none has created it, or
                every one that did closed it).
            TimeoutError: it did not answer (or, with ``pull=True``, had no room) in time;
                when the gradients were queued and only the pull after them ran out, the
                message says so (push again and they count twice: pull instead).
        """
        if not isinstance(pull, bool):
            raise TypeError(f"pull must be a bool, not {type(pull).__name__}")
        params = dict(unwrap(check_module(model)).named_parameters())
        with self._budget(timeout, "push to") as budget:
            return self._push(model, params, none_as_zero, pull, budget)

    def _push(self, model: torch.nn.Module, params: Dict[str, torch.nn.Parameter], none_as_zero: bool, pull: bool,
              budget: CallBudget) -> bool:
        spec = self._server_spec(budget)
        # Dtypes may differ: gradients are cast to the managed model's (below), unless a
        # cast would lose their meaning.
        diff = mismatch(spec, spec_of(params), f"the model of gradient server {self.server_name!r}",
                        "this model", check_dtypes=False)
        if diff is not None:
            raise ValueError(f"cannot push to gradient server {self.server_name!r}: {diff}")
        grads, absent = {}, []
        for name, param in params.items():
            grad = param.grad
            if grad is None:
                if param.requires_grad:  # a frozen parameter has none by design: nothing to send
                    absent.append(name)
            elif grad.layout == torch.strided:
                grads[name] = grad.detach()
            elif grad.layout == torch.sparse_coo:  # nn.Embedding(sparse=True): its rows looked up, summed
                grads[name] = grad.detach().coalesce()
            else:
                raise TypeError(f"parameter {name!r} has a {grad.layout} gradient; the gradient server takes "
                                f"dense and sparse COO gradients: convert it with .to_sparse_coo() or .to_dense()")
        if absent and not none_as_zero:
            shown = ", ".join(repr(n) for n in absent[:6]) + (f" and {len(absent) - 6} more" if len(absent) > 6 else "")
            raise MissingGradientError(f"no gradient (.grad is None) for {shown}: run backward() before push(), "
                                       f"or pass none_as_zero=True to count them as zero")
        poisoned = non_finite(grads)
        if poisoned:
            # One push of NaN would make every parameter NaN at the next step, for good.
            shown = ", ".join(repr(n) for n in poisoned[:6]) + (f" and {len(poisoned) - 6} more" if len(poisoned) > 6 else "")
            raise ValueError(f"cannot push to gradient server {self.server_name!r}: the gradients of {shown} hold NaN "
                             f"or inf values, which would make the managed parameters NaN; nothing was sent. Skip "
                             f"this batch (model.zero_grad()) and look for the loss that overflowed (a log of 0, "
                             f"a division by 0, a learning rate too high)")
        lossy = uncastable({k: g.dtype for k, g in grads.items()}, {k: d for k, (_, d) in spec.items()})
        if lossy is not None:
            raise ValueError(f"cannot push to gradient server {self.server_name!r}: gradients cannot be cast to the "
                             f"managed model's dtypes ({lossy}); compute them in a real floating dtype")
        version = get_version(model, GRAD_VERSION_ATTR)
        version = -1 if version is None else version
        me = self.group.get_cur_name()
        local = self._local_secondary()
        if local is not None:
            # The client may change its .grad right after we return: hand over copies.
            copies = {k: g.to("cpu", dtype=spec[k][1], copy=True) for k, g in grads.items()}
            if not pull:
                return local.accept(copies, version, me)
            wait_future(local.offer(copies, version, me), budget.left(),
                        f"push to gradient server {self.server_name!r} (waiting for room in its queue)")
        else:
            # Sent in the managed model's dtypes, on the CPU (what RPC carries); the primary
            # moves them to the model's device when it applies them.
            queued = self._push_remote({k: g.to("cpu", dtype=spec[k][1]) for k, g in grads.items()}, version, me,
                                       pull, budget)
            if not pull:
                return queued
        model.zero_grad()
        budget.then("the gradients were queued and will be applied; the pull after them ran out: call pull(model) "
                    "rather than pushing again")
        return self._pull(params, model, budget)

    def _push_remote(self, grads: Dict[str, torch.Tensor], version: int, me: str, pull: bool,
                     budget: CallBudget) -> bool:
        tried: Set[str] = set()
        while True:
            member = self._route(tried)
            service = f"{self.server_name}/{'_push_wait' if pull else '_push'}/{member}"
            try:
                return self.group.registered_sync(service, (grads, version, me), timeout=budget.left())
            except KeyError:
                # Its service is absent (it left, was cleaned up, or came back and has not
                # registered yet): nothing was queued there. Not marked lost: a member that
                # came back registers again, and is asked again next time.
                self._hosts[member] = (False, time.monotonic())
                tried.add(member)
            except PeerLostError as err:
                if err.member == member:  # lost mid-push: the outcome is unknown, so say so
                    self._mark_lost(member)
                raise

    # ------------------------------------------------------------------ pulling
    def pull(self, model: torch.nn.Module, *, timeout: Optional[float] = None) -> bool:
        """Load the newest published parameters into ``model`` unless it has them.

        Only parameters are loaded (in place, so optimizers keep their references);
        buffers stay the client's. Values are converted to each parameter's dtype (and
        device), as ``load_state_dict`` does; names and shapes must match. Nothing is
        transferred when ``model.pp_grad_version`` (this server's; a model server keeps
        ``pp_version``) is the newest version and no parameter was written in place since
        it was set (an optimizer step, a ``fill_``; a write through ``.data`` is not seen);
        on the primary's machine not even a call is made then: its version word says so.

        Args:
            model: A model of the managed architecture.
            timeout: Seconds for the pull's waits on the server; None: the accessor's
                timeout. Parameters that arrived in time are loaded into ``model`` even
                when loading takes the call past it.

        Returns:
            True if newer parameters were loaded (``model.pp_grad_version`` updated), False if
            the model already had the newest version.

        Raises:
            TypeError: ``model`` is not an ``nn.Module``.
            ServerStoppedError: the helper's ``close()`` ran on this member.
            ValueError: the published parameters' names or shapes do not fit ``model``,
                or a cast would lose meaning (complex to real; nothing is loaded).
            TimeoutError: not done within ``timeout``. On this host a pull reads the
                server's memory in place and loads again a version rewritten while it
                read; should newer versions keep coming faster than it reads until the
                time runs out, ``model`` holds a mix of versions and no version
                (``model.pp_grad_version`` None: the next pull loads the newest whole).
        """
        params = dict(unwrap(check_module(model)).named_parameters())
        with self._budget(timeout, "pull from") as budget:
            return self._pull(params, model, budget)

    def _pull(self, params: Dict[str, torch.nn.Parameter], model: torch.nn.Module, budget: CallBudget) -> bool:
        def load(state: Dict[str, torch.Tensor]) -> None:
            diff = loadable(spec_of(state), spec_of(params), f"the model of gradient server {self.server_name!r}",
                            "this model")
            if diff is not None:
                raise ValueError(f"cannot pull from gradient server {self.server_name!r} into this model: {diff}")
            with torch.no_grad():
                for name, param in params.items():
                    param.copy_(state[name])
            if self._spec is None:
                self._spec = spec_of(state)  # the server's own dtypes: what pushes are checked against

        def pull() -> Any:
            held = held_version(model, GRAD_VERSION_ATTR, self.server_name, params.values())
            return self.o_server._bounded(budget.left())._pull_in_place(self.model_name, held)

        return load_whole(pull, load, lambda version: set_version(model, version, GRAD_VERSION_ATTR, self.server_name,
                                                                  params.values()), budget)

    def flush(self, timeout: Optional[float] = None) -> int:
        """Apply everything pushed so far, partial batches included, and return the version.

        Every reachable secondary reduces and forwards what it holds, then the primary
        steps on what it holds (as many steps as its batches need). Unreachable
        secondaries are skipped (their gradients are lost) and left out afterwards; in an
        elastic world the flush first waits (within the loss bound) until the world has
        declared each of them gone, so that the primary's ``dropped_by_client`` then
        counts what died with them.

        Args:
            timeout: Seconds for the whole flush; None: the accessor's timeout.

        Returns:
            The newest published version once everything queued before the call is applied.

        Raises:
            ServerStoppedError: a reducer is stopped or failed, or the helper's ``close()``
                ran on this member.
            TimeoutError: not done within ``timeout``.
        """
        self._refuse_if_closed()
        wait = check_timeout(timeout) or self.timeout or rpc_timeout()
        deadline = time.monotonic() + wait
        # Ask every secondary at once, then collect; a lost one is skipped (and avoided later).
        started = []
        skipped: List[Tuple[str, Optional[str]]] = []
        for member in self._candidates():
            try:
                started.append((member, self.group.registered_async(f"{self.server_name}/_flush/{member}",
                                                                    timeout=wait)))
            except (PeerLostError, KeyError) as err:
                skipped.append(self._skip(member, err))
        for member, fut in started:
            try:
                fut.wait()
            except PeerLostError as err:
                if err.member != member:  # the secondary is fine, another member (its primary) is not
                    raise
                skipped.append(self._skip(member, err))
            except KeyError as err:
                if raised_remotely(err):  # the secondary's own code failed: it is not unreachable
                    raise
                skipped.append(self._skip(member, err))
        self._await_settled([(m, w) for m, w in skipped if w is not None], deadline)
        left = max(0.001, deadline - time.monotonic())
        return self.group.registered_sync(f"{self.server_name}/_flush", timeout=left)

    def _skip(self, member: str, err: BaseException) -> Tuple[str, Optional[str]]:
        """Leave ``member`` out; (member, its RPC worker if this view still has it live)."""
        log.warning("gradient server %r: flush skips unreachable secondary reducer %r: %s",
                    self.server_name, member, err)
        self._mark_lost(member)
        world = get_world()
        if world is None or not world.elastic:
            return member, None
        try:
            return member, world.membership.worker_of(member)
        except PeerLostError:
            return member, None  # this view saw it go already

    def _await_settled(self, skipped: List[Tuple[str, str]], deadline: float) -> None:
        # A call to a dead process on this host fails at once, before the world declares
        # it lost; the primary counts a dead secondary's unforwarded pushes as dropped only
        # once it is declared. Waiting for that (within the loss bound) makes the counts
        # final when flush() returns: every push acknowledged before it is applied or reported.
        world = get_world()
        if not skipped or world is None or world.liveness is None:
            return
        members = world.membership
        bound = min(max(0.001, deadline - time.monotonic()), 2 * world.liveness + 1.0)
        try:
            members.wait_until(lambda _: all(members.worker_gone(w) for _, w in skipped), bound)
        except TimeoutError:
            log.warning("gradient server %r: flush went on without %s declared gone within %.3g s; pushes "
                        "they held are reported as dropped once they are", self.server_name,
                        [m for m, _ in skipped], bound)

