"""CloudEvents 1.0 and plain messages across the bus's edge, with the CloudEvents Python
SDK as the foreign producer and consumer (never our own encoder), over Redis, NATS and
RabbitMQ:

* in: events the SDK writes in binary mode (its HTTP binding's ``ce-*`` headers on NATS
  and Redis; on RabbitMQ its RabbitMQ binding's ``ce-*`` headers and its AMQP binding's
  ``cloudEvents_*`` application properties) and in structured mode are handled with the
  event's id, time, attributes and data, deduplicated by the id, retried and
  dead-lettered with an exact ledger;
* out: ``publish(..., headers={HEADER_WIRE: "cloudevents"})`` (and
  ``"cloudevents-structured"``) is read back by the SDK as the event it is, and
  ``HEADER_WIRE: "plain"`` by the broker's plain client as the JSON payload alone.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from asyncbus import HEADER_WIRE, Bus, DeadLetterReason, Envelope, Receipt, Retry
from asyncbus.middleware import deduplicate

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

ce = pytest.importorskip("cloudevents.core.v1.event")
http = pytest.importorskip("cloudevents.core.bindings.http")
amqp = pytest.importorskip("cloudevents.core.bindings.amqp")
rabbitmq = pytest.importorskip("cloudevents.core.bindings.rabbitmq")
json_format = pytest.importorskip("cloudevents.core.formats.json")

TOPIC = "shop.orders"
PATTERN, GROUP = "shop.*", "billing"
STAGE = f"{PATTERN}@{GROUP}"
WHEN = datetime.datetime(2026, 12, 1, 12, 0, 0, 250000, tzinfo=datetime.UTC)
BROKERS = ("redis", "nats", "rabbit")


def _event(event_id: str, data: Any) -> Any:
    return ce.CloudEvent(
        {
            "id": event_id,
            "source": "/shop/orders",
            "type": "com.example.order.created",
            "subject": f"order-{event_id}",
            "time": WHEN,
            "datacontenttype": "application/json",
        },
        data,
    )


def _make(kind: str, url: str, prefix: str) -> Any:
    from _brokers import make_transport  # type: ignore[import-not-found]

    return make_transport(kind, url, prefix)


# -- the SDK as the producer ---------------------------------------------------------

Send = Callable[[str, str, Any], Awaitable[None]]


async def _nats_publish(url: str, subject: str, body: bytes, headers: dict[str, str]) -> None:
    import nats

    client = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
    try:
        await client.jetstream().publish(subject, body, headers=headers)
    finally:
        await client.close()


async def _redis_add(url: str, prefix: str, fields: dict[str, Any]) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        await client.xadd(f"{prefix}:stage:{PATTERN}@{GROUP}", fields)
    finally:
        await client.aclose()


async def _rabbit_publish(
    url: str, prefix: str, body: bytes, headers: dict[str, Any], content_type: str | None
) -> None:
    import aio_pika
    from _foreign import publish_amqp  # type: ignore[import-not-found]

    message = aio_pika.Message(body, headers=headers, content_type=content_type)
    await publish_amqp(url, prefix, TOPIC, message)


async def _send(kind: str, url: str, prefix: str, event: Any, *, structured: bool) -> None:
    """``event`` written by the SDK's binding for the broker, in binary or structured mode."""
    fmt = json_format.JSONFormat()
    if kind == "rabbit":
        convert = rabbitmq.to_structured if structured else rabbitmq.to_binary
        message = convert(event, fmt)
        await _rabbit_publish(url, prefix, message.body, message.headers, message.content_type)
        return
    message = (http.to_structured if structured else http.to_binary)(event, fmt)
    if kind == "nats":
        await _nats_publish(url, f"{prefix}.{TOPIC}", message.body, message.headers)
    else:
        await _redis_add(url, prefix, {**message.headers, "body": message.body})


async def _send_binary(kind: str, url: str, prefix: str, event: Any) -> None:
    await _send(kind, url, prefix, event, structured=False)


async def _send_structured(kind: str, url: str, prefix: str, event: Any) -> None:
    await _send(kind, url, prefix, event, structured=True)


async def _send_amqp_binding(kind: str, url: str, prefix: str, event: Any) -> None:
    """The AMQP binding: attributes as ``cloudEvents_*`` application properties."""
    message = amqp.to_binary(event, json_format.JSONFormat())
    await _rabbit_publish(
        url,
        prefix,
        message.application_data,
        message.application_properties,
        message.properties.get("content-type"),
    )


MODES: dict[str, Callable[[str, str, str, Any], Awaitable[None]]] = {
    "binary": _send_binary,
    "structured": _send_structured,
}


