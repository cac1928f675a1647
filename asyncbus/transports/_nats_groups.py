"""Which groups a NATS publish reaches: the stream's durable consumers, read from the server.

Every group of every process is a durable consumer of the bus's stream, created with
its pattern as filter subject and ``asyncbus group ["pattern", "group"]`` as its
description. :class:`GroupDirectory` lists them (``CONSUMER.LIST``), keeps them, and
forgets them when the server announces a consumer created or deleted (JetStream
advisories) or the connection came back, so the next look reads them again.
:func:`list_groups`, :func:`group_backlog` and :func:`remove_group` are the groups as
things to see and remove.
"""

from __future__ import annotations

import json
import logging
import re
from typing import TYPE_CHECKING

import anyio

from .._exceptions import ConfigurationError, DecodeError
from .._groups import GroupInfo
from .._routing import compile_pattern
from ._kit.matches import TopicMatches
from ._kit.routes import is_inbox
from ._nats_client import broker_call
from ._wire_fields import group_from_wire

if TYPE_CHECKING:
    from collections.abc import Callable

    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.aio.subscription import Subscription
    from nats.js import JetStreamContext
    from nats.js.api import ConsumerInfo

__all__ = ["GroupDirectory", "group_backlog", "group_description", "list_groups", "remove_group"]

logger = logging.getLogger("asyncbus.transport.nats")

_DESCRIPTION = "asyncbus group "
#: How descriptions were written before they held JSON (``'group' on 'pattern'``).
_LEGACY = re.compile(r"asyncbus group '(.*)' on '(.*)'\Z")
#: Consumers the server lists per page.
_PAGE = 256


def group_description(pattern: str, group: str) -> str:
    """The description of the durable consumer of (pattern, group): both, as JSON."""
    return _DESCRIPTION + json.dumps([pattern, group], ensure_ascii=True)


def _parse(description: str | None) -> tuple[str, str] | None:
    if not description or not description.startswith(_DESCRIPTION):
        return None
    legacy = _LEGACY.match(description)
    if legacy is not None:
        return legacy.group(2), legacy.group(1)
    try:
        return group_from_wire(description[len(_DESCRIPTION) :])
    except DecodeError as error:  # another client's consumer: it counts under its name
        logger.warning("NATS: unreadable group description %r: %s", description[:80], error)
        return None


class GroupDirectory:
    """The (pattern, group) of every consumer of ``stream``, and the stage names a topic reaches.

    :param stream: the stream of envelopes.
    """

    def __init__(self, stream: str) -> None:
        self.stream = stream
        #: Consumer name -> (its pattern's matcher, stage name); ``None`` until read.
        self._groups: dict[str, tuple[Callable[[str], bool], str]] | None = None
        self._routes = TopicMatches(sort=True)
        self._subscriptions: list[Subscription] = []
        #: Counts the changes to what is kept (a publish compares it before and after).
        self.changes = 0

    def forget(self) -> None:
        """Read the consumers again at the next look (something changed, or may have)."""
        self._groups = None
        self._routes.clear()
        self.changes += 1

    def add(self, name: str, pattern: str, group: str) -> None:
        """Record a consumer this process created."""
        if self._groups is not None and name not in self._groups:
            self._groups[name] = (compile_pattern(pattern), f"{pattern}@{group}")
            self._routes.clear()
            self.changes += 1

    def known(self, topic: str) -> tuple[str, ...] | None:
        """Stage names of the groups ``topic`` reaches, sorted; ``None`` until read."""
        if self._groups is None:
            return None
        return self._routes.lookup(topic, self._groups.values())

    async def read(self, js: JetStreamContext, prefix: str) -> None:
        """List the stream's consumers and keep those of asyncbus groups."""
        groups: dict[str, tuple[Callable[[str], bool], str]] = {}
        offset = 0
        while True:
            page = await js.consumers_info(self.stream, offset=offset or None)
            for info in page:
                config = info.config
                subject = config.filter_subject or ""
                if info.name is None or not subject.startswith(f"{prefix}."):
                    continue  # not a group's consumer
                pattern = subject[len(prefix) + 1 :]
                parsed = _parse(config.description)
                # A consumer whose description does not name its group still takes
                # envelopes: it counts, under its own name.
                group = parsed[1] if parsed is not None and parsed[0] == pattern else info.name
                try:
                    groups[info.name] = (compile_pattern(pattern), f"{pattern}@{group}")
                except ConfigurationError:
                    continue
            if len(page) < _PAGE:
                break
            offset += len(page)
        self._groups = groups
        self._routes.clear()
        self.changes += 1

    async def watch(self, nc: Client) -> None:
        """Forget what was read whenever the server announces a consumer created or deleted."""

        async def changed(msg: Msg) -> None:
            self.forget()

        self._subscriptions = [
            await nc.subscribe(f"$JS.EVENT.ADVISORY.CONSUMER.{event}.{self.stream}.*", cb=changed)
            for event in ("CREATED", "DELETED")
        ]


