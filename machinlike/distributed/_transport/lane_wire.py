"""The same-host lane's wire: its pickling, its addresses and its frames (see ``lane``).

A frame is a header (payload bytes, call id, kind, count of buffers), the buffers' sizes,
a pickle and the buffers::

    | header | sizes | pickle (small tensors' bytes in it) | buffer 0 | buffer 1 | ...
                                                               └── tensors and arrays of
                                                                   >= OUT_OF_BAND bytes

Requests are pickled with a dispatch table that copies plain CPU tensors (pickle 5
buffers) and refuses what the lane leaves to torch RPC (:class:`NotForLane`); replies take
the same table without the size bound, and plain pickling for what it refuses (the call
has run: it cannot go another way). Why large buffers travel out of band: in the pickle,
their bytes were copied five times each way (into the stream, out of it, through the
socket twice, into the loaded tensor): 200 tensors of 64 KB took four times as long as
through TensorPipe. Out of band, the socket reads them straight from the tensor and
writes them straight into the receiver's own buffer, one per tensor (so that a tensor
kept alone does not keep the whole frame).
"""

from __future__ import annotations

import copyreg
import io
import logging
import os
import pickle
import select
import socket
import struct
import time
from typing import Any, Callable, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch.distributed import autograd as _dist_autograd

from ..._reductions.copy import _byte_view, _rebuild_tensor_copy, dense_order, expand_back, expanded

__all__ = ["drop_late", "NotForLane", "TENSOR_LIMIT", "OUT_OF_BAND", "Body", "in_autograd_context", "REQ", "OK", "ERR", "HELLO",
           "request_bytes", "reply_bytes", "load_body", "address", "send_frame", "read_frame", "IDLE_WAKE_S"]

log = logging.getLogger(__name__)


# Bytes of tensors (and arrays) a request carries at most, one or many; a larger one goes
# through torch RPC, whose cma channel moves each tensor with one copy.
TENSOR_LIMIT = 1 << 20

OUT_OF_BAND = 1 << 16  # bytes; a pickle-5 buffer of this size or more travels out of band

_HEADER = struct.Struct("<IQBH")  # payload bytes, call id, kind, buffers
_SIZE = struct.Struct("<Q")  # one buffer's bytes
_MAX_BUFFERS = (1 << 16) - 1  # buffers a frame can say; further ones go in band
REQ, OK, ERR, HELLO = 0, 1, 2, 3
_MAX_PAYLOAD = (1 << 32) - 1  # bytes a frame can say
# A reader's poll bound. A connection's socket has a timeout (Python then keeps it
# non-blocking) so that its senders can wait on their own deadlines (send_frame); its
# reader retries the timeout, so an idle one wakes hourly.
IDLE_WAKE_S = 3600.0


class NotForLane(Exception):
    """This call cannot travel through the lane; send it through torch RPC (nothing was sent)."""


# ------------------------------------------------------------------------ pickling
def _tensor_reducer(limit: Optional[int]) -> Callable[[torch.Tensor], Tuple[Any, ...]]:
    def reduce(tensor: torch.Tensor) -> Tuple[Any, ...]:
        # (A Parameter is not this exact type: its own reduction sends its data, which is.)
        if (tensor.device.type != "cpu" or tensor.layout != torch.strided or tensor.grad_fn is not None
                or tensor.is_quantized or tensor.is_nested):
            raise NotForLane(f"a {tensor.device.type} {tensor.layout} tensor"
                             + (" with autograd history" if tensor.grad_fn is not None else ""))
        parts = expanded(tensor)
        if parts is not None:  # its distinct elements travel (this reducer again), expanded on arrival
            return expand_back, parts
        size = tensor.numel() * tensor.element_size()
        if limit is not None and size > limit:
            raise NotForLane(f"a tensor of {size} bytes")
        data = tensor.detach().resolve_conj().resolve_neg()
        order = None
        if not data.is_contiguous():
            order = dense_order(data)  # a channels-last or transposed tensor keeps its layout
            data = data.contiguous() if order is None else data.permute(order)
        # machinlike.pickle's copy policy: one in-band pickle-5 buffer, wrapped on arrival.
        return _rebuild_tensor_copy, (torch.Tensor, _byte_view(data), tensor.dtype, tuple(data.shape),
                                      tensor.requires_grad, "cpu", order)
    return reduce


