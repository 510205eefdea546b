"""The same-host lane's wire: its pickling, its addresses and its frames (see ``lane``).

A frame is a header (payload bytes, call id, kind) and a pickle. Requests are pickled with
a dispatch table that copies small plain CPU tensors into the stream (one copy each way)
and refuses what the lane leaves to torch RPC (:class:`NotForLane`); replies take the same
table without the size bound, and plain pickling for what it refuses (the call has run:
it cannot go another way).
"""

from __future__ import annotations

import copyreg
import io
import os
import pickle
import select
import socket
import struct
import time
from typing import Any, Callable, Optional, Tuple

import torch
from torch.distributed import autograd as _dist_autograd

from ..._reductions.copy import _byte_view, _rebuild_tensor_copy, dense_order

__all__ = ["NotForLane", "TENSOR_LIMIT", "in_autograd_context", "REQ", "OK", "ERR", "HELLO", "request_bytes",
           "reply_bytes", "address", "send_frame", "read_frame", "IDLE_WAKE_S"]


TENSOR_LIMIT = 1 << 20  # bytes; a larger tensor in a request goes through torch RPC

_HEADER = struct.Struct("<IQB")  # payload bytes, call id, kind
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


def _dumps(obj: Any, pickler: type) -> bytes:
    buf = io.BytesIO()
    pickler(buf, protocol=5).dump(obj)
    return buf.getvalue()


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


def request_bytes(fn: Callable[..., Any], args: Tuple[Any, ...]) -> bytes:
    """A call's bytes.

    Raises:
        NotForLane: the lane does not carry it (see the module doc).
    """
    if in_autograd_context():
        raise NotForLane("a call inside a distributed autograd context")
    try:
        data = _dumps((fn, args), _RequestPickler)
    except NotForLane:
        raise
    except Exception as err:  # an RRef, a lambda, a lock: torch RPC's pickler decides
        raise NotForLane(f"{type(err).__name__}: {err}") from err
    if len(data) > _MAX_PAYLOAD:
        raise NotForLane(f"a call of {len(data)} bytes")
    return data


def reply_bytes(value: Any) -> bytes:
    """The reply's bytes; a value the lane's pickler refuses takes plain pickling.

    Raises:
        Exception: it cannot be pickled at all, or is larger than a frame says (4 GiB).
    """
    try:
        data = _dumps(value, _ReplyPickler)
    except Exception:  # NotForLane, or a tensor the table's reducer cannot take: torch's own reduction
        data = pickle.dumps(value, protocol=5)
    if len(data) > _MAX_PAYLOAD:
        raise ValueError(f"a reply of {len(data)} bytes is more than a lane frame carries")
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


def send_frame(sock: socket.socket, kind: int, cid: int, payload: bytes, deadline: float) -> None:
    """Send one frame by ``deadline`` (``time.monotonic()``), whatever the socket's timeout.

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
    head = _HEADER.pack(len(payload), cid, kind)
    view = memoryview(head + payload if len(payload) < 65536 else head)
    for part in ((view,) if len(payload) < 65536 else (view, memoryview(payload))):
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


def read_frame(sock: socket.socket, patient: bool = True) -> Optional[Tuple[int, int, bytearray]]:
    head = _read_exact(sock, _HEADER.size, patient)
    if head is None:
        return None
    size, cid, kind = _HEADER.unpack(head)
    payload = _read_exact(sock, size, patient) if size else bytearray()
    if payload is None:
        return None
    return kind, cid, payload


