"""Batched central inference: one member runs the policy for many callers' rows at once.

Data flow::

    caller (any member)                              host (InferenceServerImpl)
    -------------------                              --------------------------
    infer(x): rows along dim 0                       "<name>/infer", an asynchronous service:
      same host? large tensors into shared    ──►    a Request (rows, signature, caller,
      memory (a lent segment, no pickling)           deadline) queued; the RPC thread is free
                                                     batcher thread (see _inference.batcher):
                                                     join waiting rows of one signature up to
                                                     max_batch, waiting max_wait at most;
                                                     fn(batch) under no_grad; split the rows
      (output rows, version)                  ◄──    back; same host: through shared memory
                                                     ModelSlot: update() / the model-server
                                                     puller swap weights between batches

Why: a convolutional policy over pixels costs little per row at batch 16-64 and a lot at
batch 1, and one set of weights serves every actor. Batching requests of many callers (and
of concurrent calls of one caller) on one member is what SEED RL, TorchBeast's dynamic
batcher and Sample Factory's policy workers do. It loses where ``fn`` is so cheap that a
round trip costs more than running it locally: measure (``benchmarks/inference.py``).

Failure semantics. A request that makes ``fn`` raise fails its caller only: a failed batch
is run again request by request, and each culprit's caller gets ``fn``'s exception (its
type, the host's traceback as ``__cause__``). A caller that died is skipped (its rows
counted as ``dropped``); the host's death reaches callers as
:class:`~machinlike.exception.PeerLostError` naming it.
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch.distributed import rpc

from .. import _checks, _pids, _shm
from ..distributed import RpcGroup, get_world
from ..distributed._membership import is_here, pid_in, process_identity
from ..exception import PeerLostError, raised_remotely
from ._common import ServerNote, check_group, check_name, publish_notes
from ._errors import ServerStoppedError
from ._inference import Inputs, check_inputs, tensors_of
from ._inference import Batcher, Request
from ._inference import ModelSlot, Puller, StaleVersionError
from ._spec import mismatch, spec_of, unwrap
from .model import PushPullModelServer

__all__ = ["InferenceServer", "InferenceServerImpl"]

log = logging.getLogger(__name__)


class InferenceServer:
    """Accessor of an :class:`InferenceServerImpl`; picklable, usable from any member.

    Get it with ``group.get_paired(server_name).to_here()``.

    Args:
        server_name: The host's ``server_name``.
        group: The host's RpcGroup.
        host: The hosting member's name (for :class:`~machinlike.exception.PeerLostError`).
        host_incarnation: Its incarnation (a restarted host is another server).
        host_process: The host's ``process_identity()`` (boot id, namespaces, pid), to tell whether
            this process shares its memory.
        shm_threshold: Bytes from which a tensor travels through shared memory to a host
            on this host; None: as every RpcGroup call (the World's ``shm_threshold``).
    """

    def __init__(self, server_name: str, group: RpcGroup, host: str, host_incarnation: int = 1,
                 host_process: str = "", shm_threshold: Optional[int] = None) -> None:
        self.server_name = check_name(server_name, "server_name")
        self.group = check_group(group)
        self.host = host
        self.host_incarnation = host_incarnation
        self.host_process = host_process
        self.shm_threshold = shm_threshold
        self._key = f"{server_name}/infer"
        self._local: Optional[bool] = None  # decided once per process
        self._host_word = 0  # the host's process identity word, once local (``_shm.guard``)

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_local"] = None  # a verdict of this process only
        state["_host_word"] = 0
        return state

    def __repr__(self) -> str:
        return f"<InferenceServer {self.server_name!r} on {self.host!r}>"

    def _same_host(self) -> bool:
        if self._local is None:
            pid = pid_in(self.host_process)
            self._local = bool(self.shm_threshold is not None and pid and is_here(self.host_process)
                               and _shm.reachable(pid))
            self._host_word = _pids.identity(pid) if self._local else 0
        return self._local

    def infer(self, x: Inputs, timeout: Optional[float] = None, with_version: bool = False) -> Any:
        """``fn``'s output for the rows of ``x``, computed in a batch with other callers' rows.

        Thread-safe: concurrent calls of one process are batched together too.

        Args:
            x: A tensor, a tuple of tensors, or a dict of tensors by name (a ``Dict``
                observation), all with the same number of rows (along dim 0). A tuple
                reaches ``fn`` as separate positional arguments, a dict as one argument
                (``fn(x)``); requests join a batch only with the same keys in the same order.
            timeout: Seconds for the whole call (the wait for a batch included); None: the
                world's ``rpc_timeout``.
            with_version: Return ``(output, version)``: the version of the weights that
                computed it (see :meth:`InferenceServerImpl.update`).

        Returns:
            ``fn``'s output rows for ``x`` (a tensor, tuple or dict of tensors, as ``fn``
            returns), on the CPU, or on the GPU ``x`` came on when it holds CUDA tensors
            (from a caller on this host: device to device through CUDA IPC); with
            ``with_version``, ``(output, version)``.

        Raises:
            TypeError, ValueError: ``x`` is not rows of tensors, or a bad ``timeout``
                (nothing is sent).
            PeerLostError: the host is gone (named).
            TimeoutError: no answer within ``timeout``.
            ServerStoppedError: the server was closed.
            RuntimeError: the host's queue is full (``max_pending``).
            Exception: what ``fn`` raised on these rows (its type; the host's traceback
                as ``__cause__``).
        """
        world, args, wait = self._request(x, timeout, with_version)
        return self._answer(world, lambda: self.group.registered_sync(self._key, args, timeout=wait), with_version)

    def infer_async(self, x: Inputs, timeout: Optional[float] = None,
                    with_version: bool = False) -> torch.futures.Future:
        """:meth:`infer` without waiting: a future of its output, so that an actor steps one
        half of its environments while the other half's rows are in a batch (double
        buffering), or awaits it in a coroutine.

        Returns:
            A ``torch.futures.Future``: ``wait()`` (or ``await``) gives what :meth:`infer`
            returns, or raises what it raises.

        Raises:
            TypeError, ValueError: as :meth:`infer` (here: nothing is sent).
        """
        world, args, wait = self._request(x, timeout, with_version)
        return self.group.registered_async(self._key, args, timeout=wait).then(
            lambda fut: self._answer(world, fut.wait, with_version), _note=False)

    def _answer(self, world: Any, reply: Callable[[], Any], with_version: bool) -> Any:
        """What a request gives: ``reply()``'s output (with its version when asked); a
        failure that means the host is gone names the host."""
        try:
            out, version = reply()
        except (PeerLostError, KeyError) as err:
            if raised_remotely(err):  # fn's own KeyError (cold trial 29: it was told "closed")
                raise
            gone = self._host_gone(world, err)
            if gone is err:
                raise
            raise gone from err
        return (out, version) if with_version else out

    def _request(self, x: Any, timeout: Any, with_version: Any) -> Tuple[Any, Tuple[Any, ...], float]:
        """``(world, the service's arguments, seconds)`` of one request, its inputs checked
        (and, to a host on this host, their large tensors in shared memory)."""
        world = get_world()
        if world is None:
            raise RuntimeError("infer() needs a World in this process (machinlike.distributed.World)")
        wait = _checks.seconds_or_none("timeout", timeout, world.rpc_timeout)
        if not isinstance(with_version, bool):
            raise TypeError(f"with_version must be a bool, not {type(with_version).__name__}")
        x, rows = check_inputs(x)
        reply = 0
        if self._same_host() and (x.device.type == "cpu" if isinstance(x, torch.Tensor)
                                  else all(t.device.type == "cpu" for t in tensors_of(x))):
            threshold = self.shm_threshold or 0
            # (with this process's identity and deadline: see ``_shm._terms``)
            reply = _shm.terms(threshold, due=None if wait is None else time.monotonic() + wait)
            if not isinstance(x, torch.Tensor) or x.nbytes >= threshold:  # a small tensor stays as it is
                x = _shm.encode(x, threshold, self._host_word)
        return world, (x, rows, world.name, world.incarnation, wait, reply), wait

    def _host_gone(self, world: Any, err: BaseException) -> BaseException:
        """What a failed request raises: the host named when it is gone, else ``err``."""
        if isinstance(err, PeerLostError):
            if err.member == self.host:
                return err
            # The RPC worker of a host just declared lost may no longer map to its member.
            return PeerLostError(self.host, f"host of inference server {self.server_name!r}: {err.detail}")
        # A lost host's services vanish with its claims: say who is gone, not "not found".
        now = world.get_incarnation(self.host)
        if now == self.host_incarnation:  # the host lives and closed the server (its service is withdrawn)
            return ServerStoppedError(f"inference server {self.server_name!r} on {self.host!r} was closed (its "
                                      f"host withdrew it); a new one needs a new accessor: "
                                      f"group.get_paired({self.server_name!r})")
        why = ("it left or was lost" if now is None else
               f"it came back (incarnation {now}) and this accessor names incarnation "
               f"{self.host_incarnation}: get a new one with group.get_paired({self.server_name!r})")
        return PeerLostError(self.host, f"host of inference server {self.server_name!r}: {why}")


def _large(out: Any, threshold: int) -> bool:
    """Whether an output holds a tensor worth sending through shared memory."""
    if isinstance(out, torch.Tensor):
        return out.layout == torch.strided and out.nbytes >= threshold  # (a sparse tensor has no nbytes)
    values = out.values() if isinstance(out, dict) else out
    return any(t.layout == torch.strided and t.nbytes >= threshold for t in values)


def _check_wait(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"max_wait={value!r} must be a number of seconds, not {type(value).__name__}")
    if not (value >= 0 and math.isfinite(value)):
        raise ValueError(f"max_wait={value!r} must be zero (take what waits) or a positive number of seconds")
    return float(value)


def _check_version(value: Any, param: str = "version") -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{param} must be an int, not {type(value).__name__} ({value!r})")
    return value


class InferenceServerImpl:
    """Host of a batched inference server, in the process that constructs it.

    It registers the asynchronous service ``"<server_name>/infer"`` in ``group`` and pairs
    an :class:`InferenceServer` accessor under ``server_name``; callers get it with
    ``group.get_paired(server_name).to_here()``.

    Args:
        server_name: Name of the server, unique in ``group``.
        group: The RpcGroup callers reach it through (this process must be a member).
        fn: A callable or ``nn.Module`` taking the joined rows of many requests (a tuple
            input as separate positional arguments) and returning a tensor, or a tuple,
            list or dict of tensors, one row per input row. Run under ``torch.no_grad``
            by one thread.
        max_batch: Rows per call of ``fn`` at most; a single larger request runs alone.
        max_wait: Seconds the oldest waiting request waits for more rows (0: none); the
            wait ends sooner once every caller served in the last second has sent as many
            requests as to its last batch (a lone caller does not wait).
        model_server: A :class:`PushPullModelServer` accessor whose newest weights are
            pulled into ``fn`` (a module) every ``pull_every`` seconds, swapped in between
            batches; None: weights change through :meth:`update` only.
        pull_every: Seconds between pulls from ``model_server``.
        version: The version of ``fn``'s weights now.
        device: Where batches go before ``fn``; None: where they came (the CPU, or the
            callers' GPU). Outputs go back to each request's own device (the CPU, or the
            GPU its inputs came on).
        max_pending: Requests waiting at most; beyond, requests fail with RuntimeError.
        shm_threshold: Bytes from which a tensor of a caller on this host travels
            through shared memory (below, through TensorPipe); None: leave it to the
            World's ``shm_threshold`` as every RpcGroup call.

    Raises:
        KeyError: ``server_name`` is already used in ``group``.
        TypeError, ValueError: invalid arguments (named).
    """

    def __init__(self, server_name: str, group: RpcGroup, fn: Callable[..., Any], *, max_batch: int = 64,
                 max_wait: float = 0.002, model_server: Optional[PushPullModelServer] = None,
                 pull_every: float = 1.0, version: int = 0, device: Union[None, str, torch.device] = None,
                 max_pending: int = 4096, shm_threshold: Optional[int] = 64 << 10) -> None:
        self.server_name = check_name(server_name, "server_name")
        self.group = check_group(group)
        if not callable(fn):
            raise TypeError(f"fn must be a callable or an nn.Module, not {type(fn).__name__}")
        max_batch = _checks.positive_int("max_batch", max_batch)
        max_wait = _check_wait(max_wait)
        max_pending = _checks.positive_int("max_pending", max_pending)
        pull_every = _checks.seconds("pull_every", pull_every)
        if shm_threshold is not None:
            shm_threshold = _checks.positive_int("shm_threshold", shm_threshold)
        if model_server is not None:
            if not isinstance(model_server, PushPullModelServer):
                raise TypeError(f"model_server must be a PushPullModelServer accessor or None, not "
                                f"{type(model_server).__name__}")
            if not isinstance(fn, torch.nn.Module):
                raise TypeError(f"model_server needs fn to be an nn.Module to load weights into, not "
                                f"{type(fn).__name__}")
        world = get_world()
        if world is None:
            raise RuntimeError("InferenceServerImpl needs a World in this process")
        where = None if device is None else _checks.local_device("device", device)
        self._slot = ModelSlot(fn, _check_version(version), where)
        self._batcher = Batcher(server_name, self._slot.run, self._alive, max_batch, max_wait, max_pending)
        self._world = world
        self._key = f"{server_name}/infer"
        self._closed = False
        try:
            group.register(self._key, self._service())
            try:
                group.pair(server_name, InferenceServer(server_name, group, world.name, world.incarnation,
                                                        process_identity(), shm_threshold))
            except BaseException:
                group.deregister(self._key)
                raise
        except BaseException:
            self._batcher.close(1.0)
            raise
        self._puller = None if model_server is None else \
            Puller(server_name, model_server, self._slot, pull_every)
        self._unnote = publish_notes(self._notes)  # (withdrawn at close)

    def __repr__(self) -> str:
        return f"<InferenceServerImpl {self.server_name!r} max_batch={self._batcher.max_batch}>"

    def _alive(self, member: str, incarnation: int) -> bool:
        # A caller restarted a moment ago is live though this view may still list its old
        # incarnation, or have seen that one lost and not yet the new join (cold trial 11).
        return self._world.membership.may_run(member, incarnation)

    def _service(self) -> Callable[..., Any]:
        batcher, what = self._batcher, self.server_name

        def encoder(reply: int) -> Callable[[Any], Any]:
            threshold, caller, _ = _shm.split_terms(reply)

            def encode(value: Any) -> Any:
                if not _large(value[0], threshold):
                    return value
                if _shm.overdue(reply):  # its caller stopped waiting: lend it nothing (``_shm._terms``)
                    batcher.note_overdue()
                    return value
                return _shm.encode(value, threshold, caller)

            return encode

        @rpc.functions.async_execution
        def infer(x: Inputs, rows: int, caller: str, incarnation: int, timeout: float,
                  reply: int) -> torch.futures.Future:
            x, got = check_inputs(x)
            if got != rows:
                raise ValueError(f"inference server {what!r}: a request of {got} rows said {rows}")
            fut: torch.futures.Future = torch.futures.Future()
            batcher.submit(Request(x, rows, fut, caller, incarnation, timeout, encoder(reply) if reply else None))
            return fut

        return infer

    def update(self, state: Union[torch.nn.Module, Mapping[str, Any]], version: int) -> None:
        """Load new weights into ``fn`` between two batches; later outputs carry ``version``.

        Args:
            state: A module of ``fn``'s architecture, or its state dict.
            version: The version of these weights (returned by ``infer(with_version=True)``).

        Raises:
            TypeError: ``fn`` is not an ``nn.Module``, or ``state`` / ``version`` has the
                wrong type.
            ValueError: ``state`` does not fit ``fn`` (names, shapes; nothing is loaded),
                or ``version`` is below :attr:`version` (outputs' versions never go back).
        """
        module = self._slot.module
        if module is None:
            raise TypeError(f"inference server {self.server_name!r} runs {type(self._slot.fn).__name__}, not an "
                            f"nn.Module: it has no weights to update")
        if isinstance(state, torch.nn.Module):
            state = unwrap(state).state_dict()
        elif not isinstance(state, Mapping):
            raise TypeError(f"state must be an nn.Module or a state dict, not {type(state).__name__}")
        _check_version(version)
        diff = mismatch(spec_of(module.state_dict()), spec_of(state), "fn", "state", check_dtypes=False)
        if diff is not None:
            raise ValueError(f"cannot update inference server {self.server_name!r} (nothing was loaded): {diff}")
        try:
            self._slot.load(state, version)
        except StaleVersionError as exc:
            raise StaleVersionError(f"cannot update inference server {self.server_name!r}: {exc}") from None

    @property
    def version(self) -> int:
        """The version of the weights the next batch runs with."""
        return self._slot.version

    def stats(self) -> Dict[str, Any]:
        """What the host did since it started.

        Keys: ``requests`` (accepted), ``batches`` (calls of ``fn``), ``failed_batches``
        (calls of ``fn`` that raised), ``rows`` (answered), ``batched_requests`` (requests
        answered), ``mean_batch`` / ``mean_requests`` (rows / requests per call that answered),
        ``queue_wait_p50`` / ``queue_wait_p95`` (seconds from a request's arrival to its
        batch's start) and ``fn_time_p50`` / ``fn_time_p95`` (seconds per call), over the
        last 4096 samples (None before any), ``dropped`` (rows of requests whose caller
        was seen gone: skipped, or run while it went, and not counted as answered),
        ``expired`` (requests that outwaited their caller's timeout), ``overdue`` (results
        made once their caller's timeout passed: sent without shared memory), ``errors`` (requests
        failed by ``fn``), ``isolations`` (failed batches re-run request by request),
        ``rejected`` (over ``max_pending``), ``pending`` (waiting now), ``version``; with
        a ``model_server`` also ``pulls`` (new weights loaded), ``pull_failures`` and
        ``stale_pulls`` (pulled weights older than an :meth:`update` made since: not loaded).
        """
        out = self._batcher.stats()
        out["version"] = self._slot.version
        if self._puller is not None:
            out["pulls"], out["pull_failures"] = self._puller.pulls, self._puller.failures
            out["stale_pulls"] = self._puller.stale
        return out

    def _notes(self) -> List[ServerNote]:
        """Its numbers for the status view: requests taken, refused (over ``max_pending``),
        rows dropped (callers gone), requests waiting."""
        counts = self._batcher.stats()
        return [ServerNote("inference", self.server_name, self.group.get_group_name(), "host",
                           version=self._slot.version, accepted=counts["requests"], refused=counts["rejected"],
                           dropped=counts["dropped"], queued=counts["pending"])]

    def close(self, timeout: Optional[float] = None) -> None:
        """Withdraw the service and the accessor; waiting requests fail with
        :class:`ServerStoppedError`. Safe to call twice.

        Args:
            timeout: Seconds to wait for a running batch and a running pull; None: the
                world's ``rpc_timeout``.

        Raises:
            TimeoutError: the batcher was still running a batch when the time ran out.
        """
        if self._closed:
            return
        self._closed = True
        self._unnote()
        wait = _checks.seconds_or_none("timeout", timeout, self._world.rpc_timeout)
        self.group.deregister(self._key)
        self.group.unpair(self.server_name)
        if self._puller is not None:
            self._puller.close(wait)
        self._batcher.close(wait)
