"""Launchers over the World: local spawned ranks (``launch``) and Ray actors
(``launch_ray``).

This face names what the layers above may use; the modules behind it are private to it.
"""

from .local import launch, LaunchResult, Restart
from .ray import launch_ray

__all__ = [
    "launch", "launch_ray", "LaunchResult", "Restart",
]
