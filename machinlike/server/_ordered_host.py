"""Who hosts an ordered server, and what a caller is told when nobody serves it.

The host's name is kept in the world's store under the server's own key, beside its
services' claims, and outlives them: when the services vanish (the host closed the server,
left, or was lost and its claims were withdrawn), a caller's "service not found" becomes
an answer that names the host and says what became of it, or, where no member ever hosted
the server, says how to make one. And machin's ``server_runner``, the member that hosts it.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from ..distributed import RpcGroup
from ..exception import PeerLostError
from ._common import current_world

__all__ = ["check_runner", "host_key", "register_all", "unserved"]


def host_key(group: RpcGroup, server_name: str) -> str:
    """Store key holding the member that hosts ``server_name`` (outlives the host's claims)."""
    return current_world().membership.keys.server("os", group.get_group_name(), server_name) + "host"


def check_runner(server_runner: Optional[str], group: RpcGroup) -> None:
    """machin's ``server_runner``: None, or this member (the one that hosts the server).

    Raises:
        ValueError: it names another member.
    """
    if server_runner is not None and server_runner != group.get_cur_name():
        raise ValueError(f"server_runner={server_runner!r}, but this is member {group.get_cur_name()!r}: the "
                         f"member that constructs OrderedServerSimpleImpl serves it (as in machin); construct "
                         f"it on {server_runner!r} instead, or leave server_runner out")


def register_all(group: RpcGroup, server_name: str, services: Dict[str, Callable[..., Any]]) -> None:
    """Register every service (key -> function) of ordered server ``server_name``, or none.

    Raises:
        KeyError: the server's name is taken in ``group`` (named, with the fix).
    """
    done: List[str] = []
    try:
        for key, service in services.items():
            try:
                group.register(key, service)
            except KeyError as err:
                if done or "already registered" not in str(err):
                    raise
                # (it said "Service [kv/_push] already registered": a name of its insides)
                raise KeyError(f"ordered server {server_name!r} already exists in group "
                               f"{group.get_group_name()!r} ({err.args[0] if err.args else err}); close it "
                               f"first, or pick another server_name") from err
            done.append(key)
    except BaseException:
        for key in done:
            group.deregister(key)
        raise


def unserved(group: RpcGroup, name: str, service: str, err: KeyError) -> Exception:
    """The error for a call to ordered server ``name``'s ``service`` that found no owner
    (``err``, the group's KeyError): PeerLostError naming the host when one is recorded,
    else a KeyError that says what became of the server, or how to make one."""
    world = current_world()
    host = world.membership.registry.get_or_empty(host_key(group, name))
    if not host:
        said = err.args[0] if err.args and isinstance(err.args[0], str) else ""
        if "its owner, member" in said:  # one did, and closed it or left: say that, not how to make one
            return KeyError(f"{said}: no member hosts ordered server {name!r} now; calls fail until a member "
                            f"hosts it again")
        return KeyError(f"Service [{name}/{service}] not found on Group "  # (machin's words)
                        f"[{group.get_group_name()}]: no member hosts ordered server {name!r}; create "
                        f"OrderedServerSimpleImpl({name!r}, group) on the member that is to host it first, and "
                        f"meet at group.barrier() before the first call")
    back = world.get_incarnation(host)
    how = None if back is not None else world.membership.departure(host)
    # (a host that returned or stopped left on purpose: no launcher restarts it)
    why = ((f"it came back (incarnation {back}) and does not serve yet" if back > 1 else
            "it is live but no longer serves it (it closed the server)") if back is not None else
           f"it {how[0] if how else 'was lost'}; calls fail until "
           f"{'a member hosts it again' if how and how[1] else 'it is restarted and serves again'}")
    return PeerLostError(host, f"host of ordered server {name!r}: {why}")