def _pickler(limit: Optional[int]) -> type:
    table = copyreg.dispatch_table.copy()
    table[torch.Tensor] = _tensor_reducer(limit)
    return type("_LanePickler", (pickle.Pickler,), {"dispatch_table": table})


_RequestPickler = _pickler(TENSOR_LIMIT)
_ReplyPickler = _pickler(None)


class Body(NamedTuple):
    """A frame's contents: the pickle, and the buffers it names out of band."""

    data: Union[bytes, bytearray]
    buffers: Sequence[memoryview] = ()


def _dumps(obj: Any, pickler: Callable[..., Any], budget: Optional[int] = None) -> Body:
    """``obj`` pickled; ``budget``: the bytes of tensors and arrays it may carry, past which
    it raises NotForLane (None: no bound)."""
    buf = io.BytesIO()
    bulky: List[memoryview] = []
    carried = 0

    def in_band(buffer: pickle.PickleBuffer) -> bool:
        nonlocal carried
        view = buffer.raw()
        carried += view.nbytes
        if budget is not None and carried > budget:
            raise NotForLane(f"a call carrying more than {budget} bytes of tensors and arrays")
        if view.nbytes < OUT_OF_BAND or len(bulky) >= _MAX_BUFFERS:
            return True
        bulky.append(view)
        return False

    pickler(buf, protocol=5, buffer_callback=in_band).dump(obj)
    return Body(buf.getvalue(), bulky)


def load_body(body: Body) -> Any:
    """The object a frame's body holds."""
    return pickle.loads(body.data, buffers=body.buffers)


def drop_late(body: Body) -> None:
    """Load a reply whose call gave up, and drop it: its lent segments (CPU shared memory,
    CUDA IPC) are taken and come back to their sender, who would otherwise keep them lent
    until its World stopped. Only a reply that names this package's loaders is loaded (a
    plain one holds nothing lent, and a user's classes need not run for nothing)."""
    if b"machinlike." not in body.data:
        return
    try:
        load_body(body)
    except Exception:  # (nobody waits for it: its errors have no one to reach)
        log.debug("a late reply could not be loaded", exc_info=True)


def in_autograd_context() -> bool:
    """Whether this thread is inside a ``torch.distributed.autograd`` context.

    Such a call goes through torch RPC: torch records on both sides the functions that
    carry the gradients back (its tensors' and its result's, a remote model's output
    included); through the lane, ``dist_autograd.get_gradients`` would silently lack them.
    A process that never made a context pays one counter read.
    """
    try:
        if not _dist_autograd._get_debug_info()["num_autograd_contexts"]:
            return False
        _dist_autograd._current_context()  # (raises when this thread has none)
    except RuntimeError:  # none here, or distributed autograd not initialised
        return False
    return True


def request_bytes(fn: Callable[..., Any], args: Tuple[Any, ...]) -> Body:
    """A call's frame body.

    Raises:
        NotForLane: the lane does not carry it (see the module doc).
    """
    if in_autograd_context():
        raise NotForLane("a call inside a distributed autograd context")
    try:
        data = _dumps((fn, args), _RequestPickler, TENSOR_LIMIT)
    except NotForLane:
        raise
    except Exception as err:  # an RRef, a lambda, a lock: torch RPC's pickler decides
        raise NotForLane(f"{type(err).__name__}: {err}") from err
    if len(data.data) > _MAX_PAYLOAD:
        raise NotForLane(f"a call of {len(data.data)} bytes")
    return data


