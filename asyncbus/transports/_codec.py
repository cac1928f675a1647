"""Codecs and the wire format of envelopes and dead letters (never pickle)."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from .._dead_letters import DeadLetter, DeadLetterKey, DeadLetterReason
from .._envelope import Envelope
from .._exceptions import DecodeError, EncodeError, SerializationError
from ._wire_fields import envelope_from_fields, optional_text, real, text

__all__ = [
    "Codec",
    "JsonCodec",
    "MsgspecCodec",
    "RawBody",
    "dead_letter_from_wire",
    "dead_letter_keys_from_wire",
    "dead_letter_keys_to_wire",
    "dead_letter_to_wire",
    "default_codec",
    "dump_meta",
    "envelope_from_wire",
    "envelope_meta",
    "envelope_to_wire",
]


class RawBody(bytes):
    """A body as it came off the wire, which the codec could not decode.

    An envelope carries it as its payload when a delivery did not decode (the bus
    dead-letters it ``rejected``); a dead letter keeps it, and a replay sends it again
    byte for byte (:func:`encode_payload` never gives it to a codec). It is ``bytes``
    in every other way.
    """

    __slots__ = ()


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
        except (TypeError, ValueError, RecursionError) as error:
            raise _encode_error(value, error) from error

    def decode(self, data: bytes) -> Any:
        """Parse UTF-8 JSON."""
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
            raise _decode_error(error) from error


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
        except (TypeError, ValueError, RecursionError, self._msgspec.EncodeError) as error:
            raise _encode_error(value, error) from error

    def decode(self, data: bytes) -> Any:
        """Parse JSON."""
        try:
            return self._decoder.decode(data)
        except (self._msgspec.DecodeError, RecursionError) as error:
            raise _decode_error(error) from error


def _encode_error(value: Any, error: BaseException) -> EncodeError:
    if isinstance(error, RecursionError):
        return EncodeError(f"cannot encode {type(value).__name__} as JSON: nested too deep")
    return EncodeError(f"cannot encode {type(value).__name__} as JSON: {error}")


def _decode_error(error: BaseException) -> DecodeError:
    if isinstance(error, RecursionError):
        return DecodeError("body is not valid JSON: nested too deep")
    return DecodeError(f"body is not valid JSON: {error}")


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


def envelope_to_wire(envelope: Envelope, codec: Codec) -> tuple[bytes, bytes]:
    """``(meta, body)``: the envelope's fields as JSON, and its payload by ``codec``.

    :raises EncodeError: when the payload (or a header) cannot be encoded, nested too
        deep included.
    """
    return dump_meta(envelope_meta(envelope)), encode_payload(codec, envelope.payload)


def dump_meta(meta: Mapping[str, Any]) -> bytes:
    """``meta`` (from :func:`envelope_meta`) as compact JSON bytes.

    :raises EncodeError: when a field cannot be written as JSON.
    """
    try:
        return _meta_json.dumps(meta)
    except Exception as error:  # msgspec's and json's errors alike: the fields are bad
        raise EncodeError(f"cannot encode the envelope's fields as JSON: {error}") from error


def encode_payload(codec: Codec, payload: Any) -> bytes:
    """``codec.encode(payload)``; a payload nested too deep is an :class:`EncodeError`
    whatever the codec (Python's recursion limit is no excuse to end a publisher).

    A :class:`RawBody` is the body it was: its bytes, not the codec's rendering of them.
    """
    if type(payload) is RawBody:
        return bytes(payload)
    try:
        return codec.encode(payload)
    except RecursionError as error:
        raise EncodeError(f"cannot encode {type(payload).__name__}: nested too deep") from error


def envelope_from_wire(
    meta: bytes, body: bytes, codec: Codec, *, attempt: int | None = None
) -> tuple[Envelope, str | None]:
    """Rebuild an envelope; ``(envelope, error)``.

    When the body does not decode, the envelope carries the raw body as its payload
    (a :class:`RawBody`) and ``error`` says why (the bus dead-letters it ``rejected``).
    Whatever the bytes, this returns or raises :class:`DecodeError`, nothing else.

    :param attempt: the broker's delivery count, overriding the stored attempt.
    :raises DecodeError: when ``meta`` itself is unreadable, or a field is missing or
        wrong (nothing to rebuild).
    """
    try:
        fields = _meta_json.loads(meta)
    except Exception as error:  # json's ValueError, msgspec's DecodeError, RecursionError
        raise DecodeError(f"envelope metadata is unreadable: {_reason(error)}") from error
    undecodable: str | None = None
    try:
        payload = codec.decode(body)
    except Exception as error:  # a codec's DecodeError, or whatever a custom one raises
        payload, undecodable = RawBody(body), _reason(error)
    return envelope_from_fields(fields, payload, attempt), undecodable


def _reason(error: BaseException) -> str:
    if isinstance(error, SerializationError):
        return str(error)
    if isinstance(error, RecursionError):
        return "nested too deep"
    return f"{type(error).__name__}: {error}"


def dead_letter_to_wire(entry: DeadLetter, codec: Codec) -> bytes:
    """A dead letter as one JSON document (the body base64-encoded). A bytes payload is
    kept as it is (``raw``); a :class:`RawBody` is marked ``verbatim`` too, so a replay
    sends it as it came."""
    payload = entry.envelope.payload
    raw = isinstance(payload, bytes | bytearray)  # kept byte for byte
    if raw:
        body = bytes(payload)
    else:
        try:
            body = encode_payload(codec, payload)
        except EncodeError:
            body = _shown(payload)
    return json.dumps(
        {
            "meta": envelope_meta(entry.envelope),
            "body": base64.b64encode(body).decode(),
            "raw": raw,
            "verbatim": type(payload) is RawBody,
            "reason": entry.reason.value,
            "error": entry.error,
            "traceback": entry.traceback,
            "stage": entry.stage,
            "attempts": entry.attempts,
            "dead_at": entry.dead_at,
        },
        separators=(",", ":"),
    ).encode()


def _shown(payload: Any) -> bytes:
    """What a dead letter keeps of a payload its codec cannot encode: its repr."""
    try:
        return repr(payload).encode("utf-8", "backslashreplace")
    except RecursionError:
        return f"<{type(payload).__name__} nested too deep to show>".encode()


def dead_letter_from_wire(data: bytes, codec: Codec) -> DeadLetter:
    """Rebuild a dead letter stored by :func:`dead_letter_to_wire`.

    :raises DecodeError: when ``data`` is not such a document (whatever the bytes).
    """
    try:
        fields = json.loads(data)
        if type(fields) is not dict:
            raise ValueError("not a JSON object")
        body = base64.b64decode(fields["body"], validate=True)
        reason = DeadLetterReason(fields["reason"])
        attempts = fields.get("attempts", 0)
        if type(attempts) is not int:
            raise ValueError(f"attempts is {type(attempts).__name__}")
    except (KeyError, TypeError, ValueError, RecursionError) as error:
        raise DecodeError(f"dead letter is unreadable: {_reason(error)}") from error
    if fields.get("raw"):
        payload: Any = RawBody(body) if fields.get("verbatim") is True else body
    else:
        try:
            payload = codec.decode(body)
        except Exception:  # kept as it was stored
            payload = body
    return DeadLetter(
        envelope=envelope_from_fields(fields.get("meta"), payload, None),
        reason=reason,
        error=optional_text(fields.get("error"), "error"),
        stage=optional_text(fields.get("stage"), "stage"),
        attempts=attempts,
        dead_at=real(fields.get("dead_at", 0.0), "dead_at"),
        traceback=optional_text(fields.get("traceback"), "traceback"),
    )


def dead_letter_keys_to_wire(keys: Sequence[DeadLetterKey]) -> bytes:
    """Keys of dead letters (a removal every process is told of) as a JSON list."""
    return json.dumps([list(key) for key in keys], separators=(",", ":")).encode()


def dead_letter_keys_from_wire(data: bytes | str) -> tuple[DeadLetterKey, ...]:
    """Keys written by :func:`dead_letter_keys_to_wire`.

    :raises DecodeError: when ``data`` is not such a list (whatever the bytes).
    """
    try:
        found = json.loads(data)
    except (ValueError, TypeError, RecursionError) as error:
        raise DecodeError(f"dead-letter keys are unreadable: {_reason(error)}") from error
    if type(found) is not list:
        raise DecodeError("dead-letter keys are not a list")
    keys: list[DeadLetterKey] = []
    for item in found:
        if type(item) is not list or len(item) != 4:
            raise DecodeError("a dead-letter key is not [id, timestamp, stage, reason]")
        keys.append(
            (
                text(item[0], "id"),
                real(item[1], "timestamp"),
                optional_text(item[2], "stage"),
                text(item[3], "reason"),
            )
        )
    return tuple(keys)
