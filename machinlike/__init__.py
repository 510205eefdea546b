"""machinlike: distributed and parallel building blocks for PyTorch training.

Each name lives in a module whose path mirrors machin's ``machin.parallel`` layout
(``machinlike.distributed``, ``machinlike.server``, ``machinlike.pool``, ...), so machin code
ports by changing its imports. The package top level re-exports the names most programs
need; the modules stay the canonical homes (and hold a few rarer names, such as the pools'
result classes). Importing costs little beyond ``import torch`` itself, so the re-exports
are plain imports rather than lazy ones; only ``python -m machinlike status`` skips them
(see ``_lean``).

``get_context`` and ``get_start_method`` are :mod:`multiprocessing`'s own functions,
re-exported because machin's package top level re-exported them (``machin.utils.media``
imports them from there).
"""

from . import _lean

if not _lean.STATUS_TOOL:  # (the status tool's process needs none of these: see _lean)
    from multiprocessing import get_context, get_start_method

    from .assigner import (
        DeviceSpec,
        InfeasiblePlacementError,
        ModelAssigner,
        ModelSizeEstimator,
        PlacementReport,
    )
    from .distributed import (
        CollectiveGroup,
        RpcFuture,
        RpcGroup,
        World,
        get_cur_name,
        get_cur_rank,
        get_world,
        is_world_initialized,
        launch,
        launch_ray,
    )
    from .event import AndEvent, Event, OrEvent
    from .exception import (
        ExceptionWithTraceback,
        PeerLostError,
        ProcessExitedError,
        RemoteError,
        RemoteTraceback,
        SilentStoreError,
        WorkerLostError,
    )
    from .pickle import mark_static_module
    from .pool import (
        BrokenPoolError,
        CtxPool,
        CtxThreadPool,
        P2PPool,
        Pool,
        PoolTerminatedError,
        PoolTimeoutError,
        ThreadPool,
    )
    from .process import Process
    from .queue import MultiP2PQueue, SimpleP2PQueue, SimpleQueue
    from .server import (
        InferenceServer,
        OrderedServerSimple,
        PushPullGradServer,
        PushPullModelServer,
        ServerHandles,
        ServerStoppedError,
        grad_server_helper,
        model_server_helper,
    )
    from .thread import Thread

__version__ = "0.1.0"

__all__ = [
    # distributed core
    "World",
    "RpcGroup",
    "CollectiveGroup",
    "RpcFuture",
    "launch",
    "launch_ray",
    "get_world",
    "is_world_initialized",
    "get_cur_rank",
    "get_cur_name",
    # servers
    "OrderedServerSimple",
    "PushPullModelServer",
    "PushPullGradServer",
    "InferenceServer",
    "ServerHandles",
    "ServerStoppedError",
    "grad_server_helper",
    "model_server_helper",
    # device placement
    "ModelAssigner",
    "ModelSizeEstimator",
    "DeviceSpec",
    "PlacementReport",
    "InfeasiblePlacementError",
    # processes, threads, events, queues, pools
    "Process",
    "Thread",
    "Event",
    "OrEvent",
    "AndEvent",
    "SimpleQueue",
    "SimpleP2PQueue",
    "MultiP2PQueue",
    "Pool",
    "P2PPool",
    "CtxPool",
    "ThreadPool",
    "CtxThreadPool",
    "BrokenPoolError",
    "PoolTerminatedError",
    "PoolTimeoutError",
    "mark_static_module",
    # exceptions that cross process boundaries
    "ExceptionWithTraceback",
    "RemoteTraceback",
    "RemoteError",
    "ProcessExitedError",
    "WorkerLostError",
    "PeerLostError",
    "SilentStoreError",
    # multiprocessing's, re-exported as machin.parallel did
    "get_context",
    "get_start_method",
]
