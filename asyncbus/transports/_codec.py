"""Codecs and the wire format of envelopes and dead letters (never pickle)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping
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
    "dump_meta",
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
    """Everything about an envelope but its payload, as JSON-ready values.

    Fields at their defaults (no headers, no ttl, no slip, the correlation id equal to
    the id, no causation, reply address or sender) are left out: every envelope pays
    for the meta on the wire and in the broker, and most use none of them.
    """
    meta: dict[str, Any] = {
        "id": envelope.id,
        "topic": envelope.topic,
        "timestamp": envelope.timestamp,
        "attempt": envelope.attempt,
    }
    if envelope.headers:
        meta["headers"] = dict(envelope.headers)
    if envelope.ttl is not None:
        meta["ttl"] = envelope.ttl
    if envelope.slip:
        meta["slip"] = list(envelope.slip)
    if envelope.correlation_id != envelope.id:
        meta["correlation_id"] = envelope.correlation_id
    if envelope.causation_id is not None:
        meta["causation_id"] = envelope.causation_id
    if envelope.reply_to is not None:
        meta["reply_to"] = envelope.reply_to
    if envelope.sender is not None:
        meta["sender"] = envelope.sender
    return meta


class _MetaJson:
    """JSON for envelope meta: msgspec's when it is installed (several times faster), else
    the standard library's. Chosen on first use, so importing asyncbus imports neither."""

    def __init__(self) -> None:
        self.dumps: Callable[[Any], bytes] = self._choose_dumps
        self.loads: Callable[[bytes], Any] = self._choose_loads

    def _choose(self) -> None:
        try:
            import msgspec
        except ImportError:
            self.dumps = _stdlib_dumps
            self.loads = json.loads
        else:
            self.dumps = msgspec.json.Encoder().encode
            self.loads = msgspec.json.Decoder().decode

    def _choose_dumps(self, value: Any) -> bytes:
        self._choose()
        return self.dumps(value)

    def _choose_loads(self, data: bytes) -> Any:
        self._choose()
        return self.loads(data)


def _stdlib_dumps(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()


_meta_json = _MetaJson()


def dump_meta(meta: Mapping[str, Any]) -> bytes:
    """``meta`` (from :func:`envelope_meta`) as compact JSON bytes."""
    return _meta_json.dumps(meta)


def envelope_to_wire(envelope: Envelope, codec: Codec) -> tuple[bytes, bytes]:
    """``(meta, body)``: the envelope's fields as JSON, and its payload by ``codec``."""
    return _meta_json.dumps(envelope_meta(envelope)), codec.encode(envelope.payload)


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
        fields = _meta_json.loads(meta)
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
            "traceback": entry.traceback,
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
        traceback=fields.get("traceback"),
    )
