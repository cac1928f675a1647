"""Which groups a RabbitMQ publish reaches: groups recorded in the broker, and their news.

AMQP cannot list a topic exchange's bindings, so every transport records each group
it declares (once per connection: a broker that restarted may have lost the record) by
publishing ``["pattern", "group"]`` to the fanout exchange ``{prefix}.groups``. Two
kinds of queue are bound to it:

* ``{prefix}.groups``, durable: the register every process reads when it connects
  (under a lock, like the dead letters: :class:`~._rabbit_dead_letters.QueueScan`),
  acking the duplicates it finds so the register stays one entry per group;
* one exclusive, server-named queue per connected transport: the news of groups
  declared since, consumed as they come.

Deleting a group (:func:`delete_group`: its queue, with its bindings and messages)
announces
``{"deleted": ["pattern", "group"]}`` on the same exchange: every process forgets the
group at once (its receipts no longer name it), and the register's entries of the group
are dropped, the deletion's own included, under the register's lock. (A reader older
than deletions logs the announcement as unreadable and drops it.)

Whether a publish reached any queue at all is not this module's business: the
broker tells (a ``mandatory`` publish that no queue takes is returned). The names
known here only say *which* groups were reached, for the receipt.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

import anyio

from .._exceptions import ConfigurationError, DecodeError
from .._groups import GroupInfo
from .._routing import compile_pattern
from ._kit.matches import TopicMatches
from ._kit.routes import INBOX_GROUP_PREFIX
from ._rabbit_dead_letters import QueueScan
from ._wire_fields import group_from_wire

if TYPE_CHECKING:
    from aiormq.abc import AbstractChannel, AbstractConnection, DeliveredMessage

__all__ = ["GroupRegister", "GroupsHost", "delete_group", "list_groups"]

T = TypeVar("T")

logger = logging.getLogger("asyncbus")


def _parse(body: bytes) -> tuple[str, str, bool] | None:
    """The group an announcement records, and whether it says the group was deleted;
    ``None`` (with a warning) for anything else."""
    deleted = body[:1] == b"{"
    try:
        if deleted:
            try:
                found = json.loads(body)
            except ValueError as error:  # UnicodeDecodeError too
                raise DecodeError(f"not JSON: {error}") from None
            if type(found) is not dict or set(found) != {"deleted"}:
                raise DecodeError("an object other than a deletion")
            body = json.dumps(found["deleted"]).encode()
        pattern, group = group_from_wire(body)
    except (DecodeError, RecursionError) as error:  # written by another client: ignored
        logger.warning("RabbitMQ: ignoring an unreadable group announcement: %s", error)
        return None
    return pattern, group, deleted


class GroupRegister:
    """The groups recorded under ``prefix``, as this process knows them.

    :param prefix: the transport's prefix.
    """

    def __init__(self, prefix: str) -> None:
        #: The fanout exchange groups are announced on, and the durable register queue.
        self.exchange = f"{prefix}.groups"
        self.queue = f"{prefix}.groups"
        self.lock = f"{prefix}.groups.lock"
        self._groups: dict[str, tuple[Callable[[str], bool], str]] = {}
        #: Stage name -> (pattern, group), for listing.
        self.entries: dict[str, tuple[str, str]] = {}
        self._routes = TopicMatches(sort=True)

    @staticmethod
    def document(pattern: str, group: str) -> bytes:
        """The announcement of a group: its pattern and name as JSON."""
        return json.dumps([pattern, group]).encode()

    @staticmethod
    def deletion(pattern: str, group: str) -> bytes:
        """The announcement that a group was deleted."""
        return json.dumps({"deleted": [pattern, group]}).encode()

    def add(self, pattern: str, group: str) -> None:
        """Know (pattern, group) from now on."""
        name = f"{pattern}@{group}"
        if name in self._groups:
            return
        try:
            self._groups[name] = (compile_pattern(pattern), name)
        except ConfigurationError:
            return  # not a pattern: not a group asyncbus declared
        self.entries[name] = (pattern, group)
        self._routes.clear()

    def remove(self, pattern: str, group: str) -> None:
        """Forget (pattern, group): it was deleted."""
        name = f"{pattern}@{group}"
        self.entries.pop(name, None)
        if self._groups.pop(name, None) is not None:
            self._routes.clear()

    def _apply(self, parsed: tuple[str, str, bool] | None) -> None:
        if parsed is not None:
            pattern, group, deleted = parsed
            (self.remove if deleted else self.add)(pattern, group)

    def known(self, topic: str) -> tuple[str, ...]:
        """Stage names of the known groups ``topic`` reaches, sorted."""
        return self._routes.lookup(topic, self._groups.values())

    async def declare(self, channel: AbstractChannel) -> None:
        """The fanout exchange and the durable register queue bound to it."""
        await channel.exchange_declare(self.exchange, exchange_type="fanout", durable=True)
        await channel.queue_declare(self.queue, durable=True)
        await channel.queue_bind(self.queue, self.exchange, routing_key="")

    async def listen(self, connection: AbstractConnection) -> AbstractChannel:
        """Consume the news of groups on a private queue of ``connection`` (goes with it)."""
        channel = await connection.channel(publisher_confirms=False)
        declared = await channel.queue_declare("", exclusive=True, auto_delete=True)
        news = declared.queue
        assert news is not None
        await channel.queue_bind(news, self.exchange, routing_key="")

        async def on_news(message: DeliveredMessage) -> None:
            self._apply(_parse(message.body))

        await channel.basic_consume(news, on_news, no_ack=True)
        return channel

    async def read(
        self,
        connection: AbstractConnection,
        *,
        lock_timeout: float,
        tag: str,
        drop: tuple[str, str] | None = None,
    ) -> None:
        """Read the register (dropping its duplicates, deletions and the groups they
        deleted, and every entry of ``drop``) and know every group left in it."""
        scan = QueueScan(
            connection,
            queue=self.queue,
            lock=self.lock,
            lock_timeout=lock_timeout,
            consumer_tag=tag,
        )

        async def sift(reader: AbstractChannel, messages: list[DeliveredMessage]) -> None:
            kept: dict[tuple[str, str], DeliveredMessage] = {}
            for message in messages:
                parsed = _parse(message.body)
                if parsed is not None and parsed[2]:  # a deletion: it and what it deleted go
                    gone = kept.pop(parsed[:2], None)
                    if gone is not None:
                        await reader.basic_ack(gone.delivery_tag or 0)
                        self.remove(*parsed[:2])
                if parsed is None or parsed[2] or parsed[:2] in kept or parsed[:2] == drop:
                    await reader.basic_ack(message.delivery_tag or 0)  # a duplicate, or junk
                    continue
                kept[parsed[:2]] = message
                self.add(*parsed[:2])

        await scan.scan(sift)


class GroupsHost(Protocol):
    """What listing and deleting groups use of :class:`~.rabbit.RabbitTransport`."""

    publish_timeout: float
    _groups: GroupRegister
    _client_id: str
    _not_found: type[BaseException]
    #: Retry queues this process declared, by work queue.
    _retry_queues: dict[str, dict[str, float]]

    def queue_name(self, pattern: str, group: str) -> str:
        """The group's queue."""
        ...

    def _properties_type(self) -> Any:
        """AMQP's message properties (``TransportError`` when not connected)."""
        ...

    async def _admin(self, link: Any, operation: Callable[[AbstractChannel], Awaitable[T]]) -> T:
        """Run ``operation`` on the link's admin channel."""
        ...

    async def _call(
        self, what: str, operation: Callable[[Any], Awaitable[T]], deadline: float | None = None
    ) -> T:
        """Run ``operation`` on the live link, retried on a lost connection."""
        ...

    async def _send(
        self,
        link: Any,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Any,
        mandatory: bool = False,
    ) -> bool:
        """Publish one message on the link's confirmed channel."""
        ...

    async def _wait_link(self, deadline: float | None) -> Any:
        """The live link."""
        ...


