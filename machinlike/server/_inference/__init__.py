"""The inference server's parts: the batch it runs, the batcher thread that forms it, and
the model wrapper that runs ``fn`` on it.

This face names what the modules above it may use.
"""

from .batch import check_inputs, Inputs, tensors_of
from .batcher import Batcher, Request
from .model import ModelSlot, Puller, StaleVersionError

__all__ = ["Batcher", "check_inputs", "Inputs", "ModelSlot", "Puller", "Request", "StaleVersionError", "tensors_of"]
