"""What travels over RPC: both sides of a call, and what it carries.

Owns the callee's tables and entry points, sending with one deadline and its retry,
function shipping, ``RpcFuture``, the call context the Session binds, remote handles and
the results kept for them, and the same-host (shared memory) and CUDA payloads. Imports
membership, transport and store.

This face names what the floors above may use. They reach one of its modules by name only
where the module itself is the seam: callee entry points sent by reference, a process slot
the Session binds, or a family of functions used as a namespace (rendezvous, netif).
"""

from .coroutines import as_async_execution, is_coroutine_function
from .future import RpcFuture, carry
from .send import send_async, send_call, sync_call
from .serve import is_missing, LocalTables, unwrap
from .shipping import is_async, prepare_call
from .refs import PairedRef, ResultRef
from .samehost import share
from .context import CallContext
from .cuda_settle import settled
from .cuda_ipc_pin import PinnedStates

__all__ = [
    "as_async_execution", "CallContext", "is_async", "is_coroutine_function", "is_missing", "LocalTables", "PairedRef", "PinnedStates", "prepare_call",
    "ResultRef", "RpcFuture", "carry", "send_async", "send_call", "settled", "share", "sync_call", "unwrap",
]
