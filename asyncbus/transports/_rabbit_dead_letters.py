"""The dead-letter store of the RabbitMQ transport: reading and editing its queue, and
its news.

AMQP has no way to look at a queue without consuming it. A :class:`QueueScan`
takes a broker-wide lock (an exclusive queue: another connection's declaration is
refused while it exists, and it goes when its connection does), consumes the whole
queue on a fresh channel without acking, acks the entries to drop and closes the
channel: the broker puts every other entry back in its place, in order (classic
queues keep the position of what is returned to them; a quorum queue puts what a closed
channel held back ahead of the rest, in order, counting it in ``x-delivery-count``,
which no delivery limit applies to: none is declared). A reader that dies half-way
returns everything too. A :class:`DeadLetterScan` does that to the dead-letter queue,
dropping the entries past the TTL, beyond the maximum length, or asked for (taking
them out: the lock makes that a claim, one process at a time).

:class:`DeadLetterNews` tells a process what every process changes: a private queue
of its connection is bound to the dead-letter exchange (every dead letter stored
reaches it too) and to ``{prefix}.deadletters.changes``, where what was taken out is
announced (the keys, as JSON) or ``"stale"`` when every list should be read again.
One queue holds both, so they come in the order the broker routed them.

:class:`RabbitDeadLetters` is the store as the transport offers it: adding, listing,
taking, clearing, restoring and watching, each announcing what it changed.
"""

from __future__ import annotations

import contextlib
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractContextManager, asynccontextmanager
from functools import partial
from typing import TYPE_CHECKING, Protocol, TypeVar

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectSendStream

from .._dead_letters import DeadLetter, DeadLetterKey, dead_letter_key
from .._exceptions import DecodeError, TransportError
from ._codec import (
    Codec,
    dead_letter_from_wire,
    dead_letter_keys_from_wire,
    dead_letter_keys_to_wire,
    dead_letter_to_wire,
)
from ._kit import Backoff
from ._rabbit_consumer import BACKOFF_MIN, RELEASE_TIMEOUT
from .base import DeadLetterChange

if TYPE_CHECKING:
    from aiormq.abc import AbstractChannel, AbstractConnection, DeliveredMessage
    from pamqp.commands import Basic, Queue

    from ._rabbit_link import Connections, Link
    from ._rabbit_publisher import Publisher
    from .base import TransportSettings

__all__ = ["DeadLetterHost", "DeadLetterNews", "DeadLetterScan", "QueueScan", "RabbitDeadLetters"]

T = TypeVar("T")

logger = logging.getLogger("asyncbus.transport.rabbit")

