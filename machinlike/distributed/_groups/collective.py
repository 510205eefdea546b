"""CollectiveGroup: torch collectives over a subset of the world's ranks.

A thin layer over ``torch.distributed`` with the group bound in. Ranks are global ranks,
as in torch. What it adds: receiving from any source reports the *global* sender rank
(``recv`` returns it, ``irecv(...).wait()`` yields it), calling an op from a process
outside the group is a clear error instead of torch's silent no-op, and a tensor that is
not contiguous (a transposed or sliced one) is exchanged through a contiguous copy
(``dense.DenseStage``), where gloo silently reduced the wrong elements.
"""

from __future__ import annotations

import datetime
import functools
import numbers
import threading
import time
from typing import Any, Callable, List, Optional, Sequence, Set, TypeVar

import torch
import torch.distributed as dist

from ... import _checks
from .._store import forked as _forked
from . import collective_args as _args
from .collective_failures import FailureNamer, GroupHealth, NamedWork
from .dense import DenseStage
from .substitutes import PairwiseAllToAll, ReduceScatterByAllReduce, lacks, wait_works

__all__ = ["CollectiveGroup", "RetiredGroups"]

ReduceOp = dist.ReduceOp

_Op = TypeVar("_Op", bound=Callable[..., Any])


def _named(method: _Op) -> _Op:
    """``method``, with gloo's errors of a member's death or silence named (FailureNamer)."""
    @functools.wraps(method)
    def run(self: "CollectiveGroup", *args: Any, **kwargs: Any) -> Any:
        namer, health, op = self._namer, self._health, method.__name__
        health.check()
        try:
            result = method(self, *args, **kwargs)
        except RuntimeError as err:
            failure = health.failed(op, err, err if namer is None else namer(op, self.ranks, self._timeout, err))
            if failure is err:
                raise
            raise failure from err
        if namer is None or not (hasattr(result, "wait") and hasattr(result, "is_completed")):
            return result  # (None, a sender's rank)
        ranks = self.ranks
        return NamedWork(result, lambda bound, whose, err: health.failed(op, err, namer(op, ranks, bound, err, whose)),
                         self._timeout)
    return run  # type: ignore[return-value]


# What CollectiveGroup._native returns when the collective is to run as its substitute.
_SUBSTITUTE = object()
# Collectives that run as their substitute on a backend that has them, because it is slower:
# gloo's alltoall took 2.3-4 times the time of the pairwise exchange, which moves the same
# bytes, at every size tried (3 and 4 ranks, pieces of 1 KB to 16 MB, torch 2.13, one host;
# benchmarks/collective.py). (Not gloo's reduce_scatter: its substitute moves size() times
# the data, and lost from 16 MB pieces on.)
_SLOWER = {"gloo": frozenset({"alltoall"})}


def _finish(stage: DenseStage, work: Any, async_op: bool) -> Any:
    """What a collective started with ``async_op=True`` returns: its handle, or None once done."""
    if async_op:
        return stage.done(work, True)
    if work is not None:  # (torch 2.14's stubs type a Work as Optional)
        work.wait()
    return stage.done(None, False)


class _AnySourceRecv:
    """Handle of a receive from any source; ``wait()`` returns the global sender rank."""

    def __init__(self, work: Any, group: Any) -> None:
        self._work = work
        self._group = group

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> int:
        wait_works([self._work], timeout)
        return dist.get_global_rank(self._group, self._work._source_rank())

    def is_completed(self) -> bool:
        return self._work.is_completed()


class _KnownSourceRecv:
    def __init__(self, work: Any, src: int) -> None:
        self._work = work
        self._src = src

    def wait(self, timeout: Optional[datetime.timedelta] = None) -> int:
        wait_works([self._work], timeout)
        return self._src

    def is_completed(self) -> bool:
        return self._work.is_completed()


