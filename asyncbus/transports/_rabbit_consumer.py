"""The consuming side of the RabbitMQ transport: subscriptions and their deliveries.

A :class:`Subscription` owns one consumer channel at a time (a new one after a lost
connection; ``_rabbit_channel.ConsumerChannel`` keeps the acks that channel owes the
broker); :class:`RabbitDelivery` is what a subscription hands out. The broker calls go
through the transport (:mod:`asyncbus.transports.rabbit`): its connections, declarations
and publisher; it also runs the helpers that write acks behind and give back what a
stuck consumer holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections import deque
from contextlib import AbstractContextManager
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.lowlevel

from .._dead_letters import DeadLetter
from .._envelope import Envelope
from .._exceptions import DecodeError, TransportError
from ._codec import RawBody, envelope_from_wire
from ._kit import Backoff
from ._kit.options import checked_prefetch
from ._kit.redeliveries import HEADER_DELIVERIES, carried_deliveries, over_max_deliveries
from ._rabbit_channel import ConsumerChannel, retrieve, spurious_cancel
from ._rabbit_plain import message_id_of, plain_message
from .base import BaseDelivery, Delivery

if TYPE_CHECKING:
    from aiormq.abc import AbstractChannel, AbstractConnection, DeliveredMessage

    from ._codec import Codec
    from ._kit import AckWriter

__all__ = [
    "BACKOFF_MIN",
    "EXPIRED",
    "LOST",
    "META_HEADER",
    "PREFETCH_MAX",
    "QUEUED_HEADER",
    "RELEASED",
    "RELEASE_TIMEOUT",
    "RETURNED",
    "RabbitDelivery",
    "RabbitHost",
    "RabbitLink",
    "RabbitLinks",
    "RabbitQueues",
    "Republisher",
    "Subscription",
]

logger = logging.getLogger("asyncbus.transport.rabbit")

#: Header carrying the envelope's fields (all but the payload) as JSON.
META_HEADER = "asyncbus-meta"
#: Quorum queues count the returns of a message in this header.
_DELIVERY_COUNT = "x-delivery-count"
#: Header carrying when the message was put in its queue (ms since the epoch, the
#: publisher's clock): AMQP's own ``timestamp`` has whole seconds only.
QUEUED_HEADER = "asyncbus-queued"
BACKOFF_MIN = 0.05
#: Seconds a leaving consumer, or one found stuck, may take to give its deliveries back.
RELEASE_TIMEOUT = 5.0
#: AMQP's prefetch count is 16 bits.
PREFETCH_MAX = 65535

# Why a delivery the transport took back cannot be settled (``BaseDelivery.take_back``).
EXPIRED = "was not settled within ack_timeout and went back to the queue"
LOST = "came over a connection that was lost: the broker delivers it again"
RELEASED = "was released when its subscription ended"
RETURNED = "went back to the queue"


class RabbitLink(Protocol):
    """What a subscription uses of one generation of the transport's connections."""

    #: The consuming connection.
    consumer: AbstractConnection


class RabbitLinks(Protocol):
    """What subscriptions use of the transport's connections (``_rabbit_link.Connections``)."""

    closing: bool
    fatal: tuple[type[BaseException], ...]
    not_found: type[BaseException]

    def failed(self, what: str, error: BaseException) -> TransportError:
        """The error to raise when ``what`` failed with ``error``."""
        ...

    async def wait(self, deadline: float | None) -> RabbitLink:
        """The live link, waiting for a reconnection up to ``deadline``."""
        ...


class RabbitQueues(Protocol):
    """What subscriptions use of the transport's declarations (``_rabbit_topology.Topology``)."""

    async def declare_queue(self, link: Any, pattern: str, group: str) -> str:
        """Declare and bind the queue of (pattern, group) on ``link`` (once per link)."""
        ...

    def forget(self, queue: str) -> None:
        """``queue`` must be declared again before use (it was deleted)."""
        ...