#: Idle seconds after which a read asks whether it has everything.
_IDLE = 0.05
#: The prefetch of a reading consumer: the largest AMQP takes (16 bits).
_SCAN_PREFETCH = 65535
#: Entries a read drops one by one at most (beyond the run that begins it); the
#: broker's client of a quorum queue sends 32 settlements at a time.
_ACKS_PER_READ = 16
#: Longest wait for the entries an earlier reader held to be back in the queue, and
#: how often to look.
_RETURNS_WAIT = 2.0
_RETURNS_LOOK = 0.005


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
        #: Whether the read under way left entries to drop for another read.
        self.again = False

    async def scan(
        self, sift: Callable[[AbstractChannel, list[DeliveredMessage]], Awaitable[T]]
    ) -> T:
        """Read every entry, hand them to ``sift`` (which drops entries with
        :meth:`settle`), put the rest back; read again while entries to drop were left
        for another read; return what ``sift`` returned the last time."""
        lock = await self._lock()
        try:
            while True:
                self.again = False
                result = await self._read_once(sift)
                if not self.again:
                    return result
        finally:
            with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT):
                try:
                    if not lock.is_closed:
                        await lock.queue_delete(self.lock)
                        await lock.close()
                except Exception as error:  # the lock goes with the connection anyway
                    logger.debug("RabbitMQ: releasing the lock %s failed: %s", self.lock, error)

    async def _read_once(
        self, sift: Callable[[AbstractChannel, list[DeliveredMessage]], Awaitable[T]]
    ) -> T:
        """One read on a fresh channel, closed after ``sift``."""
        reader = await self.connection.channel(publisher_confirms=False)
        try:
            return await sift(reader, await self._read(reader))
        finally:
            # Closing returns every entry not acked, each to its place.
            with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT):
                if not reader.is_closed:
                    await reader.close()

    async def settle(
        self,
        reader: AbstractChannel,
        received: list[DeliveredMessage],
        going: list[DeliveredMessage],
    ) -> set[int]:
        """Ack (drop) ``going``, of the entries ``received`` in this read; return the
        delivery tags acked.

        A quorum queue's client in the broker's channel sends a few dozen settlements at
        a time and holds the rest back until the first are applied: those still held
        when the channel closes are lost, and their entries go back. So the run of
        entries to drop that begins the read is acked at once (one ``multiple`` ack is
        one settlement), and at most :data:`_ACKS_PER_READ` others one by one; what is
        left is dropped by another read (:meth:`scan` reads again).
        """
        tags = {message.delivery_tag or 0 for message in going}
        run = 0
        while run < len(received) and (received[run].delivery_tag or 0) in tags:
            run += 1
        acked = {message.delivery_tag or 0 for message in received[:run]}
        if run:
            await reader.basic_ack(received[run - 1].delivery_tag or 0, multiple=True)
        rest = sorted(
            (message for message in going if (message.delivery_tag or 0) not in acked),
            key=lambda message: message.delivery_tag or 0,
        )
        for message in rest[:_ACKS_PER_READ]:
            await reader.basic_ack(message.delivery_tag or 0)
            acked.add(message.delivery_tag or 0)
        if len(rest) > _ACKS_PER_READ:
            self.again = True
        return acked

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

    async def _returned(self, reader: AbstractChannel) -> Queue.DeclareOk:
        """The queue's counts once what an earlier reader held is back in it.

        Only readers consume the queue, one at a time: a consumer still counted is one
        whose channel closed and whose entries a quorum queue has not taken back yet
        (it does so a moment later; a classic queue at once). Counted now, those would
        be missed, and kept by a read meant to drop them. Waited for up to
        :data:`_RETURNS_WAIT` seconds (a client of another kind may consume it).
        """
        deadline = anyio.current_time() + _RETURNS_WAIT
        while True:
            declared = await reader.queue_declare(self.queue, passive=True)
            if not declared.consumer_count or anyio.current_time() >= deadline:
                return declared
            await anyio.sleep(_RETURNS_LOOK)

    async def _read(self, reader: AbstractChannel) -> list[DeliveredMessage]:
        """Consume the whole dead-letter queue, unacked, on ``reader``."""
        import aiormq.exceptions

        try:
            declared = await self._returned(reader)
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

        # A quorum queue gives a consumer without a prefetch 2,000 messages at most: the
        # largest prefetch AMQP takes, and one more consumer each time one is full.
        await reader.basic_qos(prefetch_count=_SCAN_PREFETCH)
        tags = [self.consumer_tag]
        await reader.basic_consume(self.queue, on_message, consumer_tag=tags[0])
        while len(received) < expected:
            arrived[0] = anyio.Event()
            with anyio.move_on_after(_IDLE):
                await arrived[0].wait()
                continue
            # Quiet (some expired meanwhile?): everything handed to us has arrived once
            # the queue shows none ready and a round trip on this channel came back.
            left = await reader.queue_declare(self.queue, passive=True)
            await reader.basic_qos(prefetch_count=_SCAN_PREFETCH)
            await anyio.lowlevel.checkpoint()
            if not left.message_count:
                break
            if len(received) >= len(tags) * _SCAN_PREFETCH:
                tags.append(f"{self.consumer_tag}.{len(tags)}")
                await reader.basic_consume(self.queue, on_message, consumer_tag=tags[-1])
        # Not cancelled: the consumer goes with the channel, together with what it holds
        # (what reaches it from now on is not read, and goes back too), so while a quorum
        # queue still counts it, the next reader knows to wait (``_returned``).
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

    async def run(self, drop: frozenset[str] | None) -> tuple[list[DeadLetter], list[DeadLetter]]:
        """The dead letters kept, oldest first, after taking out those of ``drop``
        (envelope ids; ``None``: every one); and those taken out."""

        taken: list[DeadLetter] = []  # (over every read the scan makes)

        async def sift_and_take(
            reader: AbstractChannel, messages: list[DeliveredMessage]
        ) -> tuple[list[DeadLetter], list[DeadLetter]]:
            kept, now_taken = await self._sift(reader, messages, drop)
            taken.extend(now_taken)
            return kept, taken

        return await self.scan(sift_and_take)

    async def _sift(
        self,
        reader: AbstractChannel,
        messages: list[DeliveredMessage],
        drop: frozenset[str] | None,
    ) -> tuple[list[DeadLetter], list[DeadLetter]]:
        """Drop what goes (expired, beyond maxlen, dropped: :meth:`settle`); return what
        stays, and what was dropped now (taken out)."""
        horizon = time.time() - self.ttl
        kept: list[tuple[DeliveredMessage, DeadLetter]] = []
        gone: list[DeliveredMessage] = []
        taken: list[tuple[DeliveredMessage, DeadLetter]] = []
        for message in messages:
            try:
                entry = dead_letter_from_wire(message.body, self.codec)
            except DecodeError as error:
                logger.warning("RabbitMQ: skipping an unreadable dead letter: %s", error)
                if drop is None:
                    gone.append(message)
                continue
            if entry.dead_at <= horizon:
                gone.append(message)
            elif drop is None or entry.envelope.id in drop:
                gone.append(message)
                taken.append((message, entry))
            else:
                kept.append((message, entry))
        excess = len(kept) - max(self.maxlen, 0)
        if excess > 0:
            gone += [message for message, _ in kept[:excess]]
            kept = kept[excess:]
        acked = await self.settle(reader, messages, gone)
        return [entry for _, entry in kept], [e for m, e in taken if m.delivery_tag in acked]


