"""A delivery of the NATS transport: made from a JetStream message, settled on it.

:func:`make_delivery` turns a message a pull consumer received into a
:class:`NatsDelivery` (a message that is not an asyncbus one is handed over with
``error`` set, to be rejected; a replay for another group is none of its business).
The delivery's ack is written behind by the transport's ack writer; its nak and term
return once the server has them. Its stream message is named by :func:`message_key`
(acks name the stream message, not the delivery), and JetStream's count of deliveries
is read from the reply subject (:func:`delivery_count`).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol

from .._dead_letters import DeadLetter
from .._envelope import EMPTY_HEADERS, Envelope, make_envelope
from .._exceptions import DecodeError
from ._codec import Codec, RawBody, envelope_from_wire
from ._kit import AckWriter
from ._kit.plain import foreign_envelope
from ._nats_client import broker_call, confirm
from ._nats_messages import HEADER_META, HEADER_REPLAY_GROUP
from .base import BaseDelivery

if TYPE_CHECKING:
    from nats.aio.client import Client
    from nats.aio.msg import Msg

    from ._nats_dead_letters import NatsDeadLetters

__all__ = [
    "MessageKey",
    "NatsDelivery",
    "Puller",
    "SettleHost",
    "delivery_count",
    "make_delivery",
    "message_key",
]

#: One stream message across its deliveries: its stream sequence and ``Nats-Msg-Id``
#: (a stream made again numbers from 1 again; the id tells its messages apart).
MessageKey = tuple[int, "str | None"]


class SettleHost(Protocol):
    """What a delivery uses of its transport: the codec and prefix it was read with,
    the ack writer, and the dead-letter stream."""

    prefix: str
    codec: Codec
    request_timeout: float
    _acks: AckWriter[str, str]
    _shared_dead: NatsDeadLetters


class Puller(Protocol):
    """What a delivery uses of the subscription it came from (a pull consumer)."""

    nc: Client
    name: str
    stage: str

    @property
    def transport(self) -> SettleHost:
        """The subscription's transport."""
        ...

    def forget(self, delivery: NatsDelivery) -> None:
        """``delivery`` was settled: there is room for another."""
        ...

    def settled_for_good(self, key: MessageKey) -> None:
        """The message ``key`` was acked or terminated."""
        ...


def message_key(msg: Msg) -> MessageKey:
    """Which stream message ``msg`` delivers (see :data:`MessageKey`), from its reply
    subject (``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>...``)."""
    tokens = msg.reply.split(".")
    if len(tokens) == 9 and tokens[5].isdigit():
        sequence = int(tokens[5])
    else:
        sequence = msg.metadata.sequence.stream
    return sequence, (msg.headers or {}).get("Nats-Msg-Id")


def delivery_count(msg: Msg) -> int:
    """How many times JetStream delivered ``msg`` (``num_delivered``), from its reply
    subject, without building nats-py's metadata objects.

    ``$JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<consumer seq>.<time>.<pending>``
    (other forms, with a domain and an account hash, are left to nats-py).
    """
    tokens = msg.reply.split(".")
    if len(tokens) == 9 and tokens[4].isdigit():
        return int(tokens[4]) or 1
    return msg.metadata.num_delivered or 1