class Republisher(Protocol):
    """What deliveries and subscriptions use of the transport's publisher
    (``_rabbit_publisher.Publisher``): the republishes that settle them."""

    async def retry(self, delivery: RabbitDelivery, delay: float | None) -> None:
        """Republish ``delivery`` (attempt + 1), then ack it."""
        ...

    async def bury(self, delivery: RabbitDelivery, entry: DeadLetter) -> None:
        """Store ``entry``, then ack the delivery."""
        ...

    async def hand_back(
        self, consumer: ConsumerChannel, queue: str, deliveries: list[RabbitDelivery]
    ) -> list[RabbitDelivery]:
        """Put ``deliveries`` back in ``queue`` as copies carrying their count, then ack;
        return those that could not be copied."""
        ...


class RabbitHost(Protocol):
    """What subscriptions and deliveries use of their transport (:class:`~.rabbit.
    RabbitTransport` is one): settings, its connections, declarations, settling, acks."""

    prefix: str
    codec: Codec
    ack_timeout: float
    keep_alive: bool
    max_backoff: float
    max_deliveries: int
    _client_id: str
    _subscriptions: set[Subscription]
    _acks: AckWriter[ConsumerChannel, int]

    # Read-only (properties): the transport's collaborators, of their own classes.
    @property
    def _links(self) -> RabbitLinks: ...
    @property
    def _topology(self) -> RabbitQueues: ...
    @property
    def _publisher(self) -> Republisher: ...

    def queue_name(self, pattern: str, group: str) -> str:
        """The queue of (pattern, group)."""
        ...

    def cleanup_scope(self, timeout: float = ...) -> AbstractContextManager[anyio.CancelScope]:
        """A shielded clean-up scope, bounded by the close deadline."""
        ...

    def _ack(
        self, consumer: ConsumerChannel, tag: int, stage: str, envelope_id: str | None
    ) -> None:
        """Queue the ack of ``tag`` for the writer."""
        ...


class RabbitDelivery(BaseDelivery):
    """A delivery from :class:`~.rabbit.RabbitTransport`; its acks are written behind.

    Acks go with others, within the transport's ack linger (or at once when half the
    prefetch waits): a process that dies before the ack is written gets the message
    redelivered, as at-least-once delivery allows.
    """

    __slots__ = (
        "_before",
        "_body",
        "_consumer",
        "_deadline",
        "_queued",
        "_subscription",
        "_tag",
    )

    acks_behind = True

    def __init__(
        self,
        subscription: Subscription,
        consumer: ConsumerChannel,
        tag: int,
        envelope: Envelope,
        body: bytes,
        error: str | None,
        before: int = 0,
        queued: object = None,
    ) -> None:
        super().__init__(envelope, error)
        self._queued = queued
        self._subscription = subscription
        self._consumer = consumer
        self._tag = tag
        self._body = body
        self._deadline = 0.0
        #: Deliveries of the message before this one (hand-backs not counted).
        self._before = before
        self.redeliveries = before

    def queued_at(self) -> float | None:
        """When it was put in its queue (:data:`QUEUED_HEADER`, the publisher's clock)."""
        queued = self._queued
        return queued / 1000 if type(queued) is int and queued > 0 else None

    def _settled(self) -> None:
        subscription = self._subscription
        subscription.handed.pop(self._tag, None)
        if subscription.suspended and not subscription.wake.is_set():
            subscription.wake.set()  # room, perhaps, to consume again

    def _queue_ack(self) -> None:
        """Acked at the broker, written behind with other acks."""
        subscription = self._subscription
        subscription.transport._ack(self._consumer, self._tag, subscription.name, self.envelope.id)

    async def _nack(self, delay: float | None) -> None:
        """Deliver it again (attempt + 1) to the group, after ``delay`` seconds.

        :raises TransportError: when it could not be republished (it then goes back
            to the queue as it is).
        """
        await self._subscription.transport._publisher.retry(self, delay)

    async def _reject(self, entry: DeadLetter) -> None:
        """Store it as a dead letter (the body byte for byte), then ack it."""
        await self._subscription.transport._publisher.bury(self, entry)


