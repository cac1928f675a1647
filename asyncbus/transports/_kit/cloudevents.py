"""CloudEvents 1.0 on the wire: reading an event another client published, in binary
mode (its attributes as headers, its data as the body) or structured mode (the body a
JSON event, content type ``application/cloudevents+json``), and writing an envelope as
one.

The mapping, both ways: the event's ``id`` is the envelope's id (so ``deduplicate()``
goes by it), ``time`` its timestamp, and every other attribute (``source``, ``type``,
``subject``, ``datacontenttype``, ``dataschema`` and extensions) a header named
``ce-{attribute}``. Written, ``source`` defaults to ``asyncbus:{sender}`` (or
``asyncbus``) and ``type`` to the envelope's topic. Headers carry the attributes with
the prefix of the binding: ``ce-`` on NATS, Redis and RabbitMQ (the RabbitMQ binding),
``cloudEvents_`` or ``cloudEvents:`` read too (the AMQP binding's application
properties).
"""

from __future__ import annotations

import base64
import datetime
import json
import math
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ..._envelope import Envelope, make_envelope
from ..._exceptions import DecodeError
from .._codec import Codec, decode_body

__all__ = [
    "BATCH",
    "HEADER",
    "STRUCTURED",
    "event_attributes",
    "event_envelope",
    "structured_event",
    "to_attributes",
    "to_structured",
]

#: The prefix of an attribute header, as written (and, case aside, read).
HEADER = "ce-"
#: The content type of an event in structured mode (JSON format).
STRUCTURED = "application/cloudevents+json"
#: The content type of the batch mode, which only the HTTP binding defines.
BATCH = "application/cloudevents-batch+json"
#: The header prefixes an attribute may be read under.
_PREFIXES = ("ce-", "cloudevents_", "cloudevents:")
#: The attributes an event must have.
_REQUIRED = ("id", "source", "type", "specversion")
#: The attributes that are not headers of the envelope (its own fields).
_OWN = frozenset({"id", "time", "specversion", "data", "data_base64"})


def event_attributes(headers: Mapping[Any, Any]) -> dict[str, str] | None:
    """The attributes of a binary-mode event among ``headers`` (names without their
    prefix, in lower case), or ``None`` when they hold no ``specversion``."""
    found: dict[str, str] = {}
    for name, value in headers.items():
        if isinstance(name, bytes):
            name = name.decode("utf-8", "replace")
        if not isinstance(name, str):
            continue
        lowered = name.lower()
        for prefix in _PREFIXES:
            if lowered.startswith(prefix):
                if isinstance(value, bytes):
                    value = value.decode("utf-8", "replace")
                attribute = lowered[len(prefix) :]
                if isinstance(value, datetime.datetime):  # an AMQP timestamp
                    value = _rfc3339(value.timestamp())
                elif attribute == "time" and type(value) is int:  # milliseconds (AMQP)
                    value = _rfc3339(value / 1000)
                found[attribute] = value if isinstance(value, str) else str(value)
                break
    return found if "specversion" in found else None


def structured_event(body: bytes) -> dict[str, Any]:
    """The event a structured-mode body holds.

    :raises DecodeError: when it is not a JSON object.
    """
    try:
        event = json.loads(body)
    except (ValueError, RecursionError) as error:
        raise DecodeError(f"the CloudEvent is not JSON: {error}") from None
    if type(event) is not dict:
        raise DecodeError("the CloudEvent is not a JSON object")
    return event


def event_envelope(
    attributes: Mapping[str, Any],
    codec: Codec,
    *,
    topic: str,
    attempt: int,
    body: bytes | None = None,
) -> tuple[Envelope, str | None]:
    """The envelope of an event, and why its data did not decode (``None``: it did).

    :param attributes: the event's attributes; in structured mode with its ``data`` (or
        ``data_base64``) in them.
    :param body: in binary mode, the event's data (decoded by ``codec``).
    :raises DecodeError: when a required attribute is missing or not text, the spec
        version is not 1.0, or ``time`` is not an RFC 3339 time.
    """
    for required in _REQUIRED:
        value = attributes.get(required)
        if not isinstance(value, str) or not value:
            raise DecodeError(f"the CloudEvent has no {required!r}")
    if not attributes["specversion"].startswith("1."):
        raise DecodeError(f"CloudEvents {attributes['specversion']!r}: only 1.0 is read")
    error: str | None = None
    if body is not None:
        payload, error = decode_body(body, codec)
    elif "data_base64" in attributes:
        try:
            payload = base64.b64decode(str(attributes["data_base64"]), validate=True)
        except ValueError as problem:
            raise DecodeError(f"the CloudEvent's data_base64 is not base64: {problem}") from None
    else:
        payload = attributes.get("data")
    headers = {
        HEADER + name: value
        for name, value in attributes.items()
        if name not in _OWN and isinstance(value, str)
    }
    event_id = attributes["id"]
    return make_envelope(
        event_id,
        topic,
        payload,
        MappingProxyType(headers),
        _timestamp(attributes.get("time")),
        None,
        max(1, attempt),
        (),
        event_id,
        None,
        None,
        None,
    ), error


def to_attributes(envelope: Envelope, content_type: str) -> dict[str, str]:
    """The attributes of ``envelope`` as a binary-mode event (names without prefix)."""
    headers = envelope.headers
    attributes = {
        "specversion": "1.0",
        "id": envelope.id,
        "source": headers.get(HEADER + "source") or f"asyncbus:{envelope.sender or 'asyncbus'}",
        "type": headers.get(HEADER + "type") or envelope.topic,
        "time": _rfc3339(envelope.timestamp),
        "datacontenttype": headers.get(HEADER + "datacontenttype") or content_type,
    }
    for name, value in headers.items():
        key = name.lower()
        if key.startswith(HEADER) and key[len(HEADER) :] not in attributes:
            attributes[key[len(HEADER) :]] = value
    return attributes


def to_structured(envelope: Envelope, body: bytes, content_type: str) -> bytes:
    """``envelope`` as a structured-mode event (JSON): its data the payload when
    ``body`` is JSON, else ``data_base64``."""
    event: dict[str, Any] = dict(to_attributes(envelope, content_type))
    try:
        event["data"] = json.loads(body)
    except ValueError:
        event["data_base64"] = base64.b64encode(body).decode()
    return json.dumps(event, separators=(",", ":"), ensure_ascii=False).encode()


def _timestamp(value: Any) -> float:
    """An RFC 3339 time as epoch seconds (none: now)."""
    if value is None:
        return datetime.datetime.now(datetime.UTC).timestamp()
    if not isinstance(value, str):
        raise DecodeError(f"the CloudEvent's time is not text: {type(value).__name__}")
    try:
        when = datetime.datetime.fromisoformat(value)
    except ValueError:
        shown = value[:40]
        raise DecodeError(f"the CloudEvent's time is not an RFC 3339 time: {shown!r}") from None
    if when.tzinfo is None:
        raise DecodeError(f"the CloudEvent's time has no offset: {value[:40]!r}")
    stamp = when.timestamp()
    if not math.isfinite(stamp):
        raise DecodeError(f"the CloudEvent's time is out of range: {value[:40]!r}")
    return stamp


def _rfc3339(timestamp: float) -> str:
    """Epoch seconds as an RFC 3339 time in UTC, to the microsecond."""
    when = datetime.datetime.fromtimestamp(timestamp, datetime.UTC)
    return when.isoformat().replace("+00:00", "Z")