def _expected(event_id: str, data: Any) -> dict[str, Any]:
    return {
        "id": event_id,
        "payload": data,
        "timestamp": WHEN.timestamp(),
        "headers": {
            "ce-source": "/shop/orders",
            "ce-type": "com.example.order.created",
            "ce-subject": f"order-{event_id}",
            "ce-datacontenttype": "application/json",
        },
        "correlation_id": event_id,
    }


def _seen(envelope: Envelope) -> dict[str, Any]:
    return {
        "id": envelope.id,
        "payload": envelope.payload,
        "timestamp": envelope.timestamp,
        "headers": dict(envelope.headers),
        "correlation_id": envelope.correlation_id,
    }


@pytest.mark.parametrize("kind", BROKERS, indirect=True)
@pytest.mark.parametrize("mode", list(MODES))
async def test_events_from_the_sdk_are_handled_deduplicated_retried_and_dead_lettered(
    kind: str, url: str, unique_prefix: str, mode: str
) -> None:
    """Four events from the SDK, one of them sent twice: the copy is skipped by its id,
    one fails once and is retried, one fails every time (dead-lettered after two
    attempts), and each handled envelope carries the event's id, time and attributes."""
    await _ledger_run(kind, url, unique_prefix, MODES[mode])


@pytest.mark.parametrize("kind", ["rabbit"], indirect=True)
async def test_events_in_the_amqp_binding_are_read_as_in_the_rabbitmq_one(
    kind: str, url: str, unique_prefix: str
) -> None:
    """RabbitMQ also takes the AMQP binding's ``cloudEvents_*`` application properties."""
    await _ledger_run(kind, url, unique_prefix, _send_amqp_binding)


async def _ledger_run(
    kind: str, url: str, unique_prefix: str, send: Callable[[str, str, str, Any], Awaitable[None]]
) -> None:
    bus = Bus(transport=_make(kind, url, unique_prefix))
    attempts: dict[str, list[int]] = {}
    handled: list[Envelope] = []

    @bus.subscribe(
        PATTERN,
        group=GROUP,
        retry=Retry(max_attempts=2, backoff=0.01, jitter=False),
        middleware=[deduplicate()],
    )
    async def billing(envelope: Envelope) -> None:
        attempts.setdefault(envelope.id, []).append(envelope.attempt)
        if envelope.id == "ev-3" or (envelope.id == "ev-2" and envelope.attempt == 1):
            raise RuntimeError(f"{envelope.id} refused")
        handled.append(envelope)

    with anyio.fail_after(45):
        async with bus:
            await bus.subscribed()
            for n in (1, 2, 3):
                await send(kind, url, unique_prefix, _event(f"ev-{n}", {"order": n}))
            await send(kind, url, unique_prefix, _event("ev-1", {"order": 1}))  # again
            while len(handled) < 2 or not bus.dead_letters.list():
                await anyio.sleep(0.02)
            await bus.drain()
            stage = bus.statistics().stage(STAGE)
            assert (stage.acked, stage.dead_lettered, stage.depth, stage.in_flight) == (3, 1, 0, 0)
    assert attempts == {"ev-1": [1], "ev-2": [1, 2], "ev-3": [1, 2]}
    first, second = sorted(handled, key=lambda envelope: envelope.id)
    expected = _expected("ev-1", {"order": 1})
    assert _seen(first) == expected
    assert first.topic == (PATTERN if kind == "redis" else TOPIC)
    assert second.id == "ev-2" and second.payload == {"order": 2}
    [entry] = bus.dead_letters.list()
    assert (entry.reason, entry.envelope.id, entry.attempts) == (
        DeadLetterReason.HANDLER_FAILED,
        "ev-3",
        2,
    )


@pytest.mark.parametrize("kind", BROKERS, indirect=True)
async def test_what_says_cloudevents_and_is_none_is_dead_lettered_rejected(
    kind: str, url: str, unique_prefix: str
) -> None:
    """A message whose headers say CloudEvents but that lacks ``source``, and a batch
    (the HTTP binding's mode, one message holding several events): neither an event nor
    a plain message: each dead-lettered ``rejected``, nothing handled."""
    bus = Bus(transport=_make(kind, url, unique_prefix))
    handled: list[Any] = []

    @bus.subscribe(PATTERN, group=GROUP)
    async def billing(payload: Any) -> None:
        handled.append(payload)

    batch = json.dumps([{"id": "b-1", "source": "/s", "type": "t", "specversion": "1.0"}])
    sent = [
        ({"ce-specversion": "1.0", "ce-id": "ev-9", "ce-type": "t"}, b"{}", "application/json"),
        ({}, batch.encode(), "application/cloudevents-batch+json"),
    ]
    with anyio.fail_after(30):
        async with bus:
            await bus.subscribed()
            for headers, body, content_type in sent:
                if kind == "nats":
                    everything = {**headers, "content-type": content_type}
                    await _nats_publish(url, f"{unique_prefix}.{TOPIC}", body, everything)
                elif kind == "redis":
                    fields = {**headers, "content-type": content_type, "body": body}
                    await _redis_add(url, unique_prefix, fields)
                else:
                    await _rabbit_publish(url, unique_prefix, body, headers, content_type)
            while len(bus.dead_letters.list()) < 2:
                await anyio.sleep(0.02)
            await bus.drain()
    assert handled == []
    errors = sorted(entry.error or "" for entry in bus.dead_letters.list())
    assert {entry.reason for entry in bus.dead_letters.list()} == {DeadLetterReason.REJECTED}
    assert "batch mode is the HTTP binding's" in errors[0], errors
    assert "has no 'source'" in errors[1], errors


