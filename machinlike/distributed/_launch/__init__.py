"""Launchers over the World: local spawned ranks (``launch``) and Ray actors
(``launch_ray``).

This face names what the floors above may use. They reach one of its modules by name only
where the module itself is the seam: callee entry points sent by reference, a process slot
the Session binds, or a family of functions used as a namespace (rendezvous, netif).
"""

from .local import launch, LaunchResult, Restart
from .ray import launch_ray

__all__ = [
    "launch", "launch_ray", "LaunchResult", "Restart",
]
