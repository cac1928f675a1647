"""What the RabbitMQ transport declares on the broker: its exchanges and fixed queues, the
quorum queue of each group and its binding, the delay queues of retries, and the catalog
recording them all (for deleting everything under a prefix)."""

from __future__ import annotations

import logging
import math
import time
from typing import TYPE_CHECKING, Protocol

import anyio

from .._exceptions import ConfigurationError, ConnectError
from ._kit import redact
from ._kit.routes import INBOX_TTL, is_inbox
from ._rabbit_link import EXTRA_MISSING, Connections, Link
from ._rabbit_names import KEY_LIMIT, binding_key, delay_bucket_ms

if TYPE_CHECKING:
    from aiormq.abc import AbstractChannel
    from pamqp.commands import Basic
    from pamqp.common import FieldTable

    from ._rabbit_dead_letters import RabbitDeadLetters
    from ._rabbit_groups import GroupRegister
    from .base import TransportSettings

__all__ = ["Topology", "TopologyHost"]

logger = logging.getLogger("asyncbus.transport.rabbit")

#: Unused retry queues are deleted after twice their delay plus this (ms).
_RETRY_EXPIRES_MS = 10 * 60 * 1000
#: Entries the catalog keeps (every process records its queues once: duplicates).
_CATALOG_MAX = 100_000
#: Queues of a bus's reply inbox (group ``_reply.{uuid}``, one per process) expire
#: (``x-expires``) this long after their last consumer left.
_INBOX_EXPIRES_MS = int(INBOX_TTL * 1000)
#: The largest x-message-ttl RabbitMQ accepts (about 49 days).
_TTL_MAX_MS = 2**32 - 1


class TopologyHost(Protocol):
    """What declaring uses of the transport (:class:`~.rabbit.RabbitTransport`)."""

    prefix: str
    url: str
    replicas: int | None
    settings: TransportSettings
    dead_letter_exchange: str
    dead_letter_queue: str
    _groups: GroupRegister
    _dead: RabbitDeadLetters

    def queue_name(self, pattern: str, group: str) -> str:
        """The group's queue."""
        ...

    def _properties_type(self) -> type[Basic.Properties]:
        """AMQP's message properties (``TransportError`` when not connected)."""
        ...


