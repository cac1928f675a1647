"""Warning of publishes that reach a group nothing has read for a long time.

Over a broker, a group outlives its code: a handler renamed (the default group is its
``module:qualname``) or a service retired leaves its group bound, given every matching
publish, and its backlog grows for ever. A bus over a transport that lists its groups
(:class:`~asyncbus.transports.base.GroupAdmin`) watches them: it reads the broker's
groups at least every ``interval`` (the broker mode's reader hands each reading to
:meth:`StaleGroups.update`), and a group of another process that every reading for ``after``
seconds found without a consumer is *stale*. A publish that reaches a stale group logs
a warning on ``asyncbus.groups``, once per group per ``after`` seconds. The publish path
only looks the names it reached up in a dict, and only while some group is stale.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Container

from .._checks import check_seconds
from .._groups import GroupInfo
from ..transports.base import GroupAdmin

__all__ = ["StaleGroups", "check_stale_after"]

logger = logging.getLogger("asyncbus.groups")

#: Longest pause between two reads of the groups.
_MAX_INTERVAL = 60.0


def check_stale_after(value: float | None) -> float | None:
    """``value`` as the bus's ``stale_group_after``: ``None`` or finite seconds ``> 0``."""
    return None if value is None else check_seconds(value, "Bus: stale_group_after")


class StaleGroups:
    """The groups of a broker that have gone without a consumer for ``after`` seconds.

    :param admin: the transport, as a :class:`GroupAdmin`.
    :param after: seconds without a consumer that make a group stale.
    :param mine: the stage names of this process's stages (never stale).
    """

    def __init__(self, admin: GroupAdmin, after: float, mine: Container[str]) -> None:
        self.admin = admin
        self.after = after
        self.interval = min(after / 2, _MAX_INTERVAL)
        self.mine = mine
        #: Stage name -> since when it has had no consumer (epoch seconds), for stale groups.
        self.stale: dict[str, float] = {}
        #: Stage name -> when this watcher first saw it without a consumer (epoch).
        self._unread_since: dict[str, float] = {}
        #: Stage name -> when a publish reaching it was last warned of (monotonic).
        self._warned: dict[str, float] = {}

    def update(self, groups: list[GroupInfo], now: float) -> None:
        """Take a reading of the broker's groups made at ``now`` (epoch seconds).

        A group is stale once every reading for ``after`` seconds found it without a
        consumer. Only readings count, not the broker's ``last_active`` (a NATS group's
        last delivery, say, is old on a quiet topic, and its pull requests may be
        between two pulls when read), so a group is never stale before this bus has
        watched it for ``after`` seconds.
        """
        stale: dict[str, float] = {}
        unread: dict[str, float] = {}
        mine = self.mine
        for info in groups:
            name = info.name
            if info.consumers or name in mine:
                continue
            since = unread[name] = self._unread_since.get(name, now)
            if now - since >= self.after:
                stale[name] = since
        self._unread_since = unread
        self.stale = stale

    def reached(self, topic: str, names: tuple[str, ...]) -> None:
        """A publish on ``topic`` reached the groups ``names``: warn of the stale ones
        (called only while :attr:`stale` is not empty)."""
        stale = self.stale
        for name in names:
            last = stale.get(name)
            if last is None:
                continue
            now = time.monotonic()
            if now - self._warned.get(name, -math.inf) < self.after:
                continue
            self._warned[name] = now
            logger.warning(
                "a publish on %r reached group %s, which has had no consumer for %.0f s or more: "
                "its envelopes pile up in the broker. If its handler was renamed or retired, "
                "delete it (bus.delete_group, or python -m asyncbus groups delete); else "
                "start its consumers",
                topic,
                name,
                time.time() - last,
                extra={"stage": name, "topic": topic},
            )