async def list_groups(js: JetStreamContext, stream: str, prefix: str) -> list[GroupInfo]:
    """The groups among ``stream``'s consumers (request inboxes aside): backlog is what
    each has not delivered plus what it delivered and not settled, consumers the pull
    requests waiting on it, last activity its last delivery. No stream: no group."""
    from nats.js.errors import NotFoundError

    with broker_call(f"cannot list the consumers of stream {stream}"):
        try:
            return await _listed(js, stream, prefix)
        except NotFoundError:
            return []


async def _listed(js: JetStreamContext, stream: str, prefix: str) -> list[GroupInfo]:
    listed: list[GroupInfo] = []
    offset = 0
    while True:
        page = await js.consumers_info(stream, offset=offset or None)
        for info in page:
            subject = info.config.filter_subject or ""
            if info.name is None or not subject.startswith(f"{prefix}."):
                continue
            pattern = subject[len(prefix) + 1 :]
            parsed = _parse(info.config.description)
            group = parsed[1] if parsed is not None and parsed[0] == pattern else info.name
            if is_inbox(group):
                continue
            delivered = info.delivered.last_active if info.delivered is not None else None
            listed.append(
                GroupInfo(
                    pattern,
                    group,
                    (info.num_pending or 0) + (info.num_ack_pending or 0),
                    info.num_waiting or 0,
                    delivered.timestamp() if delivered is not None else None,
                )
            )
        if len(page) < _PAGE:
            return listed
        offset += len(page)


async def group_backlog(js: JetStreamContext, stream: str, name: str) -> int:
    """Messages of consumer ``name`` not yet delivered plus delivered, unsettled (0: no
    such consumer).

    A replicated consumer's leader counts from its own copy of the stream, which a
    follower brings up to date a moment after the stream's leader confirmed a publish
    (milliseconds; longer on a loaded machine). When the two leaders differ, the count
    is read again once the stream's leader reports the consumer leader's copy holding
    everything it confirmed, so a backlog read after a confirmed publish counts it (as
    ``drain`` needs), waiting ``_CATCH_UP`` seconds at most.
    """
    from nats.js.errors import NotFoundError

    with broker_call(f"cannot read consumer {name}"):
        try:
            info = await js.consumer_info(stream, name)
            leader = info.cluster.leader if info.cluster is not None else None
            if leader is not None and info.cluster is not None and info.cluster.replicas:
                info = await _caught_up(js, stream, name, leader) or info
        except NotFoundError:
            return 0
    return (info.num_pending or 0) + (info.num_ack_pending or 0)


#: How long a backlog read waits for a consumer leader's copy of the stream to catch up.
_CATCH_UP = 1.0


async def _caught_up(
    js: JetStreamContext, stream: str, name: str, leader: str
) -> ConsumerInfo | None:
    """Consumer ``name`` read again once its leader's copy of the stream holds all the
    stream's leader confirmed (``None``: it is the stream's leader, the first read
    holds it all)."""
    deadline = anyio.current_time() + _CATCH_UP
    while True:
        cluster = (await js.stream_info(stream)).cluster
        if cluster is None or cluster.leader == leader:
            return None
        copy = next((peer for peer in cluster.replicas or () if peer.name == leader), None)
        if copy is None or (copy.current and not copy.lag) or anyio.current_time() > deadline:
            again: ConsumerInfo = await js.consumer_info(stream, name)
            return again
        await anyio.sleep(0.005)


async def remove_group(js: JetStreamContext, directory: GroupDirectory, name: str) -> bool:
    """Delete consumer ``name`` of the directory's stream (``False``: there was none);
    the directory reads the groups again at its next look."""
    from nats.js.errors import NotFoundError

    stream = directory.stream
    with broker_call(f"cannot delete consumer {name} of stream {stream}"):
        try:
            await js.delete_consumer(stream, name)
        except NotFoundError:
            return False
        finally:
            directory.forget()
    return True