#: The body of a change that says: read every dead letter again.
STALE = b'"stale"'


class DeadLetterNews:
    """What every process adds to and takes out of the dead letters, as it happens.

    :param dead_letter_exchange: the fanout exchange every dead letter is published to.
    :param exchange: the fanout exchange changes are announced on.
    :param codec: the transport's codec (to read the dead letters).
    """

    def __init__(self, dead_letter_exchange: str, exchange: str, codec: Codec) -> None:
        self.dead_letter_exchange = dead_letter_exchange
        self.exchange = exchange
        self.codec = codec
        #: The watchers, by the connection their queue lives on.
        self._watchers: dict[MemoryObjectSendStream[DeadLetterChange], object] = {}

    @staticmethod
    def removal(keys: Sequence[DeadLetterKey]) -> bytes:
        """The announcement of entries taken out."""
        return dead_letter_keys_to_wire(keys)

    def lost(self, connection: object) -> None:
        """``connection`` is gone, and its queues: its watchers' changes end."""
        for watcher, on in list(self._watchers.items()):
            if on is connection:
                watcher.close()

    @asynccontextmanager
    async def watch(
        self,
        connection: AbstractConnection,
        cleanup: Callable[[], AbstractContextManager[anyio.CancelScope]],
    ) -> AsyncIterator[AsyncIterator[DeadLetterChange]]:
        """The changes from now on, through a private queue of ``connection``; they end
        when it is lost (watch again on the next one, and read everything). ``cleanup``
        bounds closing its channel (the transport's close deadline)."""
        send, receive = anyio.create_memory_object_stream[DeadLetterChange](math.inf)

        async def on_message(message: DeliveredMessage) -> None:
            body = bytes(message.body or b"")
            if message.exchange == self.exchange:
                change = self._change(body)
            else:
                try:
                    change = DeadLetterChange(added=(dead_letter_from_wire(body, self.codec),))
                except DecodeError as error:
                    logger.warning("RabbitMQ: skipping an unreadable dead letter: %s", error)
                    return
            with contextlib.suppress(anyio.ClosedResourceError):  # (lost: nothing more)
                send.send_nowait(change)

        channel = await connection.channel(publisher_confirms=False)
        try:
            declared = await channel.queue_declare("", exclusive=True, auto_delete=True)
            queue = declared.queue
            assert queue is not None
            await channel.exchange_declare(self.exchange, exchange_type="fanout", durable=True)
            for exchange in (self.dead_letter_exchange, self.exchange):
                await channel.queue_bind(queue, exchange, routing_key="")
            await channel.basic_consume(queue, on_message, no_ack=True)
            self._watchers[send] = connection
            async with receive:
                yield receive
        finally:
            self._watchers.pop(send, None)
            send.close()
            receive.close()  # (when setting up failed: never handed out)
            with cleanup():
                try:
                    if not channel.is_closed:
                        await channel.close()  # the queue goes with it (exclusive)
                except Exception as error:  # the connection may be gone already
                    logger.debug("RabbitMQ: closing the dead letters' news failed: %s", error)

    def _change(self, body: bytes) -> DeadLetterChange:
        if body == STALE:
            return DeadLetterChange(stale=True)
        try:
            return DeadLetterChange(removed=dead_letter_keys_from_wire(body))
        except DecodeError as error:
            logger.warning("RabbitMQ: unreadable removal of dead letters: %s", error)
            return DeadLetterChange(stale=True)


