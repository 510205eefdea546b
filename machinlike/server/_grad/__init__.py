"""The gradient server's parts: its reducers (secondary and primary), the forwarder between
them, the items they pass, the primary's checkpoints, the client's accessor, the services a
host registers, the settings a helper checks, and the shares this process hosts.

This face names what the modules above it may use.
"""

from .settings import grad_settings, GradSettings
from .accessor import PushPullGradServer
from .checkpoint import PrimaryCheckpoint
from .forward import Forwarder
from .primary import ManagedModel
from .services import ReducerServices
from .hosted import check_not_hosted, Hosting
from .reducer import PrimaryReducer, SecondaryReducer

__all__ = [
    "check_not_hosted", "Forwarder", "grad_settings", "GradSettings", "Hosting", "ManagedModel", "PrimaryCheckpoint",
    "PrimaryReducer", "PushPullGradServer", "ReducerServices", "SecondaryReducer",
]
