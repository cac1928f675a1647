"""Reading an envelope's fields from the wire, where anyone may have written anything.

A broker's streams and queues take bytes from every client, not only from asyncbus:
the meta of a delivery may lack a field, hold the wrong type, a NaN, a number too big
for a float, a lone surrogate, or not be an object at all. :func:`envelope_from_fields`
checks every field it uses and raises :class:`DecodeError` for anything else, so a
consumer never fails on a ``KeyError`` or ``AttributeError`` half-way through a
delivery, and an envelope it returns can always be written back (dead-lettered).
"""

from __future__ import annotations

import json
import math
from types import MappingProxyType
from typing import Any

from .._envelope import EMPTY_HEADERS, Envelope, make_envelope
from .._exceptions import ConfigurationError, DecodeError
from .._routing import compile_pattern, validate_topic

__all__ = [
    "MAX_ATTEMPT",
    "encodable",
    "envelope_from_fields",
    "group_from_wire",
    "optional_text",
    "real",
    "text",
]

#: The largest ``attempt`` accepted on the wire (exact as a float, so any JSON keeps it).
MAX_ATTEMPT = 2**53


def text(value: Any, field: str) -> str:
    """``value`` if it is a string UTF-8 can encode (no lone surrogates), else DecodeError."""
    if type(value) is str and encodable(value):
        return value
    raise DecodeError(f"envelope field {field!r} is not a string: {_show(value)}")


def optional_text(value: Any, field: str) -> str | None:
    """``None``, or ``value`` as :func:`text`."""
    return None if value is None else text(value, field)


def real(value: Any, field: str) -> float:
    """``value`` as a finite float (an int or float, not a bool), else DecodeError."""
    if type(value) is float:
        if math.isfinite(value):
            return value
    elif type(value) is int:
        try:
            return float(value)
        except OverflowError:
            pass
    raise DecodeError(f"envelope field {field!r} is not a finite number: {_show(value)}")


def _topic(value: Any, field: str) -> str:
    """A topic a slip hop will be published to: it must be publishable."""
    topic = text(value, field)
    try:
        validate_topic(topic)
    except ConfigurationError as error:
        raise DecodeError(f"envelope field {field!r}: {error}") from None
    return topic


def _nonempty(value: Any, field: str) -> str:
    found = text(value, field)
    if not found:
        raise DecodeError(f"envelope field {field!r} is empty")
    return found


def encodable(value: str) -> bool:
    """Whether UTF-8 can encode ``value`` (no lone surrogates)."""
    if value.isascii():
        return True
    try:
        value.encode()
    except UnicodeEncodeError:
        return False
    return True


def _show(value: Any) -> str:
    """A short description of a bad value (its type, and the value when it is small)."""
    shown = repr(value) if isinstance(value, int | float | bool | type(None)) else ""
    if isinstance(value, str):
        shown = ascii(value[:40])
    return f"{type(value).__name__} {shown}".rstrip()[:80]


def envelope_from_fields(fields: Any, payload: Any, attempt: int | None) -> Envelope:
    """The envelope described by ``fields`` (its meta, decoded from JSON) with ``payload``.

    Fields left out take their defaults, as :func:`~._codec.envelope_meta` leaves them
    out; ``id``, ``topic`` and ``timestamp`` are required. The format's version ``v`` is
    not read: meta without it (written before it existed, or by another client) is
    read alike, and unknown fields are ignored.

    :param attempt: the broker's count, used instead of the stored ``attempt``.
    :raises DecodeError: when ``fields`` is not an object, or a field is missing or has
        the wrong type or value.
    """
    if type(fields) is not dict:
        raise DecodeError(f"envelope metadata is not a JSON object: {_show(fields)}")
    get = fields.get
    for required in ("id", "topic", "timestamp"):
        if required not in fields:
            raise DecodeError(f"envelope metadata has no {required!r}")
    envelope_id = _nonempty(get("id"), "id")
    stored = get("attempt", 1)
    if type(stored) is not int or not 0 <= stored <= MAX_ATTEMPT:
        raise DecodeError(f"envelope field 'attempt' is not a count: {_show(stored)}")
    if attempt is None:
        attempt = stored
    ttl = get("ttl")
    correlation_id = get("correlation_id")
    return make_envelope(
        envelope_id,
        # Informative only (routing is done): a stand-in for a message that could not
        # be read may carry its subscription's pattern here.
        _nonempty(get("topic"), "topic"),
        payload,
        _headers(get("headers")),
        real(get("timestamp"), "timestamp"),
        None if ttl is None else real(ttl, "ttl"),
        attempt,
        _slip(get("slip")),
        envelope_id
        if correlation_id is None or correlation_id == ""
        else text(correlation_id, "correlation_id"),
        optional_text(get("causation_id"), "causation_id"),
        optional_text(get("reply_to"), "reply_to"),
        optional_text(get("sender"), "sender"),
    )


def _headers(value: Any) -> Any:
    if not value:
        if value is None or type(value) is dict:
            return EMPTY_HEADERS
    elif type(value) is dict:
        return MappingProxyType(
            {text(name, "headers"): text(item, "headers") for name, item in value.items()}
        )
    raise DecodeError(f"envelope field 'headers' is not an object of strings: {_show(value)}")


def _slip(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if type(value) is not list:
        raise DecodeError(f"envelope field 'slip' is not a list of topics: {_show(value)}")
    return tuple(_topic(topic, "slip") for topic in value)


def group_from_wire(data: bytes | str) -> tuple[str, str]:
    """The ``(pattern, group)`` a group registry entry records: ``["pattern", "group"]``.

    Registries (Redis's bindings hash, NATS consumer descriptions, RabbitMQ's group
    register) are written by every client of the broker, so an entry may be anything:
    not JSON, JSON nested deeper than any parser recurses, the wrong shape, a pattern
    that is none.

    :raises DecodeError: for any entry that is not such a pair, whatever the bytes.
    """
    try:
        found = json.loads(data)
    except RecursionError:
        raise DecodeError("group entry is not readable: nested too deep") from None
    except (ValueError, TypeError) as error:  # UnicodeDecodeError is a ValueError
        raise DecodeError(f"group entry is not JSON: {error}") from None
    if type(found) is not list or len(found) != 2:
        raise DecodeError(f"group entry is not a [pattern, group] pair: {_show(found)}")
    pattern, group = text(found[0], "pattern"), _nonempty(found[1], "group")
    try:
        compile_pattern(pattern)
    except ConfigurationError as error:
        raise DecodeError(f"group entry: {error}") from None
    return pattern, group