class DeadLetterHost(Protocol):
    """What the store uses of the transport (:class:`~.rabbit.RabbitTransport`)."""

    prefix: str
    codec: Codec
    settings: TransportSettings
    publish_timeout: float
    dead_letter_exchange: str
    dead_letter_queue: str
    _client_id: str

    def cleanup_scope(self, timeout: float = ...) -> AbstractContextManager[anyio.CancelScope]:
        """A shielded clean-up scope, bounded by the close deadline."""
        ...

    def _properties_type(self) -> type[Basic.Properties]:
        """AMQP's message properties (``TransportError`` when not connected)."""
        ...


class RabbitDeadLetters:
    """The dead letters every process shares, read under the broker-wide lock, their
    changes announced to every watcher."""

    def __init__(self, host: DeadLetterHost, links: Connections, publisher: Publisher) -> None:
        self._host = host
        self._links = links
        self._publisher = publisher
        #: The exclusive queue that exists while one process reads or edits them.
        self.lock_queue = f"{host.prefix}.deadletters.lock"
        self.news = DeadLetterNews(
            host.dead_letter_exchange, f"{host.prefix}.deadletters.changes", host.codec
        )
        self._lock = anyio.Lock()

    async def add(self, entry: DeadLetter) -> None:
        """Publish ``entry`` to the dead-letter queue."""
        self._host._properties_type()
        await self._publisher.publish_dead(
            entry.envelope.id, dead_letter_to_wire(entry, self._host.codec)
        )

    async def listed(self) -> list[DeadLetter]:
        """The dead letters, oldest first, after dropping those past the TTL or maxlen."""
        kept, _ = await self._edit(frozenset())
        return kept

    async def take(self, ids: Sequence[str]) -> list[DeadLetter]:
        """Delete the dead letters of these envelope ids, under the lock (the claim);
        return those this call deleted, telling every watcher."""
        self._host._properties_type()
        if not ids:
            return []
        _, taken = await self._edit(frozenset(ids))
        if taken:
            await self._announce(DeadLetterNews.removal(list(map(dead_letter_key, taken))))
        return taken

    async def clear(self) -> None:
        """Delete every dead letter, under the lock (every watcher reads them again)."""
        await self._edit(None)
        await self._announce(STALE)

    async def restore(self, entries: Sequence[DeadLetter]) -> None:
        """Publish ``entries`` again (taken for a replay that failed); every watcher
        reads the dead letters again."""
        self._host._properties_type()
        await self._publisher.publish_dead_letters(entries)
        await self._announce(STALE)

    @asynccontextmanager
    async def watch(self) -> AsyncIterator[AsyncIterator[DeadLetterChange]]:
        """Every dead letter added or removed from now on, by any process; the changes
        end when the connection is lost (watch again: what was missed is unknown)."""
        host = self._host
        host._properties_type()
        link = await self._links.live()
        self.news.codec = host.codec
        try:
            cleanup = partial(host.cleanup_scope, RELEASE_TIMEOUT)
            async with self.news.watch(link.consumer, cleanup) as changes:
                yield changes
        except (self._links.aiormq.exceptions.AMQPError, OSError) as error:
            raise self._links.failed("watching the dead letters", error) from error

    async def _announce(self, body: bytes) -> None:
        properties = self._host._properties_type()(content_type="application/json", delivery_mode=1)
        await self._publisher.publish_one(self.news.exchange, "", body, properties)

    async def _edit(self, drop: frozenset[str] | None) -> tuple[list[DeadLetter], list[DeadLetter]]:
        self._host._properties_type()
        async with self._lock:
            return await self._links.call("reading the dead letters", partial(self._scan, drop))

    async def _scan(
        self, drop: frozenset[str] | None, link: Link
    ) -> tuple[list[DeadLetter], list[DeadLetter]]:
        host = self._host
        scan = DeadLetterScan(
            link.consumer,
            queue=host.dead_letter_queue,
            lock=self.lock_queue,
            codec=host.codec,
            ttl=host.settings.dead_letter_ttl,
            maxlen=host.settings.dead_letter_maxlen,
            lock_timeout=host.publish_timeout,
            consumer_tag=f"asyncbus.{host._client_id}.dead.{secrets.token_hex(4)}",
        )
        return await scan.run(drop)
