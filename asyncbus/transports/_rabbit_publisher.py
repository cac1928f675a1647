"""Publishing over RabbitMQ with publisher confirms: one message, or many pipelined (all
sent, then their confirms awaited together), retried across a reconnection; dead-letter
documents; and the republishes that settle a delivery (a retry, a dead letter, a copy
handed back)."""

from __future__ import annotations

import asyncio
import datetime
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Protocol

import anyio

from .._dead_letters import DeadLetter
from .._envelope import Envelope
from .._exceptions import EncodeError, TransportError
from ._codec import Codec, dead_letter_to_wire, dump_meta, encode_payload, envelope_meta
from ._kit.cloudevents import HEADER
from ._kit.options import refuse_oversized
from ._kit.outgoing import foreign_message, wire_of
from ._kit.redeliveries import HEADER_DELIVERIES
from ._kit.verbatim import Verbatim
from ._rabbit_channel import ConsumerChannel, spurious_cancel
from ._rabbit_consumer import META_HEADER, QUEUED_HEADER, RELEASE_TIMEOUT, RabbitDelivery
from ._rabbit_link import Connections, Link

if TYPE_CHECKING:
    from pamqp.commands import Basic
    from pamqp.common import FieldTable

#: The prefix of a CloudEvent's attributes among an AMQP message's headers (the AMQP
#: binding's application properties; ``cloudEvents:`` is read too).
AMQP_PREFIX = "cloudEvents_"

__all__ = ["Publisher", "PublisherHost"]

logger = logging.getLogger("asyncbus.transport.rabbit")

#: Largest ``asyncbus-meta`` header: the whole content header must fit in one frame.
_META_LIMIT = 64 * 1024


def _failure(outcome: object) -> BaseException | None:
    """What a gathered publish raised (``None``: confirmed); a publish the client
    cancelled (its channel closed) is a lost connection, retried."""
    if isinstance(outcome, asyncio.CancelledError):
        return ConnectionError("the channel closed before the confirm")
    return outcome if isinstance(outcome, BaseException) else None


class PublisherHost(Protocol):
    """What publishing uses of the transport (:class:`~.rabbit.RabbitTransport`)."""

    codec: Codec
    max_message_size: int
    publish_timeout: float
    dead_letter_exchange: str

    def cleanup_scope(self, timeout: float = ...) -> AbstractContextManager[anyio.CancelScope]:
        """A shielded clean-up scope, bounded by the close deadline."""
        ...

    def _properties_type(self) -> type[Basic.Properties]:
        """AMQP's message properties (``TransportError`` when not connected)."""
        ...

    def _ack(
        self, consumer: ConsumerChannel, tag: int, stage: str, envelope_id: str | None
    ) -> None:
        """Queue the ack of ``tag`` for the writer."""
        ...