class RetiredGroups:
    """Process groups that were destroyed while their World runs, kept until it stops.

    Why: torch (seen on 2.13) can deadlock when the last reference to a gloo process
    group goes while one of its worker threads still has to destroy a finished work that
    was launched during a backward pass (DDP's all-reduce). Such a work holds a Python
    object (autograd stashes the caller's context in the thread's state), so that thread
    needs the GIL; ``~ProcessGroupGloo`` joins it while holding the GIL, because it runs
    inside the Python deallocator of whoever drops the last reference (DDP's reducer, when
    the test or user frame ends). Keeping destroyed groups here means that last release
    happens in :meth:`release` at the World's stop, after its waits on the store have
    released the GIL many times over, or in :meth:`keep` for groups retired
    ``RELEASE_AFTER`` seconds earlier, whose workers finished long ago.

    Bounded in number too: a group holds five descriptors (gloo's sockets, pipes and its
    event loop), so a program that makes and destroys groups in a loop ran out of them
    (ulimit -n 1024 after about 200 groups in 30 s). Past ``MAX_KEPT`` the oldest go at
    once, but never before ``MIN_AGE`` seconds after their destruction: ``keep`` waits
    for that with the GIL released, which is all a finishing gloo worker needs.
    """

    #: Seconds after its destruction that a group is dropped by a later ``keep``.
    RELEASE_AFTER = 30.0
    #: Groups kept at most; past it the oldest go (see ``MIN_AGE``).
    MAX_KEPT = 32
    #: Seconds a group is kept at least after its destruction.
    MIN_AGE = 0.1

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._kept: List[tuple] = []  # (when retired, process group), oldest first

    def keep(self, group: Any) -> None:
        """Hold ``group`` (already destroyed in torch) and drop the long-retired ones, and
        the oldest past ``MAX_KEPT``."""
        now = time.monotonic()
        with self._lock:
            old = [g for when, g in self._kept if now - when > self.RELEASE_AFTER]
            self._kept = [(when, g) for when, g in self._kept if now - when <= self.RELEASE_AFTER]
            self._kept.append((now, group))
            excess = max(0, len(self._kept) - self.MAX_KEPT)
            forced, self._kept = self._kept[:excess], self._kept[excess:]
        if forced:
            young = forced[-1][0] + self.MIN_AGE - time.monotonic()
            if young > 0:
                time.sleep(young)  # (an age, not a condition anything could signal; the GIL is free)
        del old, forced  # their last references go here, outside the lock

    def __len__(self) -> int:
        with self._lock:
            return len(self._kept)

    def release(self) -> None:
        """Drop every kept group (the World is stopping)."""
        with self._lock:
            kept, self._kept = self._kept, []
        del kept