class NatsDelivery(BaseDelivery):
    """A delivery from :class:`~.nats.NatsTransport`; its acks are written behind.

    Acks are written together by the transport's writer (within a moment, before
    the subscription or the transport closes): a process that dies first gets the
    message redelivered after ``ack_timeout``, as at-least-once delivery allows.
    """

    __slots__ = ("_consumer", "_key", "_msg")

    acks_behind = True

    def __init__(self, consumer: Puller, msg: Msg, envelope: Envelope, error: str | None) -> None:
        super().__init__(envelope, error)
        self._consumer = consumer
        self._msg = msg
        #: Which stream message it is (read once: settling names it twice).
        self._key = message_key(msg)

    def queued_at(self) -> float | None:
        """When the stream stored the message (the server's clock), from its reply
        subject (``...<time in ns>.<pending>``)."""
        tokens = self._msg.reply.split(".")
        if len(tokens) == 9 and tokens[7].isdigit():
            return int(tokens[7]) / 1e9
        try:
            return self._msg.metadata.timestamp.timestamp()
        except Exception:  # not JetStream's form: cannot tell
            return None

    def _settled(self) -> None:
        self._consumer.forget(self)

    def _queue_ack(self) -> None:
        """Done: ``+ACK`` it, written with the other acks queued meanwhile."""
        consumer = self._consumer
        consumer.settled_for_good(self._key)
        consumer.transport._acks.queue(
            consumer.name, consumer.stage, self._msg.reply, self.envelope.id
        )

    async def _nack(self, delay: float | None) -> None:
        """Deliver it again (attempt + 1) to the group, natively after ``delay`` seconds.

        Returns once the server has the ``-NAK`` (see :func:`~._nats_client.confirm`).
        """
        consumer = self._consumer
        reconnects = consumer.nc.stats["reconnects"]
        with broker_call(f"cannot nack {self.envelope.id}"):
            await self._msg.nak(delay=delay if delay is not None and delay > 0 else None)
        await confirm(
            consumer.nc,
            reconnects,
            f"nacking {self.envelope.id}",
            consumer.transport.request_timeout,
        )

    async def _reject(self, entry: DeadLetter) -> None:
        """Store a dead letter in the dead-letter stream, then terminate the message.

        When storing fails the message is left unsettled: the broker delivers it
        again after ``ack_timeout`` rather than lose it. Returns once the server has
        the ``+TERM``.
        """
        consumer = self._consumer
        await consumer.transport._shared_dead.add(entry)
        reconnects = consumer.nc.stats["reconnects"]
        with broker_call(f"cannot settle {self.envelope.id}"):
            await self._msg.term()
        consumer.settled_for_good(self._key)
        await confirm(
            consumer.nc,
            reconnects,
            f"settling {self.envelope.id}",
            consumer.transport.request_timeout,
        )


def make_delivery(consumer: Puller, msg: Msg) -> NatsDelivery | None:
    """``msg`` as a delivery of ``consumer`` (``None``: a replay meant for another
    group); a message that is not an asyncbus one is handed over with ``error`` set,
    to be rejected."""
    headers = msg.headers or {}
    target = headers.get(HEADER_REPLAY_GROUP)
    if target is not None and target != consumer.name:
        return None
    attempt = delivery_count(msg)
    error: str | None
    transport = consumer.transport
    try:
        meta = headers.get(HEADER_META)
        if meta is None:  # a plain message: another client's
            envelope, error = _plain(msg, headers, attempt, transport.prefix, transport.codec)
        elif not isinstance(meta, str):
            raise DecodeError(f"the message's {HEADER_META} header is not text")
        else:
            envelope, error = envelope_from_wire(
                meta.encode(), msg.data, transport.codec, attempt=attempt
            )
    except (DecodeError, UnicodeEncodeError) as failure:
        # Not an asyncbus message (or a mangled one): hand it over to be rejected.
        msg_id = _message_id(msg, headers)
        envelope = make_envelope(
            msg_id,
            msg.subject[len(transport.prefix) + 1 :] or msg.subject,
            RawBody(msg.data),
            EMPTY_HEADERS,
            time.time(),
            None,
            attempt,
            (),
            msg_id,
            None,
            None,
            None,
        )
        error = str(failure)
    return NatsDelivery(consumer, msg, envelope, error)


def _plain(
    msg: Msg, headers: dict[str, str], attempt: int, prefix: str, codec: Codec
) -> tuple[Envelope, str | None]:
    """The envelope of a message another client published without the bus's meta: a
    CloudEvent, or a plain message whose data is the payload; its id ``Nats-Msg-Id``
    (else ``nats-{stream sequence}``), its timestamp the stream's, its headers those that
    are not the server's (``Nats-*``)."""
    stamp = getattr(msg.metadata, "timestamp", None)
    return foreign_envelope(
        msg.data,
        codec,
        headers=headers,
        content_type=headers.get("Content-Type") or headers.get("content-type"),
        skip=("nats-", "asyncbus-", "content-type"),
        envelope_id=_message_id(msg, headers),
        topic=msg.subject[len(prefix) + 1 :] or msg.subject,
        attempt=attempt,
        timestamp=stamp.timestamp() if stamp is not None else None,
    )


def _message_id(msg: Msg, headers: dict[str, str]) -> str:
    """The id of a message without the bus's meta: ``Nats-Msg-Id``, else
    ``nats-{stream sequence}`` (the same on every delivery of it)."""
    return headers.get("Nats-Msg-Id") or f"nats-{msg.metadata.sequence.stream}"