def reply_bytes(value: Any) -> Body:
    """The reply's frame body; a value the lane's pickler refuses takes plain pickling.

    Raises:
        Exception: it cannot be pickled at all, or is larger than a frame says (4 GiB).
    """
    try:
        data = _dumps(value, _ReplyPickler)
    except Exception:  # NotForLane, or a tensor the table's reducer cannot take: torch's own reduction
        data = _dumps(value, pickle.Pickler)
    if len(data.data) > _MAX_PAYLOAD:
        raise ValueError(f"a reply of {len(data.data)} bytes is more than a lane frame carries")
    return data


# --------------------------------------------------------------------- the wire
def address(pid: int) -> Optional[bytes]:
    """The abstract address of process ``pid``'s lane; None when it is not running here."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            start = f.read().rpartition(b")")[2].split()[19]
    except (OSError, IndexError):
        return None
    return b"\0machinlike-lane/%d/%s" % (pid, start)


def send_frame(sock: socket.socket, kind: int, cid: int, body: Union[bytes, Body], deadline: float) -> None:
    """Send one frame (``body``: a pickle with its buffers, or plain bytes) by ``deadline``
    (``time.monotonic()``), whatever the socket's timeout.

    One socket object serves a connection's reader (its timeout only a poll bound) and its
    senders, so a send waits on its own deadline: a write that cannot block, then a poll.
    ``sock`` must have a timeout (its descriptor is then non-blocking): ``socket.send``
    would wait that timeout out on a full buffer, whatever the flags, so the bytes go
    through ``os.write`` on the descriptor.

    Raises:
        socket.timeout: the frame did not leave in time (part of it may have: the stream is
            no longer framed, and the caller drops the connection).
        OSError: the connection broke.
    """
    fd = sock.fileno()
    payload, buffers = (body, ()) if isinstance(body, (bytes, bytearray)) else body
    head = _HEADER.pack(len(payload), cid, kind, len(buffers)) + b"".join(_SIZE.pack(b.nbytes) for b in buffers)
    parts = [memoryview(head + payload)] if len(payload) < 65536 else [memoryview(head), memoryview(payload)]
    for part in parts + list(buffers):  # (a PickleBuffer's raw() is flat bytes already)
        while part:
            try:
                part = part[os.write(fd, part):]
                continue
            except BlockingIOError:
                pass
            left = deadline - time.monotonic()
            if left <= 0:
                raise socket.timeout("timed out sending a frame")
            poller = select.poll()
            poller.register(fd, select.POLLOUT)
            poller.poll(left * 1000)


def _read_exact(sock: socket.socket, size: int, patient: bool = True) -> Optional[bytearray]:
    """``size`` bytes, None at EOF. ``patient``: the socket's timeout is only a poll bound
    (retried); else it raises ``socket.timeout``."""
    buf = bytearray(size)
    view = memoryview(buf)
    got = 0
    while got < size:
        try:
            n = sock.recv_into(view[got:])
        except socket.timeout:
            if not patient:
                raise
            continue
        if n == 0:
            return None
        got += n
    return buf


def read_frame(sock: socket.socket, patient: bool = True) -> Optional[Tuple[int, int, Body]]:
    """``(kind, call id, body)`` of the next frame; None at EOF. Each buffer is read into
    a bytearray of its own."""
    head = _read_exact(sock, _HEADER.size, patient)
    if head is None:
        return None
    size, cid, kind, count = _HEADER.unpack(head)
    sizes = _read_exact(sock, _SIZE.size * count, patient) if count else bytearray()
    payload = _read_exact(sock, size, patient) if size else bytearray()
    if sizes is None or payload is None:
        return None
    buffers = []
    for (nbytes,) in _SIZE.iter_unpack(sizes):
        buffer = _read_exact(sock, nbytes, patient)
        if buffer is None:
            return None
        buffers.append(memoryview(buffer))
    return kind, cid, Body(payload, buffers)


