"""Plain messages: what a producer that knows nothing of asyncbus writes into a broker.

A message without the bus's meta (no ``meta`` field in a Redis entry, no
``asyncbus-meta`` header on NATS or RabbitMQ) is not refused: its body is the payload,
decoded by the transport's codec, and the envelope's other fields come from what the
broker itself records (an id, a timestamp, headers, a correlation id, a reply address),
or are made up where it records nothing. From there it is an envelope like any other:
deduplicated by its id, retried (a retry writes it back in the bus's own format, meta and
all), dead-lettered and counted alike. A body the codec cannot decode is handed over
with the error set, its bytes kept (a :class:`~.._codec.RawBody`), and the bus
dead-letters it ``rejected``, as it does an asyncbus message whose body is bad.

Meta that is there but unreadable is still refused: that message claims to be the
bus's and is not. A message that is a CloudEvent (its attributes as headers, or a
structured event) is read as one (:mod:`.cloudevents`) before it is taken for plain.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import Any

from ..._envelope import EMPTY_HEADERS, Envelope, make_envelope
from ..._exceptions import DecodeError
from .._codec import Codec, decode_body
from .._wire_fields import encodable
from .cloudevents import BATCH, STRUCTURED, event_attributes, event_envelope, structured_event

__all__ = ["foreign_envelope", "plain_envelope", "plain_headers"]


def plain_envelope(
    body: bytes,
    codec: Codec,
    *,
    envelope_id: str,
    topic: str,
    attempt: int,
    timestamp: float | None = None,
    headers: Mapping[str, str] = EMPTY_HEADERS,
    correlation_id: str | None = None,
    reply_to: str | None = None,
    payload: Any = None,
    decoded: bool = False,
) -> tuple[Envelope, str | None]:
    """The envelope of a plain message, and why its body did not decode (``None``: it did).

    :param body: the message's body, the payload as the codec encodes it.
    :param envelope_id: the broker's id of the message (stable across its deliveries
        where the broker has one, so ``deduplicate()`` works).
    :param timestamp: when the broker took it (epoch seconds); ``None`` or not a finite
        number: now.
    :param payload: with ``decoded``, the payload already made (a Redis entry's fields),
        used instead of the body.
    """
    error: str | None = None
    if not decoded:
        payload, error = decode_body(body, codec)
    when = timestamp if timestamp is not None and math.isfinite(timestamp) else time.time()
    envelope = make_envelope(
        envelope_id,
        topic,
        payload,
        headers,
        when,
        None,
        max(1, attempt),
        (),
        correlation_id or envelope_id,
        None,
        reply_to or None,
        None,
    )
    return envelope, error


def plain_headers(items: Iterable[tuple[Any, Any]], *, skip: tuple[str, ...]) -> Mapping[str, str]:
    """A plain message's headers as an envelope carries them: the pairs whose name and
    value are both text, except names beginning with one of ``skip`` (the broker's own,
    compared without case)."""
    kept = {
        name: value
        for name, value in items
        if type(name) is str
        and type(value) is str
        and not name.lower().startswith(skip)
        and encodable(name)
        and encodable(value)
    }
    return MappingProxyType(kept) if kept else EMPTY_HEADERS


def foreign_envelope(
    body: bytes,
    codec: Codec,
    *,
    headers: Mapping[Any, Any],
    content_type: str | None,
    skip: tuple[str, ...],
    envelope_id: str,
    topic: str,
    attempt: int,
    timestamp: float | None = None,
    correlation_id: str | None = None,
    reply_to: str | None = None,
) -> tuple[Envelope, str | None]:
    """The envelope of a message without the bus's meta: a CloudEvent in binary mode
    (its attributes among ``headers``) or structured mode (``content_type``), else a
    plain message (:func:`plain_envelope`, with ``headers`` but those beginning with one
    of ``skip`` as its headers).

    :raises DecodeError: for a CloudEvent that is not one (a required attribute
        missing, a bad time, a structured body that is not a JSON object).
    """
    attributes = event_attributes(headers)
    if attributes is not None:
        if content_type and "datacontenttype" not in attributes:
            attributes["datacontenttype"] = content_type  # (binary mode keeps it there)
        return event_envelope(attributes, codec, topic=topic, attempt=attempt, body=body)
    kind = content_type.lower() if content_type is not None else ""
    if kind.startswith(STRUCTURED):
        event = structured_event(body)
        return event_envelope(event, codec, topic=topic, attempt=attempt)
    if kind.startswith(BATCH):
        raise DecodeError(
            "a batch of CloudEvents: batch mode is the HTTP binding's; over a broker one "
            "message is one event (publish each in binary or structured mode)"
        )
    return plain_envelope(
        body,
        codec,
        envelope_id=envelope_id,
        topic=topic,
        attempt=attempt,
        timestamp=timestamp,
        headers=plain_headers(headers.items(), skip=skip),
        correlation_id=correlation_id,
        reply_to=reply_to,
    )
