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

Listing (:func:`list_groups`) reads each recorded group's queue; :func:`backlog` counts
what a group has left: its ready messages, those of the retry queues this process used,
and the deliveries this process holds.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from .._exceptions import ConfigurationError, DecodeError
from .._groups import GroupInfo
from .._routing import compile_pattern
from ._kit.matches import TopicMatches
from ._kit.routes import is_inbox
from ._rabbit_dead_letters import QueueScan
from ._wire_fields import group_from_wire

if TYPE_CHECKING:
    from aiormq.abc import AbstractChannel, AbstractConnection, DeliveredMessage
    from pamqp.commands import Queue

    from ._kit import AckWriter
    from ._rabbit_channel import ConsumerChannel
    from ._rabbit_consumer import Subscription
    from ._rabbit_link import Connections, Link

__all__ = ["GroupRegister", "GroupsHost", "RetryQueues", "backlog", "delete_group", "list_groups"]

logger = logging.getLogger("asyncbus")
#: The transport's own logger (what counting a backlog reports).
_transport_logger = logging.getLogger("asyncbus.transport.rabbit")


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

    async def declare_exchange(self, channel: AbstractChannel) -> None:
        """The fanout exchange groups are announced on (the register queue is declared
        by the topology, as a quorum queue)."""
        await channel.exchange_declare(self.exchange, exchange_type="fanout", durable=True)

    async def bind(self, channel: AbstractChannel) -> None:
        """Bind the register queue to the exchange."""
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
            going: list[DeliveredMessage] = []
            for message in messages:
                parsed = _parse(message.body)
                if parsed is not None and parsed[2]:  # a deletion: it and what it deleted go
                    gone = kept.pop(parsed[:2], None)
                    if gone is not None:
                        going.append(gone)
                        self.remove(*parsed[:2])
                if parsed is None or parsed[2] or parsed[:2] in kept or parsed[:2] == drop:
                    going.append(message)  # a duplicate, or junk
                    continue
                kept[parsed[:2]] = message
                self.add(*parsed[:2])
            await scan.settle(reader, messages, going)

        await scan.scan(sift)


class RetryQueues(Protocol):
    """Where the retry queues this process declared are kept (``_rabbit_topology.Topology``)."""

    #: By work queue: each retry queue's name, and when it was declared.
    retry_queues: dict[str, dict[str, float]]


class GroupsHost(Protocol):
    """What listing and deleting groups, and counting their backlog, use of
    :class:`~.rabbit.RabbitTransport`."""

    publish_timeout: float
    _groups: GroupRegister
    _client_id: str
    _links: Connections
    _subscriptions: set[Subscription]
    _acks: AckWriter[ConsumerChannel, int]

    # Read-only (a property): the transport's declarations, of their own class.
    @property
    def _topology(self) -> RetryQueues: ...

    def queue_name(self, pattern: str, group: str) -> str:
        """The group's queue."""
        ...

    def _properties_type(self) -> Any:
        """AMQP's message properties (``TransportError`` when not connected)."""
        ...


async def _declared(transport: GroupsHost, link: Link, queue: str) -> Queue.DeclareOk | None:
    """The broker's answer to a passive declaration of ``queue`` (its counts); ``None``
    when it does not exist."""
    links = transport._links
    try:
        return await links.admin(link, lambda channel: channel.queue_declare(queue, passive=True))
    except links.not_found:
        return None


async def list_groups(transport: GroupsHost) -> list[GroupInfo]:
    """The groups of the register whose queue exists (request inboxes aside): backlog
    is the messages ready in the queue, consumers its consumers (AMQP tells no last
    activity)."""
    transport._properties_type()
    register = transport._groups
    listed = []
    for pattern, group in sorted(register.entries.values()):
        if is_inbox(group):
            continue
        queue = transport.queue_name(pattern, group)

        async def count(link: Link, queue: str = queue) -> tuple[int, int] | None:
            declared = await _declared(transport, link, queue)
            if declared is None:
                return None
            return int(declared.message_count or 0), int(declared.consumer_count or 0)

        found = await transport._links.call(f"counting {queue!r}", count)
        if found is not None:
            listed.append(GroupInfo(pattern, group, found[0], found[1]))
    return listed


async def delete_group(transport: GroupsHost, pattern: str, group: str) -> bool:
    """Delete the group's queue (its binding and messages go with it) and the retry
    queues this process knows for it, tell every process, and drop it from the register."""
    transport._properties_type()
    register = transport._groups
    links = transport._links
    retry_queues = transport._topology.retry_queues
    queue = transport.queue_name(pattern, group)
    recorded = f"{pattern}@{group}" in register.entries

    async def delete(link: Link) -> bool:
        existed = await _declared(transport, link, queue) is not None
        names = [queue, *retry_queues.get(queue, {})] if existed else []
        for name in names:

            async def drop(channel: AbstractChannel, name: str = name) -> None:
                await channel.queue_delete(name)

            await links.admin(link, drop)
        link.declared.discard(queue)
        link.announced.discard(queue)
        properties = transport._properties_type()(content_type="application/json", delivery_mode=2)
        await links.send(link, register.exchange, "", register.deletion(pattern, group), properties)
        return existed

    existed = await links.call(f"deleting group {pattern}@{group}", delete)
    retry_queues.pop(queue, None)
    register.remove(pattern, group)
    try:
        link = await links.live()
        await register.read(
            link.consumer,
            lock_timeout=transport.publish_timeout,
            tag=f"asyncbus.{transport._client_id}.groups.{secrets.token_hex(4)}",
            drop=(pattern, group),
        )
    except Exception as error:  # the deletion is done; the next reader drops the entries
        logger.warning("RabbitMQ: tidying the group register failed: %s", error)
    return existed or recorded


async def _ready_count(transport: GroupsHost, name: str) -> int | None:
    """Ready messages in queue ``name``; ``None`` when it does not exist."""

    async def count(link: Link) -> int | None:
        declared = await _declared(transport, link, name)
        return None if declared is None else int(declared.message_count or 0)

    return await transport._links.call(f"counting {name!r}", count)


async def backlog(transport: GroupsHost, pattern: str, group: str) -> int:
    """Ready messages of the group (and its retries here) + what this process holds
    (its acks written first)."""
    transport._properties_type()
    queue = transport.queue_name(pattern, group)
    total = 0
    if (count := await _ready_count(transport, queue)) is not None:
        total += count
    retries = transport._topology.retry_queues.get(queue, {})
    for name in list(retries):
        count = await _ready_count(transport, name)
        if count is None:
            retries.pop(name, None)  # expired
        else:
            total += count
    mine = [s for s in transport._subscriptions if s.queue == queue]
    # The queue's count leaves out what is delivered and unacked. A round trip first:
    # what the broker sent before it has arrived (held here, or handled with its ack
    # queued). Then the queued acks are written (after any write already going on)
    # and a second round trip means the broker has them: a drain that returns leaves
    # nothing handled here for the broker to deliver again. What is held, or acked
    # and not yet written, after that is counted, and the drain looks again.
    for subscription in mine:
        await subscription.sync()
    consumers = [s.consumer for s in mine if s.consumer is not None]
    acks = transport._acks
    if consumers:
        try:
            await acks.flush(consumers)
        except Exception as error:  # kept queued: the writer tries again
            _transport_logger.debug("RabbitMQ: writing acks for a backlog count failed: %s", error)
        for subscription in mine:
            await subscription.sync()
    total += sum(1 for consumer in consumers if acks.queued(consumer))
    return total + sum(subscription.unsettled() for subscription in mine)
