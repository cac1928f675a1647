"""Groups as things to see and remove: what ``bus.groups()`` lists, and deleting one.

A group outlives the code that made it: over a broker, a handler renamed (its default
group is its ``module:qualname``) leaves its old group bound, still given every
matching publish. :func:`list_groups` and :func:`delete_group` are what the bus (and the
``python -m asyncbus groups`` command) do about it; the broker side is the optional
:class:`GroupAdmin` protocol of each transport (re-exported by
:mod:`asyncbus.transports.base`, with the other optional protocols).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Container, Generator, Iterable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ._exceptions import ConfigurationError, TransportError
from ._partitions import split_partition_group

if TYPE_CHECKING:
    from ._stats import StageStatistics

__all__ = [
    "INTERNAL_GROUP_PREFIX",
    "GroupAdmin",
    "GroupInfo",
    "GroupListing",
    "delete_group",
    "group_document",
    "group_order",
    "list_groups",
    "local_groups",
    "no_admin",
    "since",
    "subscribed_here",
]


@dataclass(frozen=True, slots=True)
class GroupInfo:
    """One group bound to a topic pattern, as ``bus.groups()`` lists it.

    :ivar pattern: the topic pattern the group is bound to.
    :ivar group: the group's name.
    :ivar backlog: envelopes the group has not settled (waiting, or delivered and not
        settled; over RabbitMQ, those waiting in its queue).
    :ivar consumers: consumers reading it now (in memory: this process's consumer
        tasks; over a broker, every process's, as the broker counts them).
    :ivar last_active: when a consumer last read from it (epoch seconds), when the
        broker tells (``None``: unknown).
    :ivar local: whether this process subscribes to it.
    """

    pattern: str
    group: str
    backlog: int
    consumers: int
    last_active: float | None = None
    local: bool = False

    @property
    def name(self) -> str:
        """The stage name, ``"{pattern}@{group}"`` (as receipts and statistics say it)."""
        return f"{self.pattern}@{self.group}"


@runtime_checkable
class GroupAdmin(Protocol):
    """A transport that can list the groups its broker keeps (every process's) and
    delete one with its backlog (``bus.groups()``, ``bus.delete_group()``, and the
    ``python -m asyncbus groups`` command use it).

    Request inboxes (groups beginning ``_reply.``) are the bus's own and never listed.
    A deleted group is forgotten by the routing of every process (their next
    publishes no longer reach or name it); a process still subscribed to it binds it
    again.
    """

    async def groups(self) -> list[GroupInfo]:
        """Every group bound under the transport's prefix, with its backlog, its
        consumers and when one was last active (``local`` is left False)."""

    async def delete_group(self, pattern: str, group: str) -> bool:
        """Delete the group (``pattern``, ``group``): its binding, what it holds
        (waiting, delivered and not settled, delayed retries) and its record.

        :returns: whether it existed.
        """


class GroupListing(list[GroupInfo]):
    """What ``bus.groups()`` returns: a list of :class:`GroupInfo`, sorted by pattern
    then group, that can also be awaited for a fresh reading.

    Used as it is (``for info in bus.groups()``), it holds what the bus knows at the
    call: in memory, its stages exactly; over a broker, the bus's latest reading of the
    broker's groups (taken when the bus starts, every few seconds while it runs, and at
    every awaited call), with this process's stages added if the reading predates them
    and deleted groups left out. Awaited (``await bus.groups()``), it reads the broker
    now and returns a new :class:`GroupListing` with the broker's figures at that moment.
    """

    __slots__ = ("_fresh",)

    def __init__(
        self, groups: Iterable[GroupInfo], fresh: Callable[[], Awaitable[list[GroupInfo]]]
    ) -> None:
        super().__init__(groups)
        self._fresh = fresh

    def __await__(self) -> Generator[Any, Any, GroupListing]:
        return self._read().__await__()

    async def _read(self) -> GroupListing:
        return GroupListing(await self._fresh(), self._fresh)


def local_groups(stages: Iterable[StageStatistics]) -> list[GroupInfo]:
    """The groups of this process's stages (their statistics), with their figures here."""
    found = [
        GroupInfo(
            figures.topic,
            figures.group,
            backlog=figures.depth + figures.in_flight,
            consumers=figures.concurrency,
            last_active=None,
            local=True,
        )
        for figures in stages
    ]
    return sorted(found, key=group_order)


def group_order(info: GroupInfo) -> tuple[str, str]:
    """How listings sort groups: by pattern, then group."""
    return info.pattern, info.group


def group_document(info: GroupInfo) -> dict[str, Any]:
    """``info`` as JSON data (what the command prints and, with ``local``, the admin app)."""
    return {
        "pattern": info.pattern,
        "group": info.group,
        "name": info.name,
        "backlog": info.backlog,
        "consumers": info.consumers,
        "last_active": info.last_active,
    }


#: Groups of the bus's own machinery in a broker (scheduled envelopes wait in
#: ``_asyncbus.scheduled``): never listed by ``bus.groups()``.
INTERNAL_GROUP_PREFIX = "_asyncbus."


def list_groups(found: Iterable[GroupInfo], mine: Container[str]) -> list[GroupInfo]:
    """The broker's groups ``found``, marked ``local`` when their stage name is in
    ``mine``, sorted by pattern then group (the bus's own groups left out)."""
    listed = [
        replace(info, local=info.name in mine)
        for info in found
        if not info.group.startswith(INTERNAL_GROUP_PREFIX)
    ]
    return sorted(listed, key=group_order)


async def delete_group(
    admin: GroupAdmin, pattern: str, group: str, *, force: bool, mine: bool
) -> bool:
    """Delete (pattern, group) and its backlog from the broker behind ``admin``.

    :param force: delete it even while consumers of other processes read it (they
        bind it again when they next read: stop them first). The groups of its
        partitions (``partitions=N``) are deleted with it.
    :param mine: whether this process subscribes to it (then it is refused).
    :returns: whether the group existed.
    :raises ConfigurationError: when this process subscribes to it, or (unless
        ``force``) the broker counts consumers reading it.
    """
    if mine:
        raise subscribed_here(pattern, group)
    # A partitioned group is one broker group per partition (``group#index/count``):
    # they go with it.
    ours = [
        info
        for info in await admin.groups()
        if info.pattern == pattern and group in (info.group, _partition_of(info.group))
    ]
    if not force:
        for info in ours:
            if info.consumers:
                raise ConfigurationError(
                    f"group {group!r} on {pattern!r} has {info.consumers} consumer(s) "
                    "reading it: stop them first (a live consumer binds its group again), "
                    "or pass force=True"
                )
    existed = await admin.delete_group(pattern, group)
    for info in ours:
        if info.group != group:
            existed = await admin.delete_group(pattern, info.group) or existed
    return existed


def _partition_of(name: str) -> str | None:
    """The group whose partition the broker's group ``name`` is, ``None`` for another."""
    split = split_partition_group(name)
    return None if split is None else split[0]


def subscribed_here(pattern: str, group: str) -> ConfigurationError:
    """The error of deleting a group this process subscribes to."""
    return ConfigurationError(
        f"group {group!r} on {pattern!r} is subscribed in this process: it cannot be "
        "deleted while its subscription runs (delete it from a process that does not "
        "subscribe to it, e.g. `python -m asyncbus groups delete`)"
    )


def no_admin(name: str) -> TransportError:
    """The error of a transport that cannot list or delete groups."""
    return TransportError(f"the {name} transport cannot list or delete groups")


def since(idle_ms: float | None) -> float | None:
    """The epoch time ``idle_ms`` milliseconds ago (``None`` stays ``None``)."""
    return None if idle_ms is None else time.time() - idle_ms / 1000
