"""Codecs and the wire format of envelopes and dead letters (never pickle)."""

from __future__ import annotations

import base64
import dataclasses
import enum
import json
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from .._dead_letters import DeadLetter, DeadLetterKey, DeadLetterReason
from .._envelope import Envelope
from .._exceptions import DecodeError, EncodeError, SerializationError
from ._wire_fields import envelope_from_fields, optional_text, real, text

__all__ = [
    "WIRE_FORMAT_VERSION",
    "Codec",
    "JsonCodec",
    "MsgspecCodec",
    "RawBody",
    "dead_letter_from_wire",
    "dead_letter_keys_from_wire",
    "dead_letter_keys_to_wire",
    "dead_letter_to_wire",
    "decode_body",
    "default_codec",
    "dump_meta",
    "envelope_from_wire",
    "envelope_meta",
    "envelope_to_wire",
    "wire_data",
]


#: The version of the documented wire format (docs/guide.md, "On the wire"): where each
#: envelope field lives on each broker and how it is written. Every envelope's meta
#: carries it as ``v``; a reader takes meta without ``v`` as this version (what asyncbus
#: wrote before the marker) and reads the fields it knows whatever ``v`` says.
WIRE_FORMAT_VERSION = 1


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
    """JSON with the standard library; what it takes is :func:`wire_data`'s rule."""

    content_type = "application/json"

    def encode(self, value: Any) -> bytes:
        """Serialise ``value`` as compact UTF-8 JSON.

        :raises EncodeError: for a value outside the rule of :func:`wire_data`, naming
            where it is in the payload.
        """
        data = wire_data(value)
        try:
            return json.dumps(
                data, separators=(",", ":"), ensure_ascii=False, allow_nan=False
            ).encode()
        except (TypeError, ValueError, RecursionError) as error:
            raise _encode_error(value, error) from error

    def decode(self, data: bytes) -> Any:
        """Parse UTF-8 JSON."""
        try:
            return json.loads(data)
        except (ValueError, RecursionError) as error:  # UnicodeDecodeError is a ValueError
            raise _decode_error(error) from error


class MsgspecCodec:
    """JSON with msgspec: faster; what it takes is :func:`wire_data`'s rule, as for
    :class:`JsonCodec` (the same payloads, the same bytes but for floats in exponent
    form: ``1e16`` where the standard library writes ``1e+16``)."""

    content_type = "application/json"

    def __init__(self) -> None:
        import msgspec

        self._msgspec = msgspec
        self._encoder = msgspec.json.Encoder()
        self._decoder = msgspec.json.Decoder()

    def encode(self, value: Any) -> bytes:
        """Serialise ``value`` as JSON.

        :raises EncodeError: for a value outside the rule of :func:`wire_data`, naming
            where it is in the payload.
        """
        data = wire_data(value)
        try:
            return self._encoder.encode(data)
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


# -- the one rule of what a payload may be over a broker ------------------------------

#: What each type that JSON lacks should be sent as instead.
_TEXT = "send it as a string ({}) or as a field of that type in a msgspec Struct or pydantic model"
_ADVICE: dict[str, str] = {
    "datetime": _TEXT.format("`.isoformat()`"),
    "date": _TEXT.format("`.isoformat()`"),
    "time": _TEXT.format("`.isoformat()`"),
    "timedelta": "send it as a number of seconds (`.total_seconds()`)",
    "UUID": _TEXT.format("`str(...)`"),
    "Decimal": _TEXT.format("`str(...)`"),
    "set": "send a list (`sorted(...)` or `list(...)`)",
    "frozenset": "send a list (`sorted(...)` or `list(...)`)",
    "bytes": "send text, such as `base64.b64encode(...).decode()`",
    "bytearray": "send text, such as `base64.b64encode(...).decode()`",
    "memoryview": "send text, such as `base64.b64encode(...).decode()`",
}
_ANYTHING_ELSE = (
    "convert it to JSON data (dict with str keys, list, str, int, float, bool, None), "
    "or send a dataclass, msgspec Struct or pydantic model"
)


class _Refused(Exception):
    """A value the rule refuses; ``where`` grows as the walk unwinds (innermost first)."""

    def __init__(self, value: Any, advice: str, *, what: str | None = None) -> None:
        super().__init__(advice)
        self.value = value
        self.advice = advice
        #: How the value is named in the message (its type, by default).
        self.what = what or type(value).__name__
        self.where: list[str] = []
        #: Said once after the advice (a dataclass's fields without msgspec).
        self.note = ""


def wire_data(value: Any) -> Any:
    """``value`` as the JSON data the built-in codecs write: the one rule over a broker.

    A payload is JSON data: ``dict`` with ``str`` keys, ``list``, ``tuple`` (it arrives
    as a list), ``str``, ``int``, finite ``float``, ``bool`` and ``None``, at any
    depth; or a dataclass, msgspec ``Struct`` or pydantic model, which travels as the
    object of its fields (encoded by msgspec, or pydantic's JSON mode, so field types
    such as ``datetime`` come back when the handler is annotated with the model; a
    dataclass's fields without msgspec installed must be JSON data). Anything else
    (``datetime``, ``set``, ``UUID``, ``Decimal``, ``bytes``, NaN, a non-string key,
    an object) is refused: nothing converts it silently, so what the handler gets is
    what was published, whatever the codec and whether msgspec is installed.

    :raises EncodeError: naming the value's type, where it is (``payload["tags"][2]``)
        and what to send instead.
    """
    try:
        return _data(value)
    except _Refused as refused:
        where = "payload" + "".join(reversed(refused.where))
        raise EncodeError(
            f"cannot encode {refused.what} at {where} as JSON: {refused.advice}{refused.note}"
        ) from None
    except RecursionError as error:
        raise EncodeError(f"cannot encode {type(value).__name__}: nested too deep") from error


