"""The wire format under garbage: whatever bytes arrive, decoding raises DecodeError or
returns an envelope that can be written back; encoding raises EncodeError, never
RecursionError. Fuzzed with hypothesis, with both JSON libraries behind the meta."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncbus import DeadLetter, DeadLetterReason, DecodeError, EncodeError, Envelope
from asyncbus.transports import _codec
from asyncbus.transports._codec import (
    JsonCodec,
    MsgspecCodec,
    dead_letter_from_wire,
    dead_letter_to_wire,
    envelope_from_wire,
    envelope_to_wire,
)

FUZZ = settings(
    max_examples=300,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)

DEEP = 100_000


@pytest.fixture(params=["msgspec", "json"])
def meta_json(request: pytest.FixtureRequest) -> Iterator[str]:
    """The meta read and written by msgspec, then by the standard library."""
    saved = (_codec._meta_json.dumps, _codec._meta_json.loads)
    if request.param == "json":
        _codec._meta_json.dumps, _codec._meta_json.loads = _codec._stdlib_dumps, json.loads
    else:
        import msgspec

        _codec._meta_json.dumps = msgspec.json.Encoder().encode
        _codec._meta_json.loads = msgspec.json.Decoder().decode
    yield request.param
    _codec._meta_json.dumps, _codec._meta_json.loads = saved


CODECS = [
    pytest.param(MsgspecCodec(), id="msgspec-body"),
    pytest.param(JsonCodec(), id="json-body"),
]


def _check_usable(envelope: Envelope, codec: Any) -> None:
    """Every field has its type, and the envelope can be written back and dead-lettered."""
    assert isinstance(envelope.id, str) and envelope.id
    assert isinstance(envelope.topic, str) and envelope.topic
    assert isinstance(envelope.timestamp, float) and math.isfinite(envelope.timestamp)
    assert envelope.ttl is None or (isinstance(envelope.ttl, float) and math.isfinite(envelope.ttl))
    assert type(envelope.attempt) is int and envelope.attempt >= 0
    assert all(isinstance(k, str) and isinstance(v, str) for k, v in envelope.headers.items())
    assert all(isinstance(topic, str) and topic for topic in envelope.slip)
    assert isinstance(envelope.correlation_id, str)
    for value in (envelope.causation_id, envelope.reply_to, envelope.sender):
        assert value is None or isinstance(value, str)
    meta, _ = envelope_to_wire(envelope.evolve(payload=None), codec)
    entry = DeadLetter(envelope, DeadLetterReason.REJECTED, "why", "s@g", 1, 1.0)
    again = dead_letter_from_wire(dead_letter_to_wire(entry, codec), codec)
    assert again.envelope.id == envelope.id
    assert envelope_from_wire(meta, b"null", codec)[0].id == envelope.id


def _decode(meta: bytes, body: bytes, codec: Any) -> None:
    try:
        envelope, error = envelope_from_wire(meta, body, codec)
    except DecodeError:
        return
    if error is not None:
        assert isinstance(error, str) and error
        assert envelope.payload == body
    _check_usable(envelope, codec)


@pytest.mark.parametrize("codec", CODECS)
@FUZZ
@given(meta=st.binary(max_size=200), body=st.binary(max_size=200))
def test_any_bytes_decode_or_raise_decode_error(
    meta_json: str, codec: Any, meta: bytes, body: bytes
) -> None:
    _decode(meta, body, codec)


_JSON_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10)
)
_JSON = st.recursive(
    _JSON_SCALARS,
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=5), children, max_size=3)
    ),
    max_leaves=8,
)
_FIELDS = st.sampled_from(
    [
        "id",
        "topic",
        "timestamp",
        "attempt",
        "headers",
        "ttl",
        "slip",
        "correlation_id",
        "causation_id",
        "reply_to",
        "sender",
    ]
)
_GOOD = {"id": "e1", "topic": "orders.created", "timestamp": 1.5, "attempt": 1}


def _meta_text(fields: dict[str, Any]) -> bytes:
    # json writes NaN, Infinity and huge ints, which msgspec never would: readers of
    # the wire see them anyway.
    return json.dumps(fields).encode()


@pytest.mark.parametrize("codec", CODECS)
@FUZZ
@given(
    changes=st.dictionaries(
        _FIELDS, _JSON | st.sampled_from([math.nan, math.inf, 1e308 * 10, 10**400]), max_size=4
    ),
    dropped=st.lists(_FIELDS, max_size=3),
)
def test_structured_but_wrong_meta_decodes_or_raises_decode_error(
    meta_json: str, codec: Any, changes: dict[str, Any], dropped: list[str]
) -> None:
    fields = {**_GOOD, **changes}
    for name in dropped:
        fields.pop(name, None)
    try:
        meta = _meta_text(fields)
    except ValueError:  # an int too long for json to write
        return
    _decode(meta, b'{"a":1}', codec)


@pytest.mark.parametrize(
    "fields",
    [
        {"id": "e", "topic": "t"},
        {**_GOOD, "headers": ["a", "b"]},
        {**_GOOD, "headers": {"k": 1}},
        {**_GOOD, "timestamp": "yesterday"},
        {**_GOOD, "attempt": "3"},
        {**_GOOD, "attempt": True},
        {**_GOOD, "attempt": -1},
        {**_GOOD, "attempt": 10**30},
        {**_GOOD, "ttl": "1"},
        {**_GOOD, "slip": "next"},
        {**_GOOD, "slip": ["a.*"]},
        {**_GOOD, "topic": ""},
        {**_GOOD, "id": ""},
        {**_GOOD, "id": 7},
        {**_GOOD, "sender": {"x": 1}},
        {**_GOOD, "reply_to": 1.5},
        ["not", "an", "object"],
    ],
)
def test_each_wrong_field_is_a_decode_error(meta_json: str, fields: Any) -> None:
    with pytest.raises(DecodeError):
        envelope_from_wire(json.dumps(fields).encode(), b"null", MsgspecCodec())


@pytest.mark.parametrize("number", [b"NaN", b"Infinity", b"-Infinity", b"1e400"])
def test_timestamps_that_are_no_finite_number_are_a_decode_error(
    meta_json: str, number: bytes
) -> None:
    meta = b'{"id":"e","topic":"t","timestamp":' + number + b"}"
    with pytest.raises(DecodeError):
        envelope_from_wire(meta, b"null", MsgspecCodec())


def test_a_lone_surrogate_in_a_field_is_a_decode_error() -> None:
    saved = _codec._meta_json.loads
    _codec._meta_json.loads = json.loads  # msgspec refuses it already; json reads it
    try:
        with pytest.raises(DecodeError):
            envelope_from_wire(b'{"id":"\\ud800","topic":"t","timestamp":1}', b"1", JsonCodec())
    finally:
        _codec._meta_json.loads = saved


@pytest.mark.parametrize("codec", CODECS)
def test_deeply_nested_meta_is_a_decode_error(meta_json: str, codec: Any) -> None:
    meta = b'{"id":"e","topic":"t","timestamp":1,"headers":' + b"[" * DEEP + b"]" * DEEP + b"}"
    with pytest.raises(DecodeError, match="nested too deep"):
        envelope_from_wire(meta, b"1", codec)


@pytest.mark.parametrize("codec", CODECS)
def test_deeply_nested_body_is_delivered_raw_with_an_error(meta_json: str, codec: Any) -> None:
    body = b"[" * DEEP + b"]" * DEEP
    envelope, error = envelope_from_wire(b'{"id":"e","topic":"t","timestamp":1}', body, codec)
    assert error is not None and "nested too deep" in error
    assert envelope.payload == body


def _nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


@pytest.mark.parametrize("codec", CODECS)
def test_a_payload_nested_too_deep_is_an_encode_error(codec: Any) -> None:
    with pytest.raises(EncodeError, match="nested too deep"):
        envelope_to_wire(Envelope(topic="t", payload=_nested(DEEP)), codec)


@pytest.mark.parametrize("codec", CODECS)
def test_a_dead_letter_of_a_payload_nested_too_deep_is_still_written(codec: Any) -> None:
    entry = DeadLetter(
        Envelope(topic="t", payload=_nested(DEEP)), DeadLetterReason.REJECTED, None, None, 1, 1.0
    )
    again = dead_letter_from_wire(dead_letter_to_wire(entry, codec), codec)
    assert again.envelope.id == entry.envelope.id


@FUZZ
@given(data=st.binary(max_size=300))
def test_any_bytes_as_a_dead_letter_raise_decode_error_or_rebuild_it(data: bytes) -> None:
    try:
        entry = dead_letter_from_wire(data, MsgspecCodec())
    except DecodeError:
        return
    _check_usable(entry.envelope, MsgspecCodec())


@FUZZ
@given(
    changes=st.dictionaries(
        st.sampled_from(["meta", "body", "reason", "error", "stage", "attempts", "dead_at", "raw"]),
        _JSON,
        max_size=3,
    )
)
def test_wrong_dead_letter_documents_raise_decode_error_or_rebuild_it(
    changes: dict[str, Any],
) -> None:
    good = {"meta": _GOOD, "body": "bnVsbA==", "reason": "rejected", "attempts": 1, "dead_at": 2.0}
    try:
        entry = dead_letter_from_wire(json.dumps({**good, **changes}).encode(), MsgspecCodec())
    except DecodeError:
        return
    _check_usable(entry.envelope, MsgspecCodec())
