"""PushPullModelServer: whole models synchronised on a strictly ordered version chain.

Data flow::

    client                                             ordered server (a host process)
    ------                                             -------------------------------
    push(model): state dict as version v+1   ───────►  accepted iff the newest is v
                 on top of model.pp_version = v        (exactly one of concurrent pushers)
       accepted: model.pp_version = v+1
       rejected: pull(model) when pull_on_fail
    pull(model): pull_if_changed(v)          ───────►  None if v is the newest: no transfer
                 (on the host's machine, v == its version word: no call; _version_words)
       newer: validate, load_state_dict, model.pp_version = newest

The architecture is checked at the client before anything is sent or loaded: the first
push through an accessor reads (or, on an empty server, claims) the server's spec, the
names, shapes and dtypes of the state dict, stored under the key ``"<model_name>/spec"``.

A model's version is the plain attribute ``model.pp_version`` (machin's name); a model that
has none is taken to be at version 0 when pushing, and to have no version when pulling
(so it always receives the newest state); nor has one whose tensors were written in place
since its version was set (``_model_version``).

Churn. The host's death reaches clients as :class:`~machinlike.exception.PeerLostError`
naming it (see :mod:`machinlike.server.ordered`). With ``checkpoint_dir`` the chain is
checkpointed as a ``"model-server"``; a restarted host resumes the last checkpointed
state under a version above every version handed out before, so a client holding a
newer, lost version pulls the resumed state on its next pull or rejected push.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..distributed import RpcGroup
from ._budget import CallBudget
from ._errors import ServerStoppedError, closed_here
from ._finite import non_finite
from ._common import ServerNote, check_group, check_name, check_timeout, publish_notes, rpc_timeout
from ._host import HostCheckpoint, host_checkpoint
from ._state_pool import StatePool, load_whole
from ._model_version import VERSION_ATTR, get_version, held_version, set_version
from ._spec import Spec, check_module, loadable, mismatch, spec_of, unwrap
from .ordered import OrderedServerBase, OrderedServerSimple, OrderedServerSimpleImpl

__all__ = ["PushPullModelServer", "PushPullModelServerImpl"]


def _loaded(target: torch.nn.Module) -> List[torch.Tensor]:
    """The tensors a pull writes into (a version's mark watches them).

    Why not ``parameters()`` and ``buffers()``: their de-duplicating walks cost more than
    an up-to-date pull on the host's machine (a shared tensor counted twice is harmless).
    """
    return [t for module in target.modules() for table in (module._parameters, module._buffers)
            for t in table.values() if t is not None]


class PushPullModelServer:
    """Accessor of a :class:`PushPullModelServerImpl`; picklable.

    Get it with ``group.get_paired(server_name).to_here()`` or
    :func:`~machinlike.server.model_server_helper`.

    Args:
        model_name: Key of the model in the ordered server.
        o_server: Accessor of the ordered server holding the version chain.

    Raises:
        TypeError: ``o_server`` is missing or not an :class:`OrderedServerBase`.
    """

    def __init__(self, model_name: str, o_server: Optional[OrderedServerBase] = None) -> None:
        self.model_name = check_name(model_name, "model_name")
        if not isinstance(o_server, OrderedServerBase):
            raise TypeError(f"o_server must be an OrderedServerBase accessor, not {type(o_server).__name__}; "
                            f"get a ready accessor with group.get_paired(server_name).to_here()")
        self.o_server = o_server
        self._spec: Optional[Spec] = None

    @classmethod
    def _checked(cls, model_name: str, o_server: OrderedServerBase) -> "PushPullModelServer":
        """Built from values its host checked already."""
        self = cls.__new__(cls)
        self.model_name, self.o_server = model_name, o_server
        self._spec = None
        return self

    def __getstate__(self) -> Dict[str, Any]:
        state = dict(self.__dict__)
        state["_spec"] = None  # a cache of this process only
        state.pop("_closed_here", None)  # (closed by this process's handles: not where it goes)
        return state

    def __repr__(self) -> str:
        return f"<PushPullModelServer {self.model_name!r} on {self.o_server!r}>"

    #: Set by :meth:`ServerHandles.close` on this member: every later call is refused.
    _closed_here = False

    def _budget(self, timeout: Any, what: str) -> CallBudget:
        if self._closed_here:
            where = getattr(self.o_server, "server_name", None)  # (a user's OrderedServerBase may have none)
            raise ServerStoppedError(closed_here(f"model {self.model_name!r}" + (f" of {where!r}" if where else "")))
        seconds = check_timeout(timeout) or self.o_server.timeout or rpc_timeout()
        return CallBudget(seconds, f"{what} model {self.model_name!r}")

    def _server_spec(self, mine: Spec, budget: CallBudget) -> Spec:
        if self._spec is None:
            key = f"{self.model_name}/spec"
            got = self.o_server._bounded(budget.left()).pull(key)
            # On an empty server the first pusher's architecture becomes the server's; of
            # two racing first pushers exactly one claims it, the other reads it back.
            if got is None and not self.o_server._bounded(budget.left()).push(key, mine, 0, None):
                got = self.o_server._bounded(budget.left()).pull(key)
            self._spec = mine if got is None else got[0]
        return self._spec

    def push(self, model: torch.nn.Module, pull_on_fail: bool = True, *, timeout: Optional[float] = None) -> bool:
        """Push the model's state dict as the version after ``model.pp_version``.

        Gradients are not touched.

        Args:
            model: The model; its state dict is sent (of the module it wraps for a
                compiled (``torch.compile``), ``DistributedDataParallel`` or ``DataParallel`` model,
                so that plain models pull it). From a GPU, the server gets a copy on the
                same device index when it uses CUDA (device to device through CUDA IPC on
                this host), else on the CPU.
            pull_on_fail: When another version got there first, load the newest one into
                ``model`` (see :meth:`pull`).
            timeout: Seconds for the whole push's waits on the server (the pull after a
                rejection included; loading what arrived in time is not cut short); None:
                the ordered server accessor's timeout (the World's ``rpc_timeout``).

        Returns:
            True if the push made the next version (``model.pp_version`` is incremented),
            False if it was rejected.

        Raises:
            TypeError: ``model`` is not an ``nn.Module``.
            ServerStoppedError: the helper's ``close()`` ran on this member.
            ValueError: the server holds a model of another architecture (names, shapes or
                dtypes differ; the message lists them), or a parameter holds NaN or inf
                (named; nothing is sent; buffers are not looked at: a mask may hold -inf).
            TimeoutError: not done within ``timeout``.
        """
        state = unwrap(check_module(model)).state_dict()
        with self._budget(timeout, "push of") as budget:
            return self._push(model, state, pull_on_fail, budget)

    def _push(self, model: torch.nn.Module, state: Dict[str, Any], pull_on_fail: bool, budget: CallBudget) -> bool:
        mine = spec_of(state)
        diff = mismatch(self._server_spec(mine, budget), mine, "the server's model", "this model")
        if diff is not None:
            raise ValueError(f"cannot push model {self.model_name!r}: the server holds another architecture: {diff}")
        # Parameters only: a buffer may hold an infinity by design (an attention mask).
        names = {name for name, _ in unwrap(model).named_parameters()}
        poisoned = non_finite({k: v for k, v in state.items() if k in names})
        if poisoned:
            # Every client would load it at its next pull, and act or learn on NaN for good.
            shown = ", ".join(repr(n) for n in poisoned[:6]) + (f" and {len(poisoned) - 6} more" if len(poisoned) > 6 else "")
            raise ValueError(f"cannot push model {self.model_name!r}: {shown} hold NaN or inf values; nothing was "
                             f"sent. The training step that made them diverged: restore the last good state "
                             f"(pull() loads the server's) and lower the learning rate or clip gradients")
        version = get_version(model)
        base = 0 if version is None else version
        # A CUDA tensor stays on its GPU: a snapshot (clone) the learner never edits, which
        # the call moves through CUDA IPC to a server on this host that uses CUDA, or stages
        # (distributed._calls.cuda_stage) to any other; the server keeps what it received.
        payload = {k: ((v.detach().clone() if v.is_cuda else v.detach().cpu()) if isinstance(v, torch.Tensor) else v)
                   for k, v in state.items()}
        stored, version = self.o_server._bounded(budget.left())._push_as(self.model_name, payload, base + 1, base)
        if stored:
            # (base + 1, or above every version of an earlier host: _store_lease)
            set_version(model, version, VERSION_ATTR, self._chain(), _loaded(unwrap(model)))
            return True
        if pull_on_fail:
            self._pull(model, budget)
        return False

    def pull(self, model: torch.nn.Module, *, timeout: Optional[float] = None) -> bool:
        """Load the newest version into ``model`` unless it already has it.

        Nothing is transferred when ``model.pp_version`` is the newest version, set by this
        server's push or pull, and no parameter or buffer was written in place since (an
        optimizer step, a ``fill_``, a train-mode forward's batch-norm statistics; a write
        through ``.data`` is not seen); on the host's machine the host's version word says
        so without a call. Gradients
        are not cleared. Values are converted to the model's dtypes as ``load_state_dict``
        converts them (a float32 learner's weights into a bfloat16 actor).

        Args:
            model: A model of the server's architecture (compiled or wrapped: as :meth:`push`).
            timeout: Seconds for the pull's waits on the server; None: the ordered server
                accessor's timeout (the World's ``rpc_timeout``). A state that arrived in
                time is loaded into ``model`` even when loading takes the call past it.

        Returns:
            True if a newer state was loaded (``model.pp_version`` updated), False if the
            model already had the newest version or the server holds none yet.

        Raises:
            TypeError: ``model`` is not an ``nn.Module``.
            ServerStoppedError: the helper's ``close()`` ran on this member.
            ValueError: the server's state dict does not fit ``model`` (names or shapes, or
                a cast that would lose meaning, such as complex to real; nothing is loaded).
            TimeoutError: not done within ``timeout``. On this host a pull reads the
                server's memory in place and loads again a version rewritten while it
                read; should newer versions keep coming faster than it reads until the
                time runs out, ``model`` holds a mix of versions and no version
                (``model.pp_version`` None: the next pull loads the newest whole).
        """
        check_module(model)
        with self._budget(timeout, "pull of") as budget:
            return self._pull(model, budget)

    def _chain(self) -> str:
        return f"{getattr(self.o_server, 'server_name', '')}/{self.model_name}"

    def _pull(self, model: torch.nn.Module, budget: CallBudget) -> bool:
        target = unwrap(model)
        chain = self._chain()

        def load(state: Dict[str, Any]) -> None:
            diff = loadable(spec_of(state), spec_of(target.state_dict()), "the server's model", "this model")
            if diff is not None:
                raise ValueError(f"cannot pull model {self.model_name!r} into a model of another architecture "
                                 f"(nothing was loaded): {diff}")
            target.load_state_dict(state)

        def pull() -> Any:
            held = held_version(model, VERSION_ATTR, chain, _loaded(target))
            return self.o_server._bounded(budget.left())._pull_in_place(self.model_name, held)

        return load_whole(pull, load, lambda version: set_version(model, version, VERSION_ATTR, chain, _loaded(target)),
                          budget)


class PushPullModelServerImpl:
    """Host of a model server, in the process that constructs it (a member of ``group``).

    It pairs a :class:`PushPullModelServer` accessor under ``server_name``; with
    ``o_server=None`` it also hosts the ordered server holding the chain, named
    ``"<server_name>/ordered"`` (version_depth 1).

    Args:
        server_name: Name of the server, unique in ``group``.
        group: The RpcGroup clients reach the server through.
        model_name: Key of the model in the ordered server.
        o_server: Accessor of an existing ordered server to keep the chain in; None: host one.
        checkpoint_dir: Directory where the hosted chain (state dicts and versions) is
            checkpointed atomically; a host whose directory holds one resumes from it
            here, under a version above every version handed out before. None: none.
        checkpoint_every: With ``checkpoint_dir``: write one every this many versions.
        checkpoint_interval: With ``checkpoint_dir``: also write one when a version is
            made this many seconds or more after the last; None: by versions only.

    Raises:
        KeyError: the name is already used in ``group``.
        TypeError, ValueError: invalid arguments (a checkpoint with an ``o_server``).
        CheckpointError: the checkpoint is corrupt or another server's (named).
    """

    def __init__(self, server_name: str, group: RpcGroup, model_name: str = "model",
                 o_server: Optional[OrderedServerBase] = None, checkpoint_dir: Any = None,
                 checkpoint_every: int = 100, checkpoint_interval: Optional[float] = None) -> None:
        check_name(server_name, "server_name")
        check_group(group)
        check_name(model_name, "model_name")
        if o_server is not None and not isinstance(o_server, OrderedServerBase):
            raise TypeError(f"o_server must be an OrderedServerBase accessor or None, not {type(o_server).__name__}")
        # The chain hosted here is checkpointed as a model server, under this server's name.
        checkpoint = host_checkpoint(checkpoint_dir, "model-server", server_name, checkpoint_every,
                                     checkpoint_interval)
        if o_server is not None and checkpoint is not None:
            raise ValueError(f"checkpoint_dir={checkpoint_dir!r} needs the ordered server hosted here "
                             f"(o_server=None); pass checkpoint_dir to the host of {o_server!r} instead")
        self._open(server_name, group, model_name, o_server, checkpoint)

    @classmethod
    def _checked(cls, server_name: str, group: RpcGroup, model_name: str = "model",
                 checkpoint: Optional[HostCheckpoint] = None) -> "PushPullModelServerImpl":
        """Built from values a helper checked already (the chain hosted here; ``checkpoint``
        made by ``host_checkpoint`` for this server's name, None: none)."""
        self = cls.__new__(cls)
        self._open(server_name, group, model_name, None, checkpoint)
        return self

    def _open(self, server_name: str, group: RpcGroup, model_name: str, o_server: Optional[OrderedServerBase],
              checkpoint: Optional[HostCheckpoint]) -> None:
        self.server_name = server_name
        self.group = group
        self.model_name = model_name
        self.o_server_impl: Optional[OrderedServerSimpleImpl] = None
        self._pool = StatePool()
        if o_server is None:
            try:
                self.o_server_impl = OrderedServerSimpleImpl._checked(f"{server_name}/ordered", group, 1,
                                                                      self._pool, checkpoint)
            except KeyError as err:  # (its services' names are ours: say which server is taken)
                self._pool.close()
                raise KeyError(f"model server {server_name!r} already exists in group {group.get_group_name()!r} "
                               f"({err.args[0] if err.args else err}); close it first, or pick another "
                               f"server_name") from err
            o_server = OrderedServerSimple._checked(f"{server_name}/ordered", group)
        self.o_server = o_server
        try:
            group.pair(server_name, PushPullModelServer._checked(model_name, o_server))
        except BaseException:
            if self.o_server_impl is not None:
                self.o_server_impl.close()
            self._pool.close()
            raise
        self._closed = False
        self._unnote = publish_notes(self._notes)  # (withdrawn at close)

    def __repr__(self) -> str:
        return f"<PushPullModelServerImpl {self.server_name!r} model {self.model_name!r}>"

    def stats(self) -> Dict[str, Any]:
        """What the host serves: ``version`` (the newest version of the model, None before
        the first push), ``since_version``, ``clients``, with ``checkpoint_dir`` also
        ``checkpoints``, ``checkpoint_failures`` and ``resumed_version``, in an elastic world
        ``members`` (as for :meth:`OrderedServerSimpleImpl.stats`), and ``ordered``: the
        hosted ordered server's whole stats (they count ``"<model_name>/spec"`` too, the
        architecture the first push fixed: a key and a push more than the model's own,
        and a pull more per accessor that pushed).

        Raises:
            RuntimeError: the chain is kept in an external ordered server (ask its host).
        """
        if self.o_server_impl is None:
            raise RuntimeError(f"model server {self.server_name!r} keeps its chain in {self.o_server!r}: call "
                               f"stats() on that ordered server's host")
        ordered = self.o_server_impl.stats()
        out = {"version": self.o_server_impl.newest_version(self.model_name), "ordered": ordered}
        for name in ("since_version", "clients", "members", "checkpoints", "checkpoint_failures", "resumed_version"):
            if name in ordered:
                out[name] = ordered[name]
        return out

    @property
    def checkpoint_path(self) -> Optional[str]:
        """The hosted chain's checkpoint file; None without ``checkpoint_dir``."""
        return None if self.o_server_impl is None else self.o_server_impl.checkpoint_path

    def checkpoint(self) -> str:
        """Write the hosted chain's checkpoint now (see :meth:`OrderedServerSimpleImpl.checkpoint`).

        Returns:
            The checkpoint file's path.

        Raises:
            RuntimeError: no ``checkpoint_dir`` (or the chain is kept in an external
                ordered server: checkpoint its host), or closed.
            OSError: the file could not be written.
        """
        if self.o_server_impl is None:
            raise RuntimeError(f"model server {self.server_name!r} keeps its chain in {self.o_server!r}: call "
                               f"checkpoint() on that ordered server's host")
        return self.o_server_impl.checkpoint()

    def _notes(self) -> List[ServerNote]:
        """Its numbers for the status view (none but its name when its chain is elsewhere)."""
        note = ServerNote("model", self.server_name, self.group.get_group_name(), "host")
        if self.o_server_impl is None:
            return [note]
        ordered, version = self.o_server_impl.stats(), self.o_server_impl.newest_version(self.model_name)
        return [note._replace(version=version if isinstance(version, int) else None,
                              accepted=ordered["pushes_accepted"], refused=ordered["pushes_rejected"],
                              since=ordered["since_version"])]

    def close(self) -> None:
        """Withdraw the accessor (and the hosted ordered server); the name can be reused."""
        if self._closed:
            return
        self._closed = True
        self._unnote()
        self.group.unpair(self.server_name)
        if self.o_server_impl is not None:
            self.o_server_impl.close()
        self._pool.close()