#: Types that are JSON as they are (checked by exact type: the hot path of every publish).
_PLAIN = frozenset({str, int, bool, type(None)})


def _data(value: Any) -> Any:
    """``value`` as JSON data (the same object when it already is), or :class:`_Refused`."""
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind is float:
        if value - value == 0.0:  # finite (NaN and infinities give NaN)
            return value
        raise _Refused(value, "JSON has no NaN or infinity: send None or a string")
    if kind is dict:
        return _mapping(value)
    if kind is list or kind is tuple:
        return _sequence(value)
    return _other(value)


def _mapping(value: dict[Any, Any]) -> dict[str, Any]:
    copy: dict[str, Any] | None = None
    plain = _PLAIN
    for key, item in value.items():
        if type(key) is not str and not isinstance(key, str):
            refused = _Refused(
                key,
                "JSON object keys are strings: convert the key with `str()`",
                what=f"{type(key).__name__} key",
            )
            refused.where.append(f"[{key!r}]")
            raise refused
        if type(item) in plain:
            continue
        try:
            data = _data(item)
        except _Refused as refused:
            refused.where.append(f"[{json.dumps(key, ensure_ascii=False)}]")
            raise
        if data is not item:
            if copy is None:
                copy = dict(value)
            copy[key] = data
    if copy is not None:
        return copy
    return value if type(value) is dict else dict(value)


def _sequence(value: list[Any] | tuple[Any, ...]) -> Any:
    copy: list[Any] | None = None
    plain = _PLAIN
    for index, item in enumerate(value):
        if type(item) in plain:
            continue
        try:
            data = _data(item)
        except _Refused as refused:
            refused.where.append(f"[{index}]")
            raise
        if data is not item:
            if copy is None:
                copy = list(value)
            copy[index] = data
    return copy if copy is not None else value


def _other(value: Any) -> Any:
    """Subclasses of the JSON types, models, and what the rule refuses."""
    if isinstance(value, str | int):  # bool, IntEnum, StrEnum...: JSON writes their value
        return value
    if isinstance(value, float):
        return _data(float(value))
    if isinstance(value, dict):
        return _mapping(value)
    if isinstance(value, list | tuple):
        return _sequence(value)
    model = _model_data(value)
    if model is not None:
        return model
    if isinstance(value, enum.Enum):
        raise _Refused(value, "send its `.value`")
    raise _Refused(value, _ADVICE.get(type(value).__name__, _ANYTHING_ELSE))


def _model_data(value: Any) -> Any:
    """A dataclass instance, msgspec Struct or pydantic model as JSON data; else None."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(value, pydantic.BaseModel):
        try:
            return _data(value.model_dump(mode="json"))
        except _Refused:
            raise
        except Exception as error:  # pydantic's serialisation error, a validator's
            raise _Refused(value, f"pydantic cannot dump it as JSON: {error}") from error
    msgspec = sys.modules.get("msgspec")
    struct = msgspec is not None and isinstance(value, msgspec.Struct)
    if not struct and not (dataclasses.is_dataclass(value) and not isinstance(value, type)):
        return None
    if not struct:
        try:
            import msgspec
        except ImportError:  # field by field, by the rule itself
            return _dataclass_fields(value)
    assert msgspec is not None
    try:
        # msgspec writes what it decodes back into the annotated model (datetime as
        # ISO 8601, a set as a list...).
        return _data(msgspec.to_builtins(value))
    except _Refused:
        raise
    except (TypeError, ValueError) as error:
        raise _Refused(value, f"{error}; {_ANYTHING_ELSE}") from error


def _dataclass_fields(value: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    for field in dataclasses.fields(value):
        try:
            fields[field.name] = _data(getattr(value, field.name))
        except _Refused as refused:
            refused.where.append(f".{field.name}")
            refused.note = " (without msgspec installed, a dataclass's fields are JSON data too)"
            raise
    return fields


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
    """Everything about an envelope but its payload, as JSON-ready values, led by the
    wire format's version (``v``: :data:`WIRE_FORMAT_VERSION`).

    Fields at their defaults (no headers, no ttl, no slip, the correlation id equal to
    the id, no causation, reply address or sender) are left out: every envelope pays
    for the meta on the wire and in the broker, and most use none of them.
    """
    meta: dict[str, Any] = {
        "v": WIRE_FORMAT_VERSION,
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
    payload, undecodable = decode_body(body, codec)
    return envelope_from_fields(fields, payload, attempt), undecodable


def decode_body(body: bytes, codec: Codec) -> tuple[Any, str | None]:
    """``(payload, None)``, or ``(RawBody(body), why)`` when ``codec`` cannot decode it
    (whatever a codec raises)."""
    try:
        return codec.decode(body), None
    except Exception as error:  # a codec's DecodeError, or whatever a custom one raises
        return RawBody(body), _reason(error)


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
