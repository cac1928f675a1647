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

Whether a publish reached any queue at all is not this module's business: the
broker tells (a ``mandatory`` publish that no queue takes is returned). The names
known here only say *which* groups were reached, for the receipt.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from .._exceptions import ConfigurationError, DecodeError
from .._routing import compile_pattern
from ._kit.matches import TopicMatches
from ._rabbit_dead_letters import QueueScan
from ._wire_fields import group_from_wire

if TYPE_CHECKING:
    from aiormq.abc import AbstractChannel, AbstractConnection, DeliveredMessage

__all__ = ["GroupRegister"]

logger = logging.getLogger("asyncbus")


def _parse(body: bytes) -> tuple[str, str] | None:
    """The group an announcement records; ``None`` (with a warning) for anything else."""
    try:
        return group_from_wire(body)
    except DecodeError as error:  # written by another client: ignored
        logger.warning("RabbitMQ: ignoring an unreadable group announcement: %s", error)
        return None


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
        self._routes = TopicMatches(sort=True)

    @staticmethod
    def document(pattern: str, group: str) -> bytes:
        """The announcement of a group: its pattern and name as JSON."""
        return json.dumps([pattern, group]).encode()

    def add(self, pattern: str, group: str) -> None:
        """Know (pattern, group) from now on."""
        name = f"{pattern}@{group}"
        if name in self._groups:
            return
        try:
            self._groups[name] = (compile_pattern(pattern), name)
        except ConfigurationError:
            return  # not a pattern: not a group asyncbus declared
        self._routes.clear()

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
            parsed = _parse(message.body)
            if parsed is not None:
                self.add(*parsed)

        await channel.basic_consume(news, on_news, no_ack=True)
        return channel

    async def read(self, connection: AbstractConnection, *, lock_timeout: float, tag: str) -> None:
        """Read the register (dropping its duplicates) and know every group in it."""
        scan = QueueScan(
            connection,
            queue=self.queue,
            lock=self.lock,
            lock_timeout=lock_timeout,
            consumer_tag=tag,
        )

        async def sift(reader: AbstractChannel, messages: list[DeliveredMessage]) -> None:
            seen: set[tuple[str, str]] = set()
            for message in messages:
                parsed = _parse(message.body)
                if parsed is None or parsed in seen:
                    await reader.basic_ack(message.delivery_tag or 0)  # a duplicate, or junk
                    continue
                seen.add(parsed)
                self.add(*parsed)

        await scan.scan(sift)
