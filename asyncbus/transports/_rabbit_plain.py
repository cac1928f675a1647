"""Plain messages over RabbitMQ: what a client that knows nothing of asyncbus publishes
(no ``asyncbus-meta`` header) read as an envelope from the AMQP properties (see
:mod:`._kit.plain`)."""

from __future__ import annotations

import datetime
import secrets
from typing import Any

from .._envelope import Envelope
from ._codec import Codec
from ._kit.plain import foreign_envelope

__all__ = ["message_id_of", "plain_message"]


def plain_message(
    properties: Any, headers: dict[str, Any], body: bytes, attempt: int, topic: str, codec: Codec
) -> tuple[Envelope, str | None]:
    """The envelope of a message another client published without the bus's meta (a
    CloudEvent, in binary or structured mode, or a plain message), and why its body did
    not decode (``None``: it did).

    A plain message's body is the payload; ``message_id`` (else one made up: not the same on a
    redelivery), ``timestamp``, ``correlation_id`` and ``reply_to`` are the envelope's,
    and so are its text headers but the broker's (``x-*``).
    """
    stamp = properties.timestamp
    if isinstance(stamp, datetime.datetime):
        when: float | None = stamp.timestamp()
    else:
        when = float(stamp) if type(stamp) is int else None
    correlation = properties.correlation_id
    reply_to = properties.reply_to
    content_type = properties.content_type
    return foreign_envelope(
        body,
        codec,
        headers=headers,
        content_type=content_type if isinstance(content_type, str) else None,
        skip=("x-", "asyncbus-"),
        envelope_id=message_id_of(properties),
        topic=topic,
        attempt=attempt,
        timestamp=when,
        correlation_id=correlation if isinstance(correlation, str) else None,
        reply_to=reply_to if isinstance(reply_to, str) else None,
    )


def message_id_of(properties: Any) -> str:
    """A message's ``message_id``, else one made up (``rabbit:{random}``: not the same on
    a redelivery, which has nothing else to go by)."""
    message_id = getattr(properties, "message_id", None)
    return (
        message_id
        if isinstance(message_id, str) and message_id
        else f"rabbit:{secrets.token_hex(8)}"
    )
