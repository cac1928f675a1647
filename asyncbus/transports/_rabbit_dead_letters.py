"""The dead-letter store of the RabbitMQ transport: reading and editing its queue.

AMQP has no way to look at a queue without consuming it. A :class:`QueueScan`
takes a broker-wide lock (an exclusive queue: another connection's declaration is
refused while it exists, and it goes when its connection does), consumes the whole
queue on a fresh channel without acking, acks the entries to drop and closes the
channel: the broker puts every other entry back in its place, in order (classic
queues keep the position of what is returned to them). A reader that dies half-way
returns everything too. A :class:`DeadLetterScan` does that to the dead-letter queue,
dropping the entries past the TTL, beyond the maximum length, or asked for.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

import anyio
import anyio.lowlevel

from .._dead_letters import DeadLetter
from .._exceptions import DecodeError, TransportError
from ._codec import Codec, dead_letter_from_wire
from ._kit import Backoff
from ._rabbit_consumer import BACKOFF_MIN, RELEASE_TIMEOUT

if TYPE_CHECKING:
    from aiormq.abc import AbstractChannel, AbstractConnection, DeliveredMessage

__all__ = ["DeadLetterScan", "QueueScan"]

T = TypeVar("T")

logger = logging.getLogger("asyncbus.transport.rabbit")

#: Idle seconds after which a read asks whether it has everything.
_IDLE = 0.05


class QueueScan:
    """One read of a whole queue under its lock; the entries not acked go back in place.

    :param connection: the connection to read on (its channels are opened and closed).
    :param queue: the queue to read.
    :param lock: the name of the exclusive lock queue.
    :param lock_timeout: seconds to wait for a lock another process holds.
    """

    def __init__(
        self,
        connection: AbstractConnection,
        *,
        queue: str,
        lock: str,
        lock_timeout: float,
        consumer_tag: str,
    ) -> None:
        self.connection = connection
        self.queue = queue
        self.lock = lock
        self.lock_timeout = lock_timeout
        self.consumer_tag = consumer_tag

    async def scan(
        self, sift: Callable[[AbstractChannel, list[DeliveredMessage]], Awaitable[T]]
    ) -> T:
        """Read every entry, hand them to ``sift`` (which acks those to drop), put the
        rest back; return what ``sift`` returned."""
        lock = await self._lock()
        try:
            reader = await self.connection.channel(publisher_confirms=False)
            try:
                messages = await self._read(reader)
                return await sift(reader, messages)
            finally:
                # Closing returns every entry not acked, each to its place.
                with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT):
                    if not reader.is_closed:
                        await reader.close()
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT):
                try:
                    if not lock.is_closed:
                        await lock.queue_delete(self.lock)
                        await lock.close()
                except Exception as error:  # the lock goes with the connection anyway
                    logger.debug("RabbitMQ: releasing the lock %s failed: %s", self.lock, error)

    async def _lock(self) -> AbstractChannel:
        """Hold the exclusive lock queue (another connection's declaration is refused)."""
        import aiormq.exceptions

        deadline = anyio.current_time() + self.lock_timeout
        backoff = Backoff(BACKOFF_MIN, 1.0)
        while True:
            channel = await self.connection.channel(publisher_confirms=False)
            try:
                await channel.queue_declare(self.lock, exclusive=True)
                return channel
            except aiormq.exceptions.ChannelLockedResource:
                pass  # the broker closed the channel
            except BaseException:  # deliberate: close the channel on any way out, re-raise
                with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT):
                    if not channel.is_closed:
                        await channel.close()
                raise
            if anyio.current_time() >= deadline:
                raise TransportError(
                    f"RabbitMQ: {self.queue!r} stayed locked by another process "
                    f"({self.lock!r}) for {self.lock_timeout} s"
                )
            await backoff.sleep()

    async def _read(self, reader: AbstractChannel) -> list[DeliveredMessage]:
        """Consume the whole dead-letter queue, unacked, on ``reader``."""
        import aiormq.exceptions

        try:
            declared = await reader.queue_declare(self.queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return []
        expected = int(declared.message_count or 0)
        if not expected:
            return []
        received: list[DeliveredMessage] = []
        arrived = [anyio.Event()]

        async def on_message(message: DeliveredMessage) -> None:
            received.append(message)
            arrived[0].set()

        await reader.basic_qos(prefetch_count=0)
        await reader.basic_consume(self.queue, on_message, consumer_tag=self.consumer_tag)
        while len(received) < expected:
            arrived[0] = anyio.Event()
            with anyio.move_on_after(_IDLE):
                await arrived[0].wait()
                continue
            # Quiet (some expired meanwhile?): everything handed to us has arrived once
            # the queue shows none ready and a round trip on this channel came back.
            left = await reader.queue_declare(self.queue, passive=True)
            await reader.basic_qos(prefetch_count=0)
            await anyio.lowlevel.checkpoint()
            if not left.message_count:
                break
        await reader.basic_cancel(self.consumer_tag)
        await anyio.lowlevel.checkpoint()
        return list(received)


class DeadLetterScan(QueueScan):
    """One read of the dead letters, dropping some of them, under the lock.

    :param ttl: seconds a dead letter is kept (older ones are dropped).
    :param maxlen: dead letters kept at most (the oldest beyond it are dropped).
    """

    def __init__(
        self,
        connection: AbstractConnection,
        *,
        queue: str,
        lock: str,
        codec: Codec,
        ttl: float,
        maxlen: int,
        lock_timeout: float,
        consumer_tag: str,
    ) -> None:
        super().__init__(
            connection, queue=queue, lock=lock, lock_timeout=lock_timeout, consumer_tag=consumer_tag
        )
        self.codec = codec
        self.ttl = ttl
        self.maxlen = maxlen

    async def run(self, drop: frozenset[str]) -> list[DeadLetter]:
        """The dead letters kept, oldest first, after dropping ``drop`` (envelope ids)."""

        async def sift(
            reader: AbstractChannel, messages: list[DeliveredMessage]
        ) -> list[DeadLetter]:
            return await self._sift(reader, messages, drop)

        return await self.scan(sift)

    async def _sift(
        self, reader: AbstractChannel, messages: list[DeliveredMessage], drop: frozenset[str]
    ) -> list[DeadLetter]:
        """Ack what goes (expired, beyond maxlen, dropped); return what stays."""
        horizon = time.time() - self.ttl
        kept: list[tuple[DeliveredMessage, DeadLetter]] = []
        gone: list[DeliveredMessage] = []
        for message in messages:
            try:
                entry = dead_letter_from_wire(message.body, self.codec)
            except DecodeError as error:
                logger.warning("RabbitMQ: skipping an unreadable dead letter: %s", error)
                continue
            if entry.dead_at <= horizon or entry.envelope.id in drop:
                gone.append(message)
            else:
                kept.append((message, entry))
        excess = len(kept) - max(self.maxlen, 0)
        if excess > 0:
            gone += [message for message, _ in kept[:excess]]
            kept = kept[excess:]
        for message in gone:
            await reader.basic_ack(message.delivery_tag or 0)
        return [entry for _, entry in kept]