# -- the SDK (and plain clients) as the consumer ----------------------------------------


async def _read_nats(url: str, prefix: str, publish: Callable[[], Awaitable[Any]]) -> Any:
    """What a plain NATS subscriber on the topic's subject receives of one publish."""
    import nats

    client = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
    try:
        subscription = await client.subscribe(f"{prefix}.{TOPIC}")
        await client.flush()
        await publish()
        return await subscription.next_msg(timeout=10)
    finally:
        await client.close()


async def _read_rabbit(url: str, prefix: str, publish: Callable[[], Awaitable[Any]]) -> Any:
    """What a plain AMQP consumer with a queue of its own on the topic receives."""
    import aio_pika

    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        exchange = await channel.get_exchange(prefix, ensure=False)
        queue = await channel.declare_queue(exclusive=True)
        await queue.bind(exchange, routing_key=TOPIC)
        await publish()
        with anyio.fail_after(10):
            while (message := await queue.get(fail=False)) is None:
                await anyio.sleep(0.02)
        await message.ack()
        return message
    finally:
        await connection.close()


async def _read_redis(url: str, prefix: str, publish: Callable[[], Awaitable[Any]]) -> Any:
    """The fields of the entry one publish wrote to the group's stream."""
    import redis.asyncio as aioredis

    await publish()
    client = aioredis.Redis.from_url(url)
    try:
        [(_entry, fields)] = await client.xrange(f"{prefix}:stage:{PATTERN}@{GROUP}")
    finally:
        await client.aclose()
    return {name.decode(): value for name, value in fields.items()}


READERS = {"nats": _read_nats, "rabbit": _read_rabbit, "redis": _read_redis}


def _as_sdk_event(kind: str, message: Any, structured: bool) -> Any:
    """The event the SDK reads from what the broker delivered."""
    fmt = json_format.JSONFormat()
    if kind == "rabbit":
        if structured:
            found = rabbitmq.RabbitMQMessage(
                headers={}, content_type=message.content_type, body=message.body
            )
            return rabbitmq.from_structured(found, fmt)
        return amqp.from_binary(
            amqp.AMQPMessage(
                properties={"content-type": message.content_type},
                application_properties=dict(message.headers),
                application_data=message.body,
            ),
            fmt,
        )
    if kind == "nats":
        headers, body = dict(message.headers), message.data
    else:
        body = message.pop("body")
        headers = {name: value.decode() for name, value in message.items()}
    return http.from_http(http.HTTPMessage(headers=headers, body=body), fmt)


async def _published_and_read(
    kind: str, url: str, prefix: str, payload: Any, headers: dict[str, str]
) -> tuple[Receipt, Any, Envelope]:
    """One publish of ``payload`` with ``headers`` by a bus named ``billing``: its
    receipt, what the broker's plain client received of it, and the envelope the bus's
    own subscription handled."""
    bus = Bus(transport=_make(kind, url, prefix), name="billing")
    handled: list[Envelope] = []
    arrived = anyio.Event()

    @bus.subscribe(PATTERN, group=GROUP)
    async def billing(envelope: Envelope) -> None:
        handled.append(envelope)
        arrived.set()

    receipts: list[Receipt] = []
    with anyio.fail_after(30):
        async with bus:
            await bus.subscribed()

            async def publish() -> None:
                receipts.append(await bus.publish(TOPIC, payload, headers=headers))

            message = await READERS[kind](url, prefix, publish)
            await arrived.wait()
            await bus.drain()
    [receipt], [again] = receipts, handled
    return receipt, message, again


