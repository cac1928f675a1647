"""Codecs and the wire format of envelopes and dead letters (never pickle)."""

from __future__ import annotations

import base64
import json
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Protocol

from .._dead_letters import DeadLetter, DeadLetterReason
from .._envelope import EMPTY_HEADERS, Envelope, make_envelope
from .._exceptions import DecodeError, EncodeError

__all__ = [
    "Codec",
    "JsonCodec",
    "MsgspecCodec",
    "dead_letter_from_wire",
    "dead_letter_to_wire",
    "default_codec",
    "envelope_from_wire",
    "envelope_meta",
    "envelope_to_wire",
]


class Codec(Protocol):
    """Turns payloads into bytes and back."""

    #: MIME type of what :meth:`encode` produces.
    content_type: str

    def encode(self, value: Any) -> bytes:
        """Serialise ``value``; :class:`EncodeError` when it cannot be."""

    def decode(self, data: bytes) -> Any:
        """Deserialise ``data``; :class:`DecodeError` when it is not valid."""


class JsonCodec:
    """JSON with the standard library: dicts, lists, strings, numbers, booleans, None."""

    content_type = "application/json"

    def encode(self, value: Any) -> bytes:
        """Serialise ``value`` as compact UTF-8 JSON."""
        try:
            return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()
        except (TypeError, ValueError) as error:
            raise EncodeError(f"cannot encode {type(value).__name__} as JSON: {error}") from error

    def decode(self, data: bytes) -> Any:
        """Parse UTF-8 JSON."""
        try:
            return json.loads(data)
        except (UnicodeDecodeError, ValueError) as error:
            raise DecodeError(f"body is not valid JSON: {error}") from error


class MsgspecCodec:
    """JSON with msgspec: faster, and also encodes dataclasses, Structs, datetimes, UUIDs."""

    content_type = "application/json"

    def __init__(self) -> None:
        import msgspec

        self._msgspec = msgspec
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder()

    def encode(self, value: Any) -> bytes:
        """Serialise ``value`` as JSON."""
        try:
            return self._encoder.encode(value)
        except (TypeError, ValueError, self._msgspec.EncodeError) as error:
            raise EncodeError(f"cannot encode {type(value).__name__} as JSON: {error}") from error

    def decode(self, data: bytes) -> Any:
        """Parse JSON."""
        try:
            return self._decoder.decode(data)
        except self._msgspec.DecodeError as error:
            raise DecodeError(f"body is not valid JSON: {error}") from error


def default_codec() -> Codec:
    """msgspec's JSON when msgspec is installed, else the standard library's."""
    try:
        return MsgspecCodec()
    except ImportError:
        return JsonCodec()


def envelope_meta(envelope: Envelope) -> dict[str, Any]:
    """Everything about an envelope but its payload, as JSON-ready values."""
    return {
        "id": envelope.id,
        "topic": envelope.topic,
        "headers": dict(envelope.headers),
        "timestamp": envelope.timestamp,
        "ttl": envelope.ttl,
        "attempt": envelope.attempt,
        "slip": list(envelope.slip),
        "correlation_id": envelope.correlation_id,
        "causation_id": envelope.causation_id,
        "reply_to": envelope.reply_to,
        "sender": envelope.sender,
    }


def envelope_to_wire(envelope: Envelope, codec: Codec) -> tuple[bytes, bytes]:
    """``(meta, body)``: the envelope's fields as JSON, and its payload by ``codec``."""
    meta = json.dumps(envelope_meta(envelope), separators=(",", ":")).encode()
    return meta, codec.encode(envelope.payload)


def _envelope_from_meta(meta: Mapping[str, Any], payload: Any, attempt: int | None) -> Envelope:
    headers = meta.get("headers") or {}
    return make_envelope(
        str(meta["id"]),
        str(meta["topic"]),
        payload,
        MappingProxyType({str(k): str(v) for k, v in headers.items()})
        if headers
        else EMPTY_HEADERS,
        float(meta["timestamp"]),
        None if meta.get("ttl") is None else float(meta["ttl"]),
        int(attempt if attempt is not None else meta.get("attempt", 1)),
        tuple(meta.get("slip") or ()),
        str(meta.get("correlation_id") or meta["id"]),
        meta.get("causation_id"),
        meta.get("reply_to"),
        meta.get("sender"),
    )


def envelope_from_wire(
    meta: bytes, body: bytes, codec: Codec, *, attempt: int | None = None
) -> tuple[Envelope, str | None]:
    """Rebuild an envelope; ``(envelope, error)``.

    When the body does not decode, the envelope carries the raw body as its payload
    and ``error`` says why (the bus dead-letters it ``rejected``).

    :param attempt: the broker's delivery count, overriding the stored attempt.
    :raises DecodeError: when ``meta`` itself is unreadable (nothing to rebuild).
    """
    try:
        fields = json.loads(meta)
        if not isinstance(fields, dict) or "id" not in fields or "topic" not in fields:
            raise ValueError("meta is not an envelope")
    except (UnicodeDecodeError, ValueError) as error:
        raise DecodeError(f"envelope metadata is unreadable: {error}") from error
    try:
        payload = codec.decode(body)
    except DecodeError as error:
        return _envelope_from_meta(fields, body, attempt), str(error)
    return _envelope_from_meta(fields, payload, attempt), None


def dead_letter_to_wire(entry: DeadLetter, codec: Codec) -> bytes:
    """A dead letter as one JSON document (the body base64-encoded)."""
    payload = entry.envelope.payload
    raw = isinstance(payload, bytes | bytearray)  # an undecodable body, kept byte for byte
    if raw:
        body = bytes(payload)
    else:
        try:
            body = codec.encode(payload)
        except EncodeError:
            body = repr(payload).encode()
    return json.dumps(
        {
            "meta": envelope_meta(entry.envelope),
            "body": base64.b64encode(body).decode(),
            "raw": raw,
            "reason": entry.reason.value,
            "error": entry.error,
            "stage": entry.stage,
            "attempts": entry.attempts,
            "dead_at": entry.dead_at,
        },
        separators=(",", ":"),
    ).encode()


def dead_letter_from_wire(data: bytes, codec: Codec) -> DeadLetter:
    """Rebuild a dead letter stored by :func:`dead_letter_to_wire`.

    :raises DecodeError: when ``data`` is not such a document.
    """
    try:
        fields = json.loads(data)
        body = base64.b64decode(fields["body"])
        reason = DeadLetterReason(fields["reason"])
    except (KeyError, TypeError, ValueError) as error:
        raise DecodeError(f"dead letter is unreadable: {error}") from error
    if fields.get("raw"):
        payload: Any = body
    else:
        try:
            payload = codec.decode(body)
        except DecodeError:
            payload = body
    return DeadLetter(
        envelope=_envelope_from_meta(fields["meta"], payload, None),
        reason=reason,
        error=fields.get("error"),
        stage=fields.get("stage"),
        attempts=int(fields.get("attempts", 0)),
        dead_at=float(fields.get("dead_at", 0.0)),
    )