class CollectiveGroup:
    """Collectives over a subset of ranks; create it with :meth:`World.create_collective_group`.

    The operations take the arguments of their ``torch.distributed`` counterparts without
    ``group``; ranks (``src``, ``dst``) are global ranks. With ``async_op=True`` an
    operation returns torch's work handle (``wait()``), otherwise None.

    Every operation raises ``RuntimeError`` in a process outside the group or after
    :meth:`destroy` (torch would silently do nothing), ``ValueError`` when a ``src``
    or ``dst`` is not a rank of the group or a list of pieces is not one tensor per member
    of the right dtype and number of elements, and ``TypeError`` when ``op`` is not a
    ``ReduceOp``: all before anything is sent.

    Attributes:
        group: The torch process group (e.g. for ``DistributedDataParallel(process_group=...)``);
            None in a process outside the group.
        ranks: The member ranks (global), sorted.
        current_rank: This process's index in ``ranks`` (machin's relative rank); None
            outside the group.
    """

    def __init__(self, group: Any, ranks: Sequence[int], my_rank: int,
                 retire: Optional[Callable[[Any], None]] = None, namer: Optional[FailureNamer] = None,
                 timeout: float = 0.0) -> None:
        self.group = group
        self.ranks = sorted(ranks)
        self._my_rank = my_rank
        self._retire = retire
        self._namer, self._timeout = namer, timeout  # (None: gloo's errors as they are)
        self._destroyed = False
        self._health = GroupHealth(self.ranks)
        # The collectives that run as their substitute: slower on this backend, or refused by
        # it (None: not known yet, see _native).
        self._substituted: Optional[Set[str]] = None

    @classmethod
    def create(cls, ranks: Sequence[int], my_rank: int, world_size: int, backend: Optional[str],
               timeout: float, retire: Optional[Callable[[Any], None]] = None,
               agree: Optional[Callable[[List[int], float], None]] = None,
               namer: Optional[FailureNamer] = None) -> "CollectiveGroup":
        """Build the group (every process of the world calls it); use
        :meth:`World.create_collective_group`, which checks its arguments and keeps track.

        Args:
            retire: Takes the torch group once destroyed (:meth:`RetiredGroups.keep`);
                None: the group goes with its last reference.
            agree: ``agree(ranks, timeout)`` returns once every process stated the same
                ranks for this creation (``creation_order``), after the arguments are
                checked and before torch makes the group; None: not checked.
            namer: Names the member whose death or silence ended a collective; None: gloo's
                errors as they are.
        """
        if not isinstance(ranks, (list, tuple, range)) and not hasattr(ranks, "__iter__"):
            raise TypeError(f"ranks must be a sequence of int ranks, not {type(ranks).__name__} ({ranks!r}): "
                            f"pass a list, e.g. ranks=[0, 1]")
        # (numbers.Integral: numpy's integers too, as list(np.arange(n)) gives them)
        if isinstance(ranks, (str, bytes)) or not all(isinstance(r, numbers.Integral) and not isinstance(r, bool)
                                                      for r in ranks):
            names = not isinstance(ranks, (str, bytes)) and any(isinstance(r, str) for r in ranks)
            raise TypeError(f"ranks must be a sequence of int ranks, not {ranks!r}"
                            + ("; member names (get_members()) are not ranks: pass list(range(world.world_size)) "
                               "for the whole world" if names else ""))
        ranks = sorted(int(r) for r in ranks)
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < world_size for r in ranks):
            raise ValueError(f"ranks={ranks} must be distinct ranks in [0, {world_size})")
        if backend is not None and not isinstance(backend, str):
            number = isinstance(backend, (int, float)) and not isinstance(backend, bool)
            raise TypeError(f"backend={backend!r} must be a backend's name ('gloo', 'nccl') or None for the "
                            f"World's, not {type(backend).__name__}"
                            + (f"; machin's second argument was the timeout: pass timeout={backend!r}"
                               if number else ""))
        if backend is not None and backend.lower() not in _checks.BACKENDS:
            raise ValueError(f"backend={backend!r} is not a torch.distributed backend; use one of {list(_checks.BACKENDS)}, "
                             f"or None for the World's")
        if agree is not None:
            agree(ranks, timeout)
        group = dist.new_group(ranks, timeout=datetime.timedelta(seconds=timeout), backend=backend)
        member = my_rank in ranks
        return cls(group if member else None, ranks, my_rank, retire, namer, timeout)

    def __reduce__(self) -> Any:
        raise TypeError("a CollectiveGroup belongs to its process and cannot be pickled")

    def __repr__(self) -> str:
        return f"<CollectiveGroup ranks={self.ranks}>"

    def _g(self) -> Any:
        _forked.check("a collective")  # (gloo's threads did not cross the fork: it would wait for good)
        if self._destroyed:
            raise RuntimeError(f"CollectiveGroup {self.ranks} has been destroyed")
        if self.group is None:
            raise RuntimeError(f"this process (rank {self._my_rank}) is not in CollectiveGroup {self.ranks}")
        return self.group

    def _peer(self, param: str, rank: int) -> int:
        if rank not in self.ranks:
            raise ValueError(f"{param}={rank} is not a rank of CollectiveGroup {self.ranks}")
        return rank

    def _source(self, src: Optional[int]) -> Optional[int]:
        """The sender a receive names: ``src``; for None (any source), the group's one other
        member where there is just one. Why: gloo's any-source receive does not end when a
        sender's connection closes, so with the only possible sender dead it waited out the
        group's timeout (cold trial 27); a receive from a named source fails within a second."""
        if src is not None:
            return self._peer("src", src)
        others = [rank for rank in self.ranks if rank != self._my_rank]
        return others[0] if len(others) == 1 else None

    def _native(self, op: str, start: Callable[[], Any]) -> Any:
        """``start()``'s work handle (torch's collective, started with ``async_op=True`` so
        that an error here is the backend refusing it before anything was sent, not a
        failure of the exchange), or ``_SUBSTITUTE`` when ``op`` (spelled as
        :func:`~.substitutes.lacks` reads it) runs as its substitute: the backend is slower
        at it (``_SLOWER``) or has no ``op``. A refusal is remembered: every member's backend
        refuses alike, so every member takes the substitute alike."""
        if self._substituted is None:
            self._substituted = set(_SLOWER.get(dist.get_backend(self.group), ()))
        if op in self._substituted:
            return _SUBSTITUTE
        try:
            return start()
        except (RuntimeError, NotImplementedError) as exc:
            if not lacks(exc, op):
                raise
            self._substituted.add(op)
            return _SUBSTITUTE

    def _one_per_member(self, name: str, tensors: Any) -> None:
        if not isinstance(tensors, (list, tuple)) or len(tensors) != len(self.ranks):
            got = f"{len(tensors)} tensors" if isinstance(tensors, (list, tuple)) else repr(tensors)
            raise ValueError(f"{name} holds {got}; CollectiveGroup {self.ranks} needs one per member "
                             f"({len(self.ranks)})")

    def _pieces(self, name: str, tensors: Any, like: torch.Tensor, like_name: str) -> None:
        """Check ``tensors`` to be one tensor per member of ``like``'s dtype and number of
        elements. Checked here, before anything is sent: gloo aborts the whole process
        (SIGABRT) when the bytes it receives do not fit the tensor waiting for them."""
        self._one_per_member(name, tensors)
        for index, piece in enumerate(tensors):
            if not isinstance(piece, torch.Tensor) or piece.dtype != like.dtype or piece.numel() != like.numel():
                shown = (f"a {piece.dtype} tensor of {piece.numel()} elements" if isinstance(piece, torch.Tensor)
                         else type(piece).__name__)
                raise ValueError(f"{name}[{index}] is {shown}; every piece needs {like_name}'s dtype and number "
                                 f"of elements ({like.dtype}, {like.numel()})")

    # ------------------------------------------------------------- point to point
    @_named
    def send(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> None:
        """Send ``tensor`` to global rank ``dst`` (blocking).

        Args:
            tensor: The data; the receiver's tensor must have the same size and dtype.
            dst: Global rank of the receiver.
            tag: Matches this send with a ``recv`` of the same tag.
        """
        dist.send(DenseStage.read(tensor), self._peer("dst", dst), group=self._g(), tag=tag)

    @_named
    def recv(self, tensor: torch.Tensor, src: Optional[int] = None, tag: int = 0) -> int:
        """Receive into ``tensor`` from ``src`` (blocking).

        Args:
            tensor: Filled in place with the received data.
            src: Global rank of the sender; None: whichever member sends first.
            tag: Matches a ``send`` of the same tag.

        Returns:
            The global rank of the sender.
        """
        group = self._g()
        stage = DenseStage()
        sender = dist.recv(stage.write(tensor, reads=False), self._source(src), group=group, tag=tag)
        stage.done(None, False)
        return sender

    @_named
    def isend(self, tensor: torch.Tensor, dst: int, tag: int = 0) -> Any:
        """Send ``tensor`` to global rank ``dst`` asynchronously.

        Args:
            tensor: The data; do not modify it before the handle's ``wait()`` returned.
            dst: Global rank of the receiver.
            tag: Matches a receive of the same tag.

        Returns:
            A work handle with ``wait()``.
        """
        return dist.isend(DenseStage.read(tensor), self._peer("dst", dst), group=self._g(), tag=tag)

    @_named
    def irecv(self, tensor: torch.Tensor, src: Optional[int] = None, tag: int = 0) -> Any:
        """Receive into ``tensor`` asynchronously.

        Args:
            tensor: Filled in place once the handle's ``wait()`` returned.
            src: Global rank of the sender; None: whichever member sends first.
            tag: Matches a send of the same tag.

        Returns:
            A handle whose ``wait()`` returns the global rank of the sender.
        """
        group = self._g()
        stage = DenseStage()
        buffer = stage.write(tensor, reads=False)
        source = self._source(src)
        if source is None:
            return _AnySourceRecv(stage.done(dist.irecv(buffer, None, group=group, tag=tag), True), group)
        return _KnownSourceRecv(stage.done(dist.irecv(buffer, source, group=group, tag=tag), True), source)

    # ----------------------------------------------------------------- collectives
    @_named
    def broadcast(self, tensor: torch.Tensor, src: int, async_op: bool = False) -> Any:
        """Copy ``tensor`` of rank ``src`` into ``tensor`` of every member (in place).

        Args:
            tensor: Sent on ``src``, overwritten elsewhere; the same size everywhere.
            src: Global rank of the source.
            async_op: Return a work handle instead of waiting.
        """
        stage = DenseStage()
        work = dist.broadcast(stage.write(tensor), self._peer("src", src), group=self._g(), async_op=async_op)
        return stage.done(work, async_op)

    @_named
    def all_reduce(self, tensor: torch.Tensor, op: Any = ReduceOp.SUM, async_op: bool = False) -> Any:
        """Reduce ``tensor`` over all members; every member gets the result in place.

        Args:
            tensor: Input and output.
            op: A ``torch.distributed.ReduceOp`` (``SUM``, ``AVG`` where the backend has it,
                ``PRODUCT``, ``MIN``, ``MAX``, ...).
            async_op: Return a work handle instead of waiting.
        """
        stage = DenseStage()
        work = dist.all_reduce(stage.write(tensor), op=_args.reduce_op(op), group=self._g(), async_op=async_op)
        return stage.done(work, async_op)

    @_named
    def reduce(self, tensor: torch.Tensor, dst: int, op: Any = ReduceOp.SUM, async_op: bool = False) -> Any:
        """Reduce ``tensor`` over all members into ``tensor`` of rank ``dst``.

        Args:
            tensor: Input everywhere; the result on ``dst`` (in place).
            dst: Global rank that receives the result.
            op: A ``torch.distributed.ReduceOp``.
            async_op: Return a work handle instead of waiting.
        """
        stage = DenseStage()
        work = dist.reduce(stage.write(tensor), self._peer("dst", dst), op=_args.reduce_op(op), group=self._g(), async_op=async_op)
        return stage.done(work, async_op)

    @_named
    def all_gather(self, tensor_list: List[torch.Tensor], tensor: torch.Tensor, async_op: bool = False) -> Any:
        """Every member's ``tensor`` into ``tensor_list`` of every member, in rank order.

        Args:
            tensor_list: ``size()`` tensors of ``tensor``'s size, filled in place.
            tensor: This member's contribution.
            async_op: Return a work handle instead of waiting.
        """
        group = self._g()
        self._pieces("tensor_list", tensor_list, tensor, "tensor")
        stage = DenseStage()
        work = dist.all_gather(stage.writes(tensor_list), stage.read(tensor), group=group, async_op=async_op)
        return stage.done(work, async_op)

    @_named
    def gather(self, tensor: torch.Tensor, gather_list: Optional[List[torch.Tensor]] = None, dst: int = 0,
               async_op: bool = False) -> Any:
        """Every member's ``tensor`` into ``gather_list`` of rank ``dst``, in rank order.

        Args:
            tensor: This member's contribution.
            gather_list: On ``dst``: ``size()`` tensors of ``tensor``'s size, filled in
                place; None elsewhere.
            dst: Global rank that receives.
            async_op: Return a work handle instead of waiting.
        """
        group = self._g()
        if gather_list is not None and self._my_rank == self._peer("dst", dst):
            self._pieces("gather_list", gather_list, tensor, "tensor")
        stage = DenseStage()
        work = dist.gather(stage.read(tensor), stage.writes(gather_list), self._peer("dst", dst), group=group,
                           async_op=async_op)
        return stage.done(work, async_op)

    @_named
    def scatter(self, tensor: torch.Tensor, scatter_list: Optional[List[torch.Tensor]] = None, src: int = 0,
                async_op: bool = False) -> Any:
        """Hand ``scatter_list[i]`` of rank ``src`` to the ``i``-th member (rank order).

        Args:
            tensor: Filled in place with this member's piece.
            scatter_list: On ``src``: ``size()`` tensors; None elsewhere.
            src: Global rank of the source.
            async_op: Return a work handle instead of waiting.
        """
        group = self._g()
        if scatter_list is not None and self._my_rank == self._peer("src", src):
            self._pieces("scatter_list", scatter_list, tensor, "tensor")
        stage = DenseStage()
        inputs = None if scatter_list is None else [stage.read(t) for t in scatter_list]
        work = dist.scatter(stage.write(tensor, reads=False), inputs, self._peer("src", src), group=group,
                            async_op=async_op)
        return stage.done(work, async_op)

    @_named
    def reduce_scatter(self, output: torch.Tensor, input_list: List[torch.Tensor], op: Any = ReduceOp.SUM,
                       async_op: bool = False) -> Any:
        """Reduce ``input_list[i]`` over all members into ``output`` of the ``i``-th member.

        Works on every backend: where the backend has no ``reduce_scatter`` (gloo before
        torch 2.8), it is one ``all_reduce`` of every piece, each member keeping its own.

        Args:
            output: Filled in place with this member's reduced piece.
            input_list: ``size()`` tensors, one per member in rank order.
            op: A ``torch.distributed.ReduceOp``.
            async_op: Return a work handle instead of waiting.
        """
        group = self._g()
        self._pieces("input_list", input_list, output, "output")
        op = _args.reduce_op(op)
        stage = DenseStage()
        out, inputs = stage.write(output, reads=False), [stage.read(t) for t in input_list]
        work = self._native("reducescatter", lambda: dist.reduce_scatter(out, inputs, op=op, group=group,
                                                                         async_op=True))
        if work is _SUBSTITUTE:
            work = ReduceScatterByAllReduce(out, inputs, op, group, self.ranks.index(self._my_rank))
        return _finish(stage, work, async_op)

    @_named
    def all_to_all(self, output_tensor_list: List[torch.Tensor], input_tensor_list: List[torch.Tensor],
                   async_op: bool = False) -> Any:
        """Send ``input_tensor_list[i]`` to the ``i``-th member and receive the ``j``-th
        member's piece into ``output_tensor_list[j]`` (members in rank order).

        Works on every backend: on gloo (whose own alltoall, from torch 2.12, took 2.3 to 4
        times as long) and where the backend has none, the pieces travel as point-to-point
        sends and receives on a tag reserved for this (5000000; do not use it for your own
        sends), CUDA tensors staged through the CPU where the backend cannot send them.

        Args:
            output_tensor_list: ``size()`` tensors, filled in place; piece ``j`` has the
                size of what member ``j`` sends here (pieces of different sizes are fine on
                gloo, NCCL and MPI).
            input_tensor_list: ``size()`` tensors to send.
            async_op: Return a work handle instead of waiting.

        Raises:
            ValueError: A list does not hold exactly ``size()`` tensors.
        """
        group = self._g()
        self._one_per_member("output_tensor_list", output_tensor_list)
        self._one_per_member("input_tensor_list", input_tensor_list)
        stage = DenseStage()  # (a refusal below writes nothing: the substitute uses the same stand-ins)
        outputs, inputs = stage.writes(output_tensor_list), [stage.read(t) for t in input_tensor_list]
        work = self._native("alltoall", lambda: dist.all_to_all(outputs, inputs, group=group, async_op=True))
        if work is _SUBSTITUTE:
            work = PairwiseAllToAll(outputs, inputs, group, self.ranks, self._my_rank)
        return _finish(stage, work, async_op)

    @_named
    def barrier(self, async_op: bool = False) -> Any:
        """Wait until every member reached the barrier (at most the group's timeout).

        Args:
            async_op: Return a work handle instead of waiting.
        """
        return dist.barrier(group=self._g(), async_op=async_op)

    @_named
    def broadcast_object_list(self, object_list: List[Any], src: int) -> None:
        """Replace the entries of ``object_list`` with those of rank ``src`` (picklable objects).

        Args:
            object_list: The same length everywhere; overwritten in place except on ``src``.
            src: Global rank of the source.

        Raises:
            TypeError: ``object_list`` is not a list (every rank: the receivers write into it).
        """
        _args.object_list(object_list, None)
        dist.broadcast_object_list(object_list, self._peer("src", src), group=self._g())

    @_named
    def all_gather_object(self, object_list: List[Any], obj: Any) -> None:
        """Every member's ``obj`` (picklable) into ``object_list``, in rank order.

        Args:
            object_list: A list of ``size()`` entries, overwritten in place.
            obj: This member's contribution.

        Raises:
            TypeError, ValueError: ``object_list`` is not a list of ``size()`` entries.
        """
        _args.object_list(object_list, self.size())
        dist.all_gather_object(object_list, obj, group=self._g())

    # ------------------------------------------------------------------ lifecycle
    def size(self) -> int:
        """Number of ranks in the group."""
        return len(self.ranks)

    @property
    def current_rank(self) -> Optional[int]:
        """This process's place in the group (machin's relative rank: its index in the sorted
        ``ranks``); None in a process outside the group. Collectives take global ranks."""
        return self.ranks.index(self._my_rank) if self._my_rank in self.ranks else None

    def is_member(self) -> bool:
        """Whether this process is in the group (False once it destroyed the group)."""
        return self.group is not None and not self._destroyed

    def destroy(self) -> None:
        """Release the process group (members and non-members alike call it)."""
        if not self._destroyed and self.group is not None:
            dist.destroy_process_group(self.group)
            if self._retire is not None:  # see RetiredGroups: its last reference goes at stop
                self._retire(self.group)
        self._destroyed = True

