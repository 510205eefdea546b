"""Servers: an ordered key-value server, and push-pull model and gradient parameter servers.

Module layout (machin's ``machin.parallel.server``):

- :mod:`.ordered`: :class:`OrderedServerBase`, :class:`OrderedServerSimple` (accessor),
  :class:`OrderedServerSimpleImpl` (host): compare-and-set versions, bounded history.
- :mod:`.model`: :class:`PushPullModelServer` / :class:`PushPullModelServerImpl`: whole
  models on a version chain (``model.pp_version``).
- :mod:`.grad`: :class:`PushPullGradServer` / :class:`PushPullGradServerImpl`: gradient
  push, tree reduction, optimizer step on the primary, parameter pull
  (``model.pp_grad_version``).
- :mod:`.inference`: :class:`InferenceServer` / :class:`InferenceServerImpl`: batched
  central inference, many members' rows through one ``fn`` per batch.
- :mod:`.helpers`: :func:`grad_server_helper`, :func:`model_server_helper`.
"""

from .grad import CheckpointError, MissingGradientError, PushPullGradServer, PushPullGradServerImpl, ServerStoppedError
from .inference import InferenceServer, InferenceServerImpl
from .helpers import ServerHandles, grad_server_helper, model_server_helper
from .model import PushPullModelServer, PushPullModelServerImpl
from .ordered import OrderedServerBase, OrderedServerSimple, OrderedServerSimpleImpl

__all__ = [
    "OrderedServerBase",
    "OrderedServerSimple",
    "OrderedServerSimpleImpl",
    "PushPullModelServer",
    "PushPullModelServerImpl",
    "PushPullGradServer",
    "PushPullGradServerImpl",
    "InferenceServer",
    "InferenceServerImpl",
    "ServerStoppedError",
    "MissingGradientError",
    "CheckpointError",
    "ServerHandles",
    "grad_server_helper",
    "model_server_helper",
]
