"""machinlike: distributed and parallel building blocks for PyTorch training."""

__version__ = "0.1.0"