class Publisher:
    """Confirmed publishes on the transport's link.

    :param retry_queue: declares (if need be) and names the retry queue of a work
        queue for a delay, on a link.
    """

    def __init__(
        self,
        host: PublisherHost,
        links: Connections,
        retry_queue: Callable[[Link, str, float], Awaitable[str]],
    ) -> None:
        self._host = host
        self._links = links
        self._retry_queue = retry_queue

    def outgoing(
        self,
        envelope: Envelope,
        *,
        attempt: int | None = None,
        body: bytes | None = None,
        deliveries: int | None = None,
        queued_at: float | None = None,
    ) -> tuple[bytes, Basic.Properties]:
        """Body and properties of the message carrying ``envelope``; ``deliveries``:
        the deliveries a copy handed back unhandled carries (:data:`HEADER_DELIVERIES`);
        ``queued_at``: when its original was queued (a copy keeps it; else now)."""
        host = self._host
        if attempt is None and body is None and deliveries is None:  # a publish
            wire = wire_of(envelope)
            if wire is not None:
                return self._foreign(envelope, wire)
        meta = envelope_meta(envelope)
        if attempt is not None:
            meta["attempt"] = attempt
        text = dump_meta(meta).decode()
        if len(text) > _META_LIMIT // 4 and (size := len(text.encode())) > _META_LIMIT:
            raise EncodeError(
                f"envelope {envelope.id}: its headers and fields take {size} bytes, more "
                f"than the {_META_LIMIT} an AMQP header frame can carry here"
            )
        if body is None:  # a publish (a retry re-sends a body that was accepted once)
            body = encode_payload(host.codec, envelope.payload)
            refuse_oversized(envelope, len(body) + len(text.encode()), host.max_message_size)
        headers: FieldTable = {
            META_HEADER: text,
            QUEUED_HEADER: int((time.time() if queued_at is None else queued_at) * 1000),
        }
        if deliveries:
            headers[HEADER_DELIVERIES] = deliveries
        properties = host._properties_type()(
            content_type=host.codec.content_type,
            delivery_mode=2,
            message_id=envelope.id,
            headers=headers,
        )
        return body, properties

    def _foreign(self, envelope: Envelope, wire: str) -> tuple[bytes, Basic.Properties]:
        """Body and properties of ``envelope`` for clients that know nothing of asyncbus
        (see :mod:`._kit.outgoing`): the AMQP properties carry its id, timestamp,
        correlation id and reply address; a CloudEvent's attributes are the headers
        ``cloudEvents_{attribute}``, as the AMQP binding names its application
        properties."""
        host = self._host
        body, headers, content_type = foreign_message(envelope, wire, host.codec)
        refuse_oversized(envelope, len(body), host.max_message_size)
        if wire == "cloudevents":
            headers = {AMQP_PREFIX + name[len(HEADER) :]: value for name, value in headers.items()}
        correlation = envelope.correlation_id
        return body, host._properties_type()(
            content_type=content_type,
            delivery_mode=2,
            message_id=envelope.id,
            timestamp=datetime.datetime.fromtimestamp(envelope.timestamp, datetime.UTC),
            correlation_id=correlation if correlation != envelope.id else None,
            reply_to=envelope.reply_to,
            headers=dict(headers),
        )

    async def publish_one(
        self,
        exchange: str,
        routing_key: str,
        body: bytes,
        properties: Basic.Properties,
        mandatory: bool = False,
    ) -> bool:
        """Publish one message and wait for the broker's confirm (retried on a lost link).

        :param mandatory: have the broker return it when no queue takes it.
        :returns: whether a queue took it (always, unless ``mandatory``).
        :raises TransportError: when no confirm came within ``publish_timeout``.
        """
        publish_timeout = self._host.publish_timeout
        deadline = anyio.current_time() + publish_timeout
        links = self._links
        link = links.link
        if link is not None and not link.lost.is_set() and not link.channel.is_closed:
            # The common case, without the retry loop's set-up; a failure goes to it.
            channel = link.channel
            try:
                # The client's own timeout (it sets one anyway: cheaper than a cancel
                # scope per publish). ``wait=False``: the channel's lock is not held
                # until the frames reach the socket (the confirm implies they did), so
                # concurrent publishes are written back to back.
                await channel.basic_publish(
                    body,
                    exchange=exchange,
                    routing_key=routing_key,
                    properties=properties,
                    mandatory=mandatory,
                    timeout=publish_timeout,
                    wait=False,  # type: ignore[call-arg]  # (aiormq's abc omits it)
                )
                return True
            except links.returned:
                return False
            except asyncio.CancelledError:
                if not spurious_cancel():
                    raise
            except TimeoutError as error:
                raise links.unconfirmed(exchange or routing_key) from error
            except TransportError:
                raise
            except links.fatal as error:
                raise links.failed(f"publishing to {exchange or routing_key!r}", error) from error
            except Exception as error:
                logger.debug("RabbitMQ: publishing failed, retrying: %s", error)
                if isinstance(error, links.nacked):
                    await link.renew_channel(channel)
        return await links.call(
            f"publishing to {exchange or routing_key!r}",
            lambda link: links.send(link, exchange, routing_key, body, properties, mandatory),
            deadline,
        )

    async def publish_all(
        self,
        exchange: str,
        routing_key: str,
        messages: list[tuple[bytes, Basic.Properties]],
        mandatory: bool = False,
    ) -> list[bool]:
        """Publish ``messages`` pipelined; whether a queue took each (see :meth:`publish_one`).

        Every message is sent, in order, before any confirm is awaited, then the confirms
        are awaited together: one round trip for the lot, not one per message. What a
        lost connection left unconfirmed is sent again (in order) on the next one, until
        ``publish_timeout``; what the broker returned (``mandatory``) is not.

        :raises TransportError: when a message was not confirmed within
            ``publish_timeout`` or the broker refused one (once every publish ended).
        """
        if len(messages) == 1:
            body, properties = messages[0]
            return [await self.publish_one(exchange, routing_key, body, properties, mandatory)]
        links = self._links
        taken = [True] * len(messages)
        #: Positions not confirmed yet, in order.
        left = list(range(len(messages)))

        async def send(link: Link) -> None:
            nonlocal left
            outcomes = await self._send_pipelined(
                link, exchange, routing_key, [messages[index] for index in left], mandatory
            )
            unconfirmed: list[int] = []
            problem: BaseException | None = None
            for index, outcome in zip(left, outcomes, strict=True):
                if outcome is None:
                    continue
                if isinstance(outcome, links.returned):
                    taken[index] = False  # mandatory, and no queue is bound for it
                    continue
                unconfirmed.append(index)
                if problem is None or (
                    isinstance(outcome, links.fatal) and not isinstance(problem, links.fatal)
                ):
                    problem = outcome
            left = unconfirmed
            if problem is not None:
                # A refusal ends the publish; anything else is retried by ``call``.
                raise problem

        await links.call(f"publishing to {exchange or routing_key!r}", send)
        return taken

    async def _send_pipelined(
        self,
        link: Link,
        exchange: str,
        routing_key: str,
        messages: list[tuple[bytes, Basic.Properties]],
        mandatory: bool,
    ) -> list[BaseException | None]:
        """Send every message on the link's channel, then await their confirms together.

        :returns: per message, ``None`` once confirmed, else what its publish raised.
        """
        channel = link.channel
        if channel.is_closed:
            channel = await link.reopen_channel()
        publishes = [
            # One task each, started in order: the channel's lock (first come, first
            # served) writes them in that order. ``wait=False``: a publish does not hold
            # the lock until its frames reach the socket (its confirm implies they did).
            asyncio.ensure_future(
                channel.basic_publish(
                    body,
                    exchange=exchange,
                    routing_key=routing_key,
                    properties=properties,
                    mandatory=mandatory,
                    wait=False,  # type: ignore[call-arg]  # (aiormq's abc omits it)
                )
            )
            for body, properties in messages
        ]
        # Cancelled, the gathering cancels them all and ends once they all ended.
        outcomes = await asyncio.gather(*publishes, return_exceptions=True)
        return [_failure(outcome) for outcome in outcomes]

    # -- dead letters ---------------------------------------------------------

    async def publish_dead(self, id: str, document: bytes) -> None:
        """Publish a dead-letter document (of envelope ``id``) to the dead-letter exchange."""
        properties = self._host._properties_type()(
            content_type="application/json", delivery_mode=2, message_id=id
        )
        await self.publish_one(self._host.dead_letter_exchange, "", document, properties)

    async def publish_dead_letters(self, entries: Sequence[DeadLetter]) -> None:
        """Publish ``entries`` to the dead-letter queue, pipelined (confirms gathered)."""
        host = self._host
        properties = host._properties_type()
        documents = [
            (
                dead_letter_to_wire(entry, host.codec),
                properties(
                    content_type="application/json", delivery_mode=2, message_id=entry.envelope.id
                ),
            )
            for entry in entries
        ]
        await self.publish_all(host.dead_letter_exchange, "", documents)

    # -- settling -------------------------------------------------------------

    async def retry(self, delivery: RabbitDelivery, delay: float | None) -> None:
        """Republish ``delivery`` (attempt + 1), delayed or not, then ack it."""
        subscription = delivery._subscription
        queue = subscription.queue
        try:
            body, properties = self.outgoing(
                delivery.envelope, attempt=delivery.envelope.attempt + 1, body=delivery._body
            )
            if delay is not None and delay > 0:

                async def send(link: Link) -> None:
                    name = await self._retry_queue(link, queue, delay)
                    await self._links.send(link, "", name, body, properties)

                await self._links.call(f"delaying a retry of {queue!r}", send)
            else:
                await self.publish_one("", queue, body, properties)
        except BaseException:  # deliberate: not re-sent, so the broker keeps it; re-raise
            with self._host.cleanup_scope(RELEASE_TIMEOUT):
                await delivery._consumer.give_back([delivery._tag])
            raise
        self._host._ack(delivery._consumer, delivery._tag, subscription.name, None)

    async def hand_back(
        self, consumer: ConsumerChannel, queue: str, deliveries: list[RabbitDelivery]
    ) -> list[RabbitDelivery]:
        """Put each delivery back in ``queue`` as a copy carrying its deliveries so far,
        and ack the original once the copy is confirmed (see ``Subscription.release``).

        The quorum queue counts a message returned by a leaving consumer as a
        delivery (``x-delivery-count``); a copy starts from zero and carries the count
        of real deliveries instead, so ``max_deliveries`` counts only those.

        :returns: the deliveries not copied (unreadable, or the copy was not
            confirmed): they go back as they are (counted), when the channel closes or
            the caller gives them back.
        """
        kept = [delivery for delivery in deliveries if delivery.error is not None]

        async def copy(delivery: RabbitDelivery) -> None:
            try:
                body, properties = self.outgoing(
                    delivery.envelope,
                    body=delivery._body,
                    deliveries=delivery._before,
                    queued_at=delivery.queued_at(),
                )
                await self.publish_one("", queue, body, properties)
            except Exception as error:  # deliberate: it goes back as it is instead
                logger.warning(
                    "RabbitMQ: handing back %s as a copy failed (it goes back counted): %s",
                    delivery.envelope.id,
                    error or type(error).__name__,
                )
                kept.append(delivery)
                return
            self._host._ack(consumer, delivery._tag, delivery._subscription.name, None)

        async with anyio.create_task_group() as task_group:
            for delivery in deliveries:
                if delivery.error is None:
                    task_group.start_soon(copy, delivery)
        return kept

    async def bury(self, delivery: RabbitDelivery, entry: DeadLetter) -> None:
        """Publish ``entry`` (with the delivery's raw body) to the dead letters, then ack."""
        try:
            document = dead_letter_to_wire(entry, Verbatim(delivery._body))
            await self.publish_dead(entry.envelope.id, document)
        except BaseException:  # deliberate: not buried, so the broker keeps it; re-raise
            with self._host.cleanup_scope(RELEASE_TIMEOUT):
                await delivery._consumer.give_back([delivery._tag])
            raise
        self._host._ack(delivery._consumer, delivery._tag, delivery._subscription.name, None)
