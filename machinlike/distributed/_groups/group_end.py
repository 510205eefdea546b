"""The end of a fixed-member group incarnation: its last member out deletes its keys.

Why: an incarnation's keys (its members' lists, its service and value keys, emptied when
withdrawn, each member's last barrier arrival) outlived it, so a program that creates and
destroys groups (one per episode, say) grew the store by each incarnation's keys for good:
nine for two members with a service and a value each::

    destroy() on each member:    append the keys it leaves to rg/<g>/<e>/end
                                 (its member list, every service and value key it
                                 claimed, its last barrier arrival); then
                                 add 1 to rg/<g>/<e>/ended
    the member that makes it N:  delete every key listed, end and ended, and
                                 rg/<g>/current while it still names this incarnation

Why it is safe: nobody uses an incarnation all of whose members destroyed it. Only a
member claims a key in it (a destroyed handle refuses), a barrier round waits for members
only, and creating the name again makes a new epoch (whose record a member writes only
after every member joined it: after the last one's destroy returned). Each member appends
before it counts, so the last one reads every list. A member that died (an elastic world)
never counts itself out: that incarnation's keys stay (bounded by the deaths).
"""

from __future__ import annotations

import logging
from typing import Iterable

from .._store import GroupRecord, Keys, Registry
from ...exception import PeerLostError

__all__ = ["end_incarnation"]

log = logging.getLogger(__name__)


def end_incarnation(registry: Registry, keys: Keys, group: str, epoch: str, members: int,
                    left: Iterable[str]) -> bool:
    """Count this member out of incarnation ``epoch`` of ``group``; the last deletes its keys.

    Best effort: a store that is gone leaves the keys (it went with them).

    Args:
        members: How many members the incarnation has.
        left: The store keys this member leaves in the incarnation.

    Returns:
        Whether this member was the last out (and deleted the keys).
    """
    end, ended = keys.group_end(group, epoch), keys.group_ended(group, epoch)
    try:
        registry.append(end, "".join(f"{key}\n" for key in left))
        if registry.add(ended, 1) < members:
            return False
        listed = [key for key in registry.get_or_empty(end).splitlines() if key]
        current = registry.get_or_empty(keys.group(group))
        if current and GroupRecord.decode(current).epoch == epoch:
            listed.append(keys.group(group))
        registry.delete(sorted(set(listed)) + [end, ended])
        return True
    except (PeerLostError, TimeoutError) as err:
        log.debug("RpcGroup %r: the keys of incarnation %s stay: %s", group, epoch, err)
        return False

