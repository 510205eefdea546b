"""The gradient-server shares this process hosts, so a client finds a secondary reducer of
its own process and pushes to it without an RPC.

Why a table of its own: the accessor (``_grad.accessor``) must reach a secondary hosted
next to it, and the host (``grad``) builds the accessor; a table both can import, which
imports neither, keeps the two from importing each other::

    PushPullGradServerImpl ── holds ──► Hosting(group, server, secondary) ◄── weak ── table
                                                                                   │
    PushPullGradServer.push ── hosted_secondary(group, server) ────────────────────┘
                                └─► that SecondaryReducer, or None: push over RPC

The table holds each :class:`Hosting` weakly and the host holds it strongly, so a share
that is closed (``withdraw()``) or garbage collected leaves the table by itself.
"""

from __future__ import annotations

import threading
import weakref
from typing import Optional, Tuple

from ...distributed import RpcGroup
from .reducer import SecondaryReducer

__all__ = ["Hosting", "check_not_hosted", "hosted_secondary"]

_Key = Tuple[str, str]  # (group name, server name)

_lock = threading.Lock()  # a claim is a check and an insert: one at a time
_table: "weakref.WeakValueDictionary[_Key, Hosting]" = weakref.WeakValueDictionary()


class Hosting:
    """One gradient-server share hosted by this process, listed while its host holds this.

    Args:
        group: The server's group (a same-named group created later is another group).
        server_name: The server's name.
        secondary: The share's secondary reducer; None: the share is a primary only.

    Raises:
        ValueError: this process already hosts a share of that server.
    """

    __slots__ = ("group", "server_name", "secondary", "__weakref__")

    def __init__(self, group: RpcGroup, server_name: str, secondary: Optional[SecondaryReducer]) -> None:
        self.group = group
        self.server_name = server_name
        self.secondary = secondary
        with _lock:
            check_not_hosted(group, server_name)
            _table[(group.get_group_name(), server_name)] = self

    def withdraw(self) -> None:
        """Leave the table (safe to call twice)."""
        key = (self.group.get_group_name(), self.server_name)
        with _lock:
            if _table.get(key) is self:
                del _table[key]


def check_not_hosted(group: RpcGroup, server_name: str) -> None:
    """Raise before anything is registered when this process hosts ``server_name`` already.

    Raises:
        ValueError: it does; the message says to close the first one.
    """
    if (group.get_group_name(), server_name) in _table:
        raise ValueError(f"this process already hosts gradient server {server_name!r} of group "
                         f"{group.get_group_name()!r}; close() it first")


def hosted_secondary(group: RpcGroup, server_name: str) -> Optional[SecondaryReducer]:
    """The secondary reducer of ``server_name`` that this process hosts in ``group``, or None."""
    hosting = _table.get((group.get_group_name(), server_name))
    if hosting is None or hosting.group is not group:
        return None
    return hosting.secondary
