"""One rule for payloads over a broker, whatever the codec and whether msgspec is installed.

A payload is JSON data (``dict`` with ``str`` keys, ``list``, ``tuple`` arriving as a
list, ``str``, ``int``, finite ``float``, ``bool``, ``None``) or a dataclass, msgspec
Struct or pydantic model; anything else is an ``EncodeError`` at publish naming where
the value is and what to send instead. Before, the standard library's codec refused a
``datetime`` without saying where it was, and msgspec's let it (and a ``set``) through
to arrive as a string and a list.
"""

from __future__ import annotations

import dataclasses
import datetime
import decimal
import sys
import uuid
from collections.abc import Callable
from typing import Any

import anyio
import msgspec
import pytest
from _brokers import make_transport  # type: ignore[import-not-found]

from asyncbus import Bus, EncodeError
from asyncbus.transports import JsonCodec, MsgspecCodec
from asyncbus.transports._codec import Codec, default_codec

WHEN = datetime.datetime(2024, 5, 17, 12, 30, tzinfo=datetime.UTC)


def _stdlib_default(monkeypatch: pytest.MonkeyPatch) -> Codec:
    monkeypatch.setitem(sys.modules, "msgspec", None)  # as if it were not installed
    codec = default_codec()
    assert type(codec) is JsonCodec
    return codec


CODECS: dict[str, Callable[[pytest.MonkeyPatch], Codec]] = {
    "json": lambda _: JsonCodec(),
    "msgspec": lambda _: MsgspecCodec(),
    "default-without-msgspec": _stdlib_default,
}


@pytest.fixture(params=sorted(CODECS))
def codec(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Codec:
    return CODECS[request.param](monkeypatch)


@pytest.mark.parametrize(
    ("payload", "what", "advice"),
    [
        ({"when": WHEN}, 'datetime at payload["when"]', "`.isoformat()`"),
        ({"tags": ["a", "b", {"c"}]}, 'set at payload["tags"][2]', "send a list"),
        ({"tags": {"a", "b"}}, 'set at payload["tags"]', "send a list"),
        ({"day": [WHEN.date()]}, 'date at payload["day"][0]', "`.isoformat()`"),
        ({"a": {"b": (1, uuid.UUID(int=7))}}, 'UUID at payload["a"]["b"][1]', "`str(...)`"),
        ({"price": decimal.Decimal("1.10")}, 'Decimal at payload["price"]', "`str(...)`"),
        ({"ratio": float("nan")}, 'float at payload["ratio"]', "no NaN or infinity"),
        ([1, float("-inf")], "float at payload[1]", "no NaN or infinity"),
        ({1: "one"}, "int key at payload[1]", "keys are strings"),
        (b"\x00raw", "bytes at payload", "base64"),
        ({"o": object()}, 'object at payload["o"]', "convert it to JSON data"),
        (frozenset({1}), "frozenset at payload", "send a list"),
    ],
)
def test_a_value_json_lacks_is_refused_naming_where_it_is_and_what_to_send(
    codec: Codec, payload: Any, what: str, advice: str
) -> None:
    with pytest.raises(EncodeError) as caught:
        codec.encode(payload)
    message = str(caught.value)
    assert message.startswith(f"cannot encode {what} as JSON: "), message
    assert advice in message


def test_json_data_comes_back_as_it_went_with_the_same_bytes_from_every_codec(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    payload = {"id": 7, "name": "café", "ok": True, "none": None, "x": [1.5, -2, "s"]}
    pair = {"pair": (1, 2)}  # a tuple arrives as a list, as JSON has arrays only
    encoded = {name: make(monkeypatch) for name, make in CODECS.items()}
    for codec in encoded.values():
        assert codec.decode(codec.encode(payload)) == payload
        assert codec.decode(codec.encode(pair)) == {"pair": [1, 2]}
    assert len({codec.encode(payload) for codec in encoded.values()}) == 1


@dataclasses.dataclass(frozen=True)
class Order:
    id: int
    when: datetime.datetime
    tags: frozenset[str]


@dataclasses.dataclass(frozen=True)
class Plain:
    id: int
    lines: list[str]


class Refund(msgspec.Struct, frozen=True):
    id: int
    when: datetime.datetime


@pytest.mark.parametrize("make", [JsonCodec, MsgspecCodec])
def test_a_model_travels_as_its_fields_and_its_library_restores_their_types(
    make: Callable[[], Codec],
) -> None:
    from asyncbus._decoding import payload_decoder

    codec = make()
    order = Order(1, WHEN, frozenset({"a"}))
    data = codec.decode(codec.encode(order))
    assert data == {"id": 1, "when": "2024-05-17T12:30:00Z", "tags": ["a"]}
    decode = payload_decoder(Order)
    assert decode is not None and decode(data) == order  # annotate the handler: it is back
    refund = Refund(2, WHEN)
    decode = payload_decoder(Refund)
    assert decode is not None and decode(codec.decode(codec.encode(refund))) == refund


def test_without_msgspec_a_dataclass_s_fields_are_json_data_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    codec = _stdlib_default(monkeypatch)
    assert codec.decode(codec.encode({"plain": Plain(1, ["x"])})) == {
        "plain": {"id": 1, "lines": ["x"]}
    }
    with pytest.raises(EncodeError) as caught:
        codec.encode({"order": Order(1, WHEN, frozenset())})
    message = str(caught.value)
    assert message.startswith('cannot encode datetime at payload["order"].when as JSON: ')
    assert "without msgspec installed" in message


# -- over every broker ------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.timeout(60)
@pytest.mark.parametrize("codec_name", ["json", "msgspec"])
async def test_over_a_broker_a_publish_of_what_json_lacks_is_refused_and_sends_nothing(
    kind: str, url: str, unique_prefix: str, codec_name: str
) -> None:
    codec = JsonCodec() if codec_name == "json" else MsgspecCodec()
    bus = Bus(transport=make_transport(kind, url, unique_prefix), codec=codec)
    handled: list[Any] = []

    @bus.subscribe("codec.rule", group="g")
    async def handle(payload: Any) -> None:
        handled.append(payload)

    with anyio.fail_after(45):
        async with bus:
            with pytest.raises(EncodeError, match=r'datetime at payload\["when"\]'):
                await bus.publish("codec.rule", {"id": 1, "when": WHEN})
            with pytest.raises(EncodeError, match=r'set at payload\["tags"\]\[2\]'):
                await bus.publish("codec.rule", {"id": 2, "tags": ["a", "b", {"c"}]})
            with pytest.raises(EncodeError, match=r'datetime at payload\["when"\]'):
                await bus.publish_many("codec.rule", [{"id": 3}, {"when": WHEN}])
            await bus.publish("codec.rule", {"id": 4, "when": WHEN.isoformat(), "pair": (1, 2)})
            await bus.drain(30)
    assert handled == [{"id": 4, "when": WHEN.isoformat(), "pair": [1, 2]}]
    assert bus.dead_letters.list() == []
    stage = bus.statistics().stage("codec.rule@g")
    assert (stage.published, stage.acked, stage.dead_lettered) == (1, 1, 0)