@pytest.mark.parametrize("kind", BROKERS, indirect=True)
@pytest.mark.parametrize("wire", ["cloudevents", "cloudevents-structured"])
async def test_what_the_bus_publishes_as_a_cloudevent_the_sdk_reads_as_that_event(
    kind: str, url: str, unique_prefix: str, wire: str
) -> None:
    headers = {HEADER_WIRE: wire, "ce-type": "com.example.invoice.sent", "ce-subject": "inv-7"}
    receipt, message, again = await _published_and_read(
        kind, url, unique_prefix, {"invoice": 7}, headers
    )
    event = _as_sdk_event(kind, message, structured=wire == "cloudevents-structured")
    assert (event.get_id(), event.get_type(), event.get_source(), event.get_subject()) == (
        receipt.id,
        "com.example.invoice.sent",
        "asyncbus:billing",
        "inv-7",
    )
    assert event.get_specversion() == "1.0"
    assert event.get_data() == {"invoice": 7}
    assert event.get_datacontenttype() == "application/json"
    # The bus reads it back as the same event.
    assert (again.id, again.payload, again.headers["ce-type"]) == (
        receipt.id,
        {"invoice": 7},
        "com.example.invoice.sent",
    )
    assert event.get_time() is not None
    assert abs(event.get_time().timestamp() - again.timestamp) < 1e-3


@pytest.mark.parametrize("kind", BROKERS, indirect=True)
async def test_what_the_bus_publishes_plain_a_plain_client_reads_as_the_json_alone(
    kind: str, url: str, unique_prefix: str
) -> None:
    headers = {HEADER_WIRE: "plain", "trace": "t-1"}
    receipt, message, again = await _published_and_read(
        kind, url, unique_prefix, {"invoice": 8}, headers
    )
    if kind == "nats":
        assert json.loads(message.data) == {"invoice": 8}
        assert message.headers == {
            "Nats-Msg-Id": receipt.id,
            "trace": "t-1",
            "content-type": "application/json",
        }
    elif kind == "rabbit":
        assert json.loads(message.body) == {"invoice": 8}
        assert (message.message_id, message.content_type) == (receipt.id, "application/json")
        assert dict(message.headers) == {"trace": "t-1"}
        assert message.timestamp is not None
    else:
        assert message == {"id": receipt.id.encode(), "body": b'{"invoice":8}'}
    # The bus reads it back as a plain message with the same id.
    assert (again.id, again.payload) == (receipt.id, {"invoice": 8})


async def test_an_unknown_wire_format_is_refused_at_publish() -> None:
    from asyncbus import ConfigurationError

    bus = Bus()
    async with bus:
        with pytest.raises(ConfigurationError, match="asyncbus-wire"):
            await bus.publish(TOPIC, 1, headers={HEADER_WIRE: "protobuf"})


# -- the mapping itself, on what no SDK writes ------------------------------------------


def test_what_the_mapping_refuses_and_what_it_reads() -> None:
    from asyncbus import DecodeError
    from asyncbus.transports import JsonCodec
    from asyncbus.transports._kit.cloudevents import (
        event_attributes,
        event_envelope,
        structured_event,
        to_structured,
    )

    codec = JsonCodec()
    base = {"id": "e", "source": "/s", "type": "t", "specversion": "1.0"}
    for bad, why in (
        ({**base, "specversion": "0.3"}, "only 1.0"),
        ({**base, "time": "2026-12-01T12:00:00"}, "no offset"),
        ({**base, "time": "yesterday"}, "RFC 3339"),
        ({**base, "time": 5}, "not text"),
        ({**base, "data_base64": "***"}, "not base64"),
        ({k: v for k, v in base.items() if k != "type"}, "'type'"),
    ):
        with pytest.raises(DecodeError, match=why):
            event_envelope(bad, codec, topic="t", attempt=1)
    with pytest.raises(DecodeError, match="not a JSON object"):
        structured_event(b"[1, 2]")
    with pytest.raises(DecodeError, match="not JSON"):
        structured_event(b"{nope")
    envelope, error = event_envelope(
        {**base, "data_base64": "AAEC", "time": "2026-12-01T12:00:00.25+01:00"},
        codec,
        topic="t",
        attempt=0,
    )
    assert (envelope.payload, error, envelope.attempt) == (b"\x00\x01\x02", None, 1)
    assert envelope.timestamp == WHEN.timestamp() - 3600
    _envelope, error = event_envelope(base, codec, topic="t", attempt=1, body=b"{bad")
    assert error is not None and "not valid JSON" in error  # (dead-lettered rejected)
    # An AMQP timestamp (milliseconds) and a datetime both read as RFC 3339 times.
    found = event_attributes({"cloudEvents:time": 1796126400250, "CE-SpecVersion": "1.0"})
    assert found == {"time": "2026-12-01T12:00:00.250000Z", "specversion": "1.0"}
    assert event_attributes({"ce-id": "x"}) is None  # (no specversion: not an event)
    written = json.loads(to_structured(envelope, b"\xff raw", "application/octet-stream"))
    assert (written["data_base64"], written["datacontenttype"]) == (
        "/yByYXc=",
        "application/octet-stream",
    )
