"""Device placement of models (machin's ``machin.parallel.assigner``).

:class:`ModelAssigner` places models on CPU/CUDA devices by gradient descent followed by
a discrete refinement that respects device memory; :class:`ModelSizeEstimator` sizes a
module from its parameters and buffers; :class:`DeviceSpec` states a device's capacity
explicitly (so placement can be planned without the hardware).
"""

from ._assigner import InfeasiblePlacementError, ModelAssigner
from ._devices import DeviceSpec
from ._estimator import ModelSizeEstimator
from ._objective import PlacementReport, PlacementTerms

__all__ = [
    "ModelAssigner",
    "ModelSizeEstimator",
    "DeviceSpec",
    "PlacementReport",
    "PlacementTerms",
    "InfeasiblePlacementError",
]