class Topology:
    """The names the transport declares, and which of them this process declared."""

    def __init__(self, host: TopologyHost, links: Connections) -> None:
        self._host = host
        self._links = links
        #: The queue naming every queue declared under the prefix (AMQP cannot list them).
        self.catalog = f"{host.prefix}.catalog"
        #: Retry queues used by this process, by work queue, with when they were declared.
        self.retry_queues: dict[str, dict[str, float]] = {}
        #: Queues found with other arguments and kept as they are (said once each).
        self._kept: set[str] = set()

    def durable_arguments(self, arguments: FieldTable | None = None) -> FieldTable:
        """The arguments of a durable queue the transport shares: a quorum queue (its
        ``replicas``, when given), with ``arguments``."""
        found: FieldTable = {"x-queue-type": "quorum", **(arguments or {})}
        if self._host.replicas is not None:
            found["x-quorum-initial-group-size"] = self._host.replicas
        return found

    async def declare_durable(self, link: Link, queue: str, arguments: FieldTable) -> None:
        """Declare ``queue`` with ``arguments``; one that exists with others (a classic
        queue of an older version, other limits) is kept as it is, said once.

        :raises Exception: what the client raises otherwise (a classic queue whose node
            is down: ``NOT_FOUND``).
        """
        admin = self._links.admin
        try:
            await admin(
                link,
                lambda channel: channel.queue_declare(queue, durable=True, arguments=arguments),
            )
        except self._links.aiormq.exceptions.ChannelPreconditionFailed as error:
            if queue not in self._kept:
                self._kept.add(queue)
                logger.warning(
                    "RabbitMQ: %s exists with other arguments (a classic queue declared by "
                    "an older version, or other limits): used as it is (%s)",
                    queue,
                    error,
                )
            await admin(link, lambda channel: channel.queue_declare(queue, passive=True))

    async def _declare_fixed_queue(self, link: Link, queue: str, arguments: FieldTable) -> bool:
        """:meth:`declare_durable`, tolerating a queue whose node is down (a classic queue
        of an older version: its node alone holds it): logged, ``False``."""
        try:
            await self.declare_durable(link, queue, arguments)
        except self._links.not_found as error:
            logger.warning(
                "RabbitMQ: %s cannot be used until its node is back (%s); going on without it",
                queue,
                error,
            )
            return False
        return True

    async def declare_fixed(self, link: Link) -> None:
        """The topic exchange, the dead-letter exchange and queue, the catalog and the
        group register (see the module docstring of :mod:`.rabbit`)."""
        host = self._host
        admin = self._links.admin

        async def declare(channel: AbstractChannel) -> None:
            await channel.exchange_declare(host.prefix, exchange_type="topic", durable=True)
            for fanout in (host.dead_letter_exchange, host._dead.news.exchange):
                await channel.exchange_declare(fanout, exchange_type="fanout", durable=True)

        await admin(link, declare)
        await self._declare_fixed_queue(
            link, self.catalog, self.durable_arguments({"x-max-length": _CATALOG_MAX})
        )
        limits: FieldTable = {
            "x-message-ttl": min(max(1, int(host.settings.dead_letter_ttl * 1000)), _TTL_MAX_MS),
            "x-max-length": max(0, int(host.settings.dead_letter_maxlen)),
        }
        if await self._declare_fixed_queue(
            link, host.dead_letter_queue, self.durable_arguments(limits)
        ):

            async def bind(channel: AbstractChannel) -> None:
                await channel.queue_bind(
                    host.dead_letter_queue, host.dead_letter_exchange, routing_key=""
                )

            await admin(link, bind)
        register = host._groups
        await admin(link, register.declare_exchange)
        if await self._declare_fixed_queue(link, register.queue, self.durable_arguments()):
            await admin(link, register.bind)

    async def declare_queue(self, link: Link, pattern: str, group: str) -> str:
        """Declare the quorum queue of a group and bind it (once per link)."""
        host = self._host
        queue = host.queue_name(pattern, group)
        if queue in link.declared:
            return queue
        key = binding_key(pattern)
        # A bus's reply inbox: its process's alone, gone once nobody consumes it.
        arguments: FieldTable = (
            {"x-queue-type": "quorum", "x-expires": _INBOX_EXPIRES_MS}
            if is_inbox(group)
            else self.durable_arguments()
        )

        async def declare(channel: AbstractChannel) -> None:
            try:
                await channel.queue_declare(queue, durable=True, arguments=arguments)
            except self._links.aiormq.exceptions.ChannelPreconditionFailed as error:
                # The queue exists with other arguments (another replicas=): a setting
                # to change, not a failure to retry.
                raise ConfigurationError(
                    f"RabbitMQ: the queue {queue} exists with other arguments than this "
                    f"transport's (replicas={host.replicas!r}): {error}; give the setting it "
                    "was declared with, or delete the queue (its messages with it) first"
                ) from error
            await channel.queue_bind(queue, host.prefix, routing_key=key)

        await self._links.admin(link, declare)
        await self.catalogue(link, queue)
        await self._announce(link, queue, pattern, group)
        link.declared.add(queue)
        return queue

    async def declare_group(self, pattern: str, group: str) -> str:
        """Declare the group's queue on the live link (retried across a reconnection)."""
        binding_key(pattern)  # a bad pattern is a ConfigurationError, raised here
        return await self._links.call(
            f"declaring the queue of {pattern}@{group}",
            lambda link: self.declare_queue(link, pattern, group),
        )

    def forget(self, queue: str) -> None:
        """``queue`` must be declared again before use (it was deleted)."""
        link = self._links.link
        if link is not None:
            link.declared.discard(queue)

    async def catalogue(self, link: Link, queue: str) -> None:
        """Record ``queue`` in the catalog (once per link) for :meth:`delete_everything`."""
        if queue in link.catalogued:
            return
        properties = self._host._properties_type()(delivery_mode=2, message_id=queue)
        await self._links.send(link, "", self.catalog, queue.encode(), properties)
        link.catalogued.add(queue)

    async def _announce(self, link: Link, queue: str, pattern: str, group: str) -> None:
        """Record a group in the broker (once per link) for every process's receipts.

        Once per link, not once for all: a broker that restarted with its state lost
        (then the connections drop) has lost the register too; announced again when
        the subscription declares its queue on the new link, the group is known again
        to every process that connects from then on (readers drop the duplicates).
        """
        if queue in link.announced or is_inbox(group):
            return  # (a reply inbox is one process's, and short-lived)
        register = self._host._groups
        register.add(pattern, group)
        properties = self._host._properties_type()(
            content_type="application/json", delivery_mode=2, message_id=queue
        )
        await self._links.send(
            link, register.exchange, "", register.document(pattern, group), properties
        )
        link.announced.add(queue)

    async def retry_queue(self, link: Link, queue: str, delay: float) -> str:
        """The retry queue for ``delay`` of work queue ``queue``, declared if need be."""
        ms = delay_bucket_ms(delay)
        name = f"{queue}.retry.{ms}"
        known = self.retry_queues.setdefault(queue, {})
        expires = 2 * ms + _RETRY_EXPIRES_MS
        now = time.monotonic()
        # Declaring again resets x-expires: a queue in use never expires under a retry.
        if name in link.declared and now - known.get(name, -math.inf) < expires / 2000:
            return name

        arguments = self.durable_arguments(
            {
                "x-message-ttl": ms,
                "x-dead-letter-exchange": "",
                "x-dead-letter-routing-key": queue,
                # Dead-lettered once the group's queue confirmed it (needs reject-publish;
                # a retry queue has no length limit to reject at).
                "x-dead-letter-strategy": "at-least-once",
                "x-overflow": "reject-publish",
                "x-expires": expires,
            }
        )
        await self.declare_durable(link, name, arguments)
        await self.catalogue(link, name)
        link.declared.add(name)
        known[name] = now
        return name

    async def delete_everything(self) -> None:
        """Delete every queue and exchange of the prefix, messages included (see
        :meth:`~.rabbit.RabbitTransport.delete_everything`), on a connection of its own.

        :raises ConnectError: when the broker cannot be reached.
        """
        host = self._host
        try:
            import aiormq
            import aiormq.exceptions as errors
        except ImportError as error:
            raise ConnectError(EXTRA_MISSING) from error
        try:
            connection = await aiormq.connect(host.url)
        except Exception as error:
            raise ConnectError(
                f"cannot connect to RabbitMQ at {redact(host.url)}: {error}"
            ) from error
        try:
            channel = await connection.channel(publisher_confirms=False)
            names: list[str] = []
            try:
                await channel.queue_declare(self.catalog, passive=True)
            except errors.ChannelNotFoundEntity:
                channel = await connection.channel(publisher_confirms=False)
            else:
                while True:
                    message = await channel.basic_get(self.catalog, no_ack=True)
                    if not message.delivery_tag:
                        break  # Basic.GetEmpty
                    # Names this prefix's transports wrote; another client's junk
                    # (not UTF-8, too long for a queue name) is skipped.
                    name = bytes(message.body or b"").decode("utf-8", "replace")
                    if name and len(name.encode()) <= KEY_LIMIT:
                        names.append(name)
            fixed = [
                host.dead_letter_queue,
                host._dead.lock_queue,
                self.catalog,
                host._groups.queue,
                host._groups.lock,
            ]
            for queue in dict.fromkeys([*names, *fixed]):
                try:
                    await channel.queue_delete(queue)
                except errors.ChannelNotFoundEntity:
                    channel = await connection.channel(publisher_confirms=False)
            exchanges = (
                host.prefix,
                host.dead_letter_exchange,
                host._dead.news.exchange,
                host._groups.exchange,
            )
            for exchange in exchanges:
                try:
                    await channel.exchange_delete(exchange)
                except errors.ChannelNotFoundEntity:
                    channel = await connection.channel(publisher_confirms=False)
        finally:
            with anyio.CancelScope(shield=True):
                await connection.close()