async def list_groups(transport: GroupsHost) -> list[GroupInfo]:
    """The groups of the register whose queue exists (request inboxes aside): backlog
    is the messages ready in the queue, consumers its consumers (AMQP tells no last
    activity)."""
    transport._properties_type()
    register = transport._groups
    not_found = transport._not_found
    listed = []
    for pattern, group in sorted(register.entries.values()):
        if group.startswith(INBOX_GROUP_PREFIX):
            continue
        queue = transport.queue_name(pattern, group)

        async def count(link: Any, queue: str = queue) -> tuple[int, int] | None:
            try:
                declared = await transport._admin(
                    link, lambda channel: channel.queue_declare(queue, passive=True)
                )
            except not_found:
                return None
            return int(declared.message_count or 0), int(declared.consumer_count or 0)

        found = await transport._call(f"counting {queue!r}", count)
        if found is not None:
            listed.append(GroupInfo(pattern, group, found[0], found[1]))
    return listed


async def delete_group(transport: GroupsHost, pattern: str, group: str) -> bool:
    """Delete the group's queue (its binding and messages go with it) and the retry
    queues this process knows for it, tell every process, and drop it from the register."""
    transport._properties_type()
    register = transport._groups
    queue = transport.queue_name(pattern, group)
    recorded = f"{pattern}@{group}" in register.entries
    not_found = transport._not_found

    async def delete(link: Any) -> bool:
        existed = True
        try:
            await transport._admin(link, lambda channel: channel.queue_declare(queue, passive=True))
        except not_found:
            existed = False
        names = [queue, *transport._retry_queues.get(queue, {})] if existed else []
        for name in names:

            async def drop(channel: AbstractChannel, name: str = name) -> None:
                await channel.queue_delete(name)

            await transport._admin(link, drop)
        link.declared.discard(queue)
        link.announced.discard(queue)
        properties = transport._properties_type()(content_type="application/json", delivery_mode=2)
        await transport._send(
            link, register.exchange, "", register.deletion(pattern, group), properties
        )
        return existed

    existed = await transport._call(f"deleting group {pattern}@{group}", delete)
    transport._retry_queues.pop(queue, None)
    register.remove(pattern, group)
    try:
        link = await transport._wait_link(anyio.current_time() + transport.publish_timeout)
        await register.read(
            link.consumer,
            lock_timeout=transport.publish_timeout,
            tag=f"asyncbus.{transport._client_id}.groups.{secrets.token_hex(4)}",
            drop=(pattern, group),
        )
    except Exception as error:  # the deletion is done; the next reader drops the entries
        logger.warning("RabbitMQ: tidying the group register failed: %s", error)
    return existed or recorded