class Subscription:
    """One ``subscribe``: its consumer channel, what it received, and what it handed out."""

    def __init__(self, transport: RabbitHost, pattern: str, group: str, prefetch: int):
        self.transport = transport
        self.pattern = pattern
        self.group = group
        self.prefetch = prefetch
        self.queue = transport.queue_name(pattern, group)
        #: The stage name of (pattern, group).
        self.name = f"{pattern}@{group}"
        self.consumer: ConsumerChannel | None = None
        #: Received, not handed out yet (unsettled at the broker).
        self.ready: deque[RabbitDelivery] = deque()
        #: Handed out and not settled, by delivery tag, oldest first.
        self.handed: dict[int, RabbitDelivery] = {}
        self.wake = anyio.Event()
        #: Cancelled at the broker after a timeout; consumes again at the next iteration.
        self.suspended = False
        self.closed = False
        #: A channel whose consumer the broker cancelled, to be closed.
        self.stale: AbstractChannel | None = None
        #: Whether deliveries handed out stay with this consumer however long they are
        #: held (the transport's ``keep_alive`` when it subscribed): no ack_timeout.
        self.keep_alive = transport.keep_alive
        #: While leaving: the channel being released, and what reached it meanwhile.
        self.releasing: ConsumerChannel | None = None
        self.late: list[RabbitDelivery] = []

    def unsettled(self) -> int:
        return len(self.ready) + len(self.handed)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> Delivery:
        """The next delivery; waits (and only then yields) when none is at hand."""
        while True:
            if self.closed:
                raise StopAsyncIteration
            consumer = self.consumer
            if consumer is not None and self.ready:
                # Handed out without a yield each (the prefetch bounds how many are at
                # hand; whoever takes them yields per envelope, as the bus's consumers do).
                delivery = self.ready.popleft()
                if not delivery.settleable:
                    continue
                delivery._deadline = time.monotonic() + self.transport.ack_timeout
                self.handed[delivery._tag] = delivery
                return delivery
            if consumer is None or self.suspended:
                await self._consume()
                continue
            wake = self.wake = anyio.Event()
            await wake.wait()

    async def set_prefetch(self, prefetch: int) -> None:
        """Hold at most ``prefetch`` unsettled deliveries (see ``SubscriptionControl``).

        The broker keeps a consumer's prefetch for the consumer's life, counting only
        its own deliveries: a new size is a new consumer on the channel. The current one
        is cancelled, what it received beyond the new size and did not hand out goes
        back (as copies that carry their count, as at a release), and consuming begins
        again at the next iteration once fewer than ``prefetch`` are held, with the
        room left as its prefetch.
        """
        prefetch = min(checked_prefetch(prefetch), PREFETCH_MAX)
        if prefetch == self.prefetch:
            return
        self.prefetch = prefetch
        consumer = self.consumer
        if consumer is None or self.suspended or not consumer.consuming:
            return  # its next consumer takes the new size
        transport = self.transport
        self.suspended = True
        with transport.cleanup_scope(RELEASE_TIMEOUT):
            try:
                consumer.consuming = False
                await consumer.channel.basic_cancel(consumer.tag)
            except asyncio.CancelledError:
                if not spurious_cancel():
                    raise
            except Exception as error:  # the channel is going: losing it settles all
                logger.debug("RabbitMQ: cancelling a consumer to resize it failed: %s", error)
            await anyio.lowlevel.checkpoint()  # deliveries sent before the cancel land
            excess = min(self.unsettled() - prefetch, len(self.ready))
            if excess > 0 and consumer is self.consumer:
                given = [self.ready.pop() for _ in range(excess)]
                for delivery in given:
                    delivery.take_back(RELEASED)
                kept = await transport._publisher.hand_back(consumer, self.queue, given)
                # What could not be copied goes back as it is (counted).
                await consumer.give_back([delivery._tag for delivery in kept])
        if not self.wake.is_set():
            self.wake.set()

    async def flush(self) -> None:
        """Write (and have the broker answer after) the acks queued for this
        subscription's channel (see ``SubscriptionControl``)."""
        consumer = self.consumer
        if consumer is not None:
            with self.transport.cleanup_scope(RELEASE_TIMEOUT):
                await self.transport._acks.flush([consumer])

    async def _consume(self) -> None:
        """Open a consumer channel if there is none, and (re)start consuming on it once
        fewer than ``prefetch`` deliveries are held, with the room left as its prefetch
        (the broker counts a consumer's own deliveries only)."""
        transport = self.transport
        backoff = Backoff(BACKOFF_MIN, transport.max_backoff, jitter=True)
        while True:
            if self.closed:
                return
            try:
                await self._close_stale()
                consumer = self.consumer
                if consumer is None:
                    link = await transport._links.wait(None)
                    await transport._topology.declare_queue(link, self.pattern, self.group)
                    channel = await link.consumer.channel(publisher_confirms=False)
                    consumer = self.consumer = ConsumerChannel(channel, self.prefetch)
                    channel.closing.add_done_callback(partial(self._channel_closed, consumer))
                    cancelled = getattr(channel, "on_consumer_cancel_callbacks", None)
                    if cancelled is not None:
                        cancelled.add(partial(self._cancelled_by_broker, consumer))
                while self.unsettled() >= self.prefetch and consumer is self.consumer:
                    wake = self.wake = anyio.Event()
                    await wake.wait()  # (a settle, or the channel lost)
                if consumer is not self.consumer or self.closed:
                    continue
                room = self.prefetch - self.unsettled()
                if room != consumer.prefetch or not consumer.tag:
                    consumer.resize(room)
                    await consumer.channel.basic_qos(prefetch_count=room)
                consumer.tag = f"asyncbus.{transport._client_id}.{secrets.token_hex(4)}"
                await consumer.channel.basic_consume(
                    self.queue, partial(self._on_message, consumer), consumer_tag=consumer.tag
                )
                consumer.consuming = True
                self.suspended = False
                return
            except asyncio.CancelledError:
                if not spurious_cancel():
                    raise
                problem: BaseException = TransportError("the connection closed")
            except TransportError:
                raise
            except transport._links.not_found as error:
                # The queue was deleted under us: declare it again.
                transport._topology.forget(self.queue)
                problem = error
            except transport._links.fatal as error:
                raise transport._links.failed(f"consuming {self.queue!r}", error) from error
            except Exception as error:
                problem = error
            if transport._links.closing:
                raise TransportError("RabbitTransport is closed")
            pause = backoff.next()
            logger.warning(
                "RabbitMQ: consuming %s failed, retrying in %.2f s: %s", self.queue, pause, problem
            )
            await anyio.sleep(pause)

    async def _close_stale(self) -> None:
        stale, self.stale = self.stale, None
        if stale is not None and not stale.is_closed:
            with anyio.CancelScope(shield=True), anyio.move_on_after(RELEASE_TIMEOUT):
                try:
                    await stale.close()
                except Exception as error:
                    logger.debug("RabbitMQ: closing a stale channel failed: %s", error)

    async def _on_message(self, consumer: ConsumerChannel, message: DeliveredMessage) -> None:
        if consumer is not self.consumer or self.closed:
            if consumer is self.releasing:  # sent before the cancel: handed back too
                # (Unreadable ones are left: the channel's close returns them.)
                with contextlib.suppress(Exception):
                    self.late.append(self.receive(consumer, message))
            return  # a late delivery on a channel being closed: the broker requeues it
        # Whatever arrived is handed over (an unreadable message carries ``error``): a
        # message that raised here would stay unacked on the channel, invisible to
        # ``backlog``, until the connection closed.
        try:
            delivery = self.receive(consumer, message)
        except Exception as error:  # a message shaped like nothing expected
            delivery = self._stand_in(
                consumer, message, f"unreadable message: {type(error).__name__}: {error}", 0
            )
        self.ready.append(delivery)
        if not self.wake.is_set():
            self.wake.set()

    def receive(self, consumer: ConsumerChannel, message: DeliveredMessage) -> RabbitDelivery:
        """The delivery of a received message; an unreadable one carries ``error``."""
        transport = self.transport
        properties = message.header.properties
        headers = properties.headers if isinstance(properties.headers, dict) else {}
        # The quorum queue's count of returns; the broker sets it (the first delivery
        # has none). A copy handed back unhandled carries the count of its original.
        count = headers.get(_DELIVERY_COUNT) or 0
        if type(count) is not int or count < 0:
            count = 0
        before = carried_deliveries(headers.get(HEADER_DELIVERIES)) + count
        body = bytes(message.body or b"")
        tag = message.delivery_tag or 0
        error: str | None
        try:
            meta = headers.get(META_HEADER)
            if isinstance(meta, str):
                meta = meta.encode()
            if meta is None:  # a plain message: another client's
                envelope, error = plain_message(
                    properties, headers, body, 1 + count, self._topic_of(message), transport.codec
                )
            elif not isinstance(meta, bytes):
                raise DecodeError(f"the message's {META_HEADER} header is not text")
            else:
                envelope, error = envelope_from_wire(meta, body, transport.codec)
                if count:
                    envelope = envelope.evolve(attempt=envelope.attempt + count)
        except (DecodeError, UnicodeEncodeError) as problem:
            return self._stand_in(consumer, message, str(problem), count)
        if error is None:
            error = over_max_deliveries(before + 1, transport.max_deliveries)
        return RabbitDelivery(
            self, consumer, tag, envelope, body, error, before, headers.get(QUEUED_HEADER)
        )

    def _topic_of(self, message: DeliveredMessage) -> str:
        """The topic a message was published on: its routing key when it came through
        the bus's exchange, else the subscription's pattern."""
        topic = message.routing_key if message.exchange == self.transport.prefix else None
        return topic if isinstance(topic, str) and topic else self.pattern

    def _stand_in(
        self, consumer: ConsumerChannel, message: DeliveredMessage, error: str, count: int
    ) -> RabbitDelivery:
        """A delivery for a message with nothing to rebuild: it carries the raw body and
        ``error``, so it is dead-lettered instead of blocking the queue."""
        properties = getattr(message.header, "properties", None)
        body = bytes(message.body) if isinstance(message.body, bytes | bytearray) else b""
        envelope = Envelope(
            id=message_id_of(properties),
            topic=self._topic_of(message),
            payload=RawBody(body),
            attempt=1 + count,
        )
        return RabbitDelivery(self, consumer, message.delivery_tag or 0, envelope, body, error)

    async def expire(self, now: float) -> None:
        """Give back what is overdue and what is not handed out; cancel until next asked."""
        consumer = self.consumer
        overdue: list[RabbitDelivery] = []
        for delivery in self.handed.values():
            if delivery._deadline > now:
                break
            overdue.append(delivery)
        for delivery in overdue:
            delivery.take_back(EXPIRED)
            del self.handed[delivery._tag]
        logger.warning(
            "RabbitMQ: %d deliveries of %s@%s not settled within ack_timeout=%s s; "
            "giving them (and what the consumer has not taken yet) back to the queue: %s",
            len(overdue),
            self.pattern,
            self.group,
            self.transport.ack_timeout,
            ", ".join(delivery.envelope.id for delivery in overdue[:5]),
        )
        if consumer is None or consumer.channel.is_closed:
            return
        with anyio.move_on_after(RELEASE_TIMEOUT):
            try:
                if consumer.consuming:
                    consumer.consuming = False
                    await consumer.channel.basic_cancel(consumer.tag)
            except asyncio.CancelledError:
                if not spurious_cancel():
                    raise
            except Exception as error:
                logger.debug("RabbitMQ: cancelling a stuck consumer failed: %s", error)
            await anyio.lowlevel.checkpoint()  # deliveries sent before the cancel land
            waiting = [d for d in self.ready if d.settleable]
            if consumer is self.consumer:
                self.ready.clear()
                self.suspended = True
            for delivery in waiting:
                delivery.take_back(RETURNED)
            await consumer.give_back([delivery._tag for delivery in overdue + waiting])
        if not self.wake.is_set():
            self.wake.set()

    def _channel_closed(self, consumer: ConsumerChannel, future: asyncio.Future[Any]) -> None:
        retrieve(future)
        if consumer is self.consumer:
            if not (self.closed or self.transport._links.closing):
                logger.warning(
                    "RabbitMQ: the channel consuming %s closed; consuming again", self.queue
                )
            self.lose(LOST)

    async def _cancelled_by_broker(self, consumer: ConsumerChannel, frame: Any) -> None:
        # The queue was deleted (or the broker cancelled us otherwise): declare it and
        # consume again on a new channel.
        if consumer is self.consumer and getattr(frame, "consumer_tag", None) == consumer.tag:
            logger.warning("RabbitMQ: the broker cancelled the consumer of %s", self.queue)
            self.stale = consumer.channel
            self.lose(LOST)
            self.transport._topology.forget(self.queue)

    def lose(self, state: str) -> None:
        """Forget the current channel and every delivery received on it."""
        self.consumer = None
        self.suspended = False
        for delivery in self.ready:
            delivery.take_back(state)
        for delivery in self.handed.values():
            delivery.take_back(state)
        self.ready.clear()
        self.handed.clear()
        if not self.wake.is_set():
            self.wake.set()

    async def sync(self) -> None:
        """A round trip on the consumer channel: deliveries sent before it have arrived,
        and the broker has the acks written before it (a channel's frames go in order)."""
        consumer = self.consumer
        if consumer is None or consumer.channel.is_closed:
            return
        try:
            await consumer.channel.basic_qos(prefetch_count=consumer.prefetch)
            await anyio.lowlevel.checkpoint()
        except asyncio.CancelledError:
            if not spurious_cancel():
                raise
        except Exception:  # the channel is going: nothing in flight to wait for
            pass

    async def release(self) -> None:
        """Give back everything unsettled at once (shielded): cancel, hand back, write
        acks, close.

        What this subscription holds goes back to the queue as copies that carry the
        count of deliveries so far (the original is acked), so a hand-back is no
        delivery toward ``max_deliveries``; what cannot be copied (unreadable, or the
        broker does not confirm the copy) goes back as it is when the channel closes.
        """
        self.closed = True
        transport = self.transport
        transport._subscriptions.discard(self)
        consumer = self.consumer
        held = [d for d in (*self.handed.values(), *self.ready) if d.settleable]
        self.releasing = consumer
        self.lose(RELEASED)
        await self._close_stale()
        if consumer is None or consumer.channel.is_closed:
            return
        channel = consumer.channel
        with transport.cleanup_scope(RELEASE_TIMEOUT) as scope:
            try:
                if consumer.consuming:
                    consumer.consuming = False
                    await channel.basic_cancel(consumer.tag)
                await anyio.lowlevel.checkpoint()  # deliveries sent before the cancel land
                late, self.late = self.late, []
                for delivery in late:
                    delivery.take_back(RELEASED)
                await transport._publisher.hand_back(consumer, self.queue, held + late)
                # Acks before the close: what was acked must not come back.
                await transport._acks.flush([consumer])
                await channel.close()
            except Exception as error:
                logger.warning(
                    "RabbitMQ: releasing the deliveries of %s failed (the broker returns "
                    "them when the connection closes): %s",
                    self.queue,
                    error,
                )
        if scope.cancelled_caught:
            logger.warning("RabbitMQ: releasing the deliveries of %s timed out", self.queue)
