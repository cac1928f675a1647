"""The wire format, byte for byte, as docs/guide.md documents it ("On the wire").

Each broker in the table: an envelope with every field set is published through the
transport and read back with the broker's own client (redis-py, nats-py, aio-pika,
asyncpg), then compared with the golden message written out below; and a message
written by those clients exactly as the guide says is received by a bus subscriber
with every field intact (or dead-lettered ``rejected``, its body kept, when the bus
cannot read it). A change to what goes on the wire fails here: if it was meant, it is
a new :data:`~asyncbus.transports.WIRE_FORMAT_VERSION`, the guide and these goldens.
"""

from __future__ import annotations

import importlib.util
import json
import re
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from asyncbus import Bus, DeadLetterReason, Envelope
from asyncbus.transports import WIRE_FORMAT_VERSION, JsonCodec, MsgspecCodec
from asyncbus.transports._codec import dump_meta, envelope_from_wire, envelope_meta

pytestmark = [pytest.mark.timeout(60)]

# -- the golden messages ----------------------------------------------------------------

TOPIC = "wire.created"
#: The forward test's group: a pattern with a wildcard, to show how names are escaped.
PATTERN, GROUP = "wire.*", "golden"

#: Every field set, none at its default.
ENVELOPE = Envelope(
    id="golden-1",
    topic=TOPIC,
    payload={"order": 7, "note": "naïve ☃", "total": 12.5, "lines": [1, None, True]},
    headers={"trace": "abc", "note": "é ☃"},
    timestamp=1700000000.25,
    ttl=3600.0,
    attempt=2,
    slip=("wire.shipped", "wire.billed"),
    correlation_id="conv-1",
    causation_id="cause-0",
    reply_to="orders.replies",
    sender="billing ✓",
)

#: The body: the payload as compact UTF-8 JSON, characters unescaped (both codecs).
BODY = '{"order":7,"note":"naïve ☃","total":12.5,"lines":[1,null,true]}'.encode()

#: The meta: every field but the payload, compact JSON, the version first.
META_FIELDS = {
    "v": 1,
    "id": "golden-1",
    "topic": TOPIC,
    "timestamp": 1700000000.25,
    "attempt": 2,
    "headers": {"trace": "abc", "note": "é ☃"},
    "ttl": 3600.0,
    "slip": ["wire.shipped", "wire.billed"],
    "correlation_id": "conv-1",
    "causation_id": "cause-0",
    "reply_to": "orders.replies",
    "sender": "billing ✓",
}
#: The meta as written with msgspec installed: non-ASCII characters as UTF-8.
META_UTF8 = (
    '{"v":1,"id":"golden-1","topic":"wire.created","timestamp":1700000000.25,"attempt":2,'
    '"headers":{"trace":"abc","note":"é ☃"},"ttl":3600.0,'
    '"slip":["wire.shipped","wire.billed"],"correlation_id":"conv-1",'
    '"causation_id":"cause-0","reply_to":"orders.replies","sender":"billing ✓"}'
).encode()
#: The meta as written without msgspec (the standard library's json), and always in a
#: NATS header: non-ASCII characters escaped.
META_ASCII = (
    b'{"v":1,"id":"golden-1","topic":"wire.created","timestamp":1700000000.25,"attempt":2,'
    b'"headers":{"trace":"abc","note":"\\u00e9 \\u2603"},"ttl":3600.0,'
    b'"slip":["wire.shipped","wire.billed"],"correlation_id":"conv-1",'
    b'"causation_id":"cause-0","reply_to":"orders.replies","sender":"billing \\u2713"}'
)
#: What this installation writes (msgspec is in the test extra).
META = META_UTF8 if importlib.util.find_spec("msgspec") else META_ASCII


# -- without a broker -------------------------------------------------------------------


def test_the_meta_is_the_golden_one() -> None:
    assert WIRE_FORMAT_VERSION == 1
    assert envelope_meta(ENVELOPE) == META_FIELDS
    assert list(envelope_meta(ENVELOPE)) == list(META_FIELDS)  # the order too
    assert dump_meta(envelope_meta(ENVELOPE)) == META
    assert json.loads(META_UTF8) == json.loads(META_ASCII) == META_FIELDS


def test_a_plain_envelope_writes_only_the_version_and_the_four_fields() -> None:
    plain = Envelope(id="p-1", topic="wire.plain", payload=None, timestamp=1.5)
    assert dump_meta(envelope_meta(plain)) == (
        b'{"v":1,"id":"p-1","topic":"wire.plain","timestamp":1.5,"attempt":1}'
    )


@pytest.mark.parametrize("codec", [JsonCodec(), MsgspecCodec()], ids=["json", "msgspec"])
def test_both_codecs_write_the_golden_body(codec: Any) -> None:
    assert codec.content_type == "application/json"
    assert codec.encode(ENVELOPE.payload) == BODY
    assert codec.decode(BODY) == ENVELOPE.payload


def test_the_codecs_write_floats_in_exponent_form_differently() -> None:
    # The same JSON value, not the same bytes: what the guide says of floats.
    assert JsonCodec().encode([1e16, 1e-7]) == b"[1e+16,1e-07]"
    assert MsgspecCodec().encode([1e16, 1e-7]) == b"[1e16,1e-7]"


@pytest.mark.parametrize("meta", [META_UTF8, META_ASCII], ids=["utf8", "ascii"])
def test_meta_is_read_with_or_without_the_version(meta: bytes) -> None:
    fields = json.loads(meta)
    for given in (fields, {k: v for k, v in fields.items() if k != "v"}):
        envelope, error = envelope_from_wire(json.dumps(given).encode(), BODY, JsonCodec())
        assert error is None
        assert _fields(envelope) == _fields(ENVELOPE)


def test_only_id_topic_and_timestamp_are_required() -> None:
    envelope, error = envelope_from_wire(
        b'{"id":"f-1","topic":"wire.created","timestamp":1700000000}', b"null", JsonCodec()
    )
    assert error is None
    assert _fields(envelope) == _fields(
        Envelope(id="f-1", topic="wire.created", payload=None, timestamp=1700000000.0)
    )


def _fields(envelope: Envelope) -> dict[str, Any]:
    """Every field of ``envelope``, headers as a plain dict (for exact comparisons)."""
    return {
        "id": envelope.id,
        "topic": envelope.topic,
        "payload": envelope.payload,
        "headers": dict(envelope.headers),
        "timestamp": envelope.timestamp,
        "ttl": envelope.ttl,
        "attempt": envelope.attempt,
        "slip": envelope.slip,
        "correlation_id": envelope.correlation_id,
        "causation_id": envelope.causation_id,
        "reply_to": envelope.reply_to,
        "sender": envelope.sender,
    }


# -- what each broker holds --------------------------------------------------------------


def _make(kind: str, url: str, prefix: str) -> Any:
    from _brokers import make_transport  # type: ignore[import-not-found]

    return make_transport(kind, url, prefix)


async def _read_redis(url: str, prefix: str) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        entries = await client.xrange(f"{prefix}:stage:wire.*@golden")
    finally:
        await client.aclose()
    [(entry_id, fields)] = entries
    assert re.fullmatch(rb"\d+-\d+", entry_id)
    assert fields == {b"meta": META, b"body": BODY}
    assert list(fields) == [b"meta", b"body"]


async def _read_nats(url: str, prefix: str) -> None:
    import nats

    client = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
    try:
        message = await client.jetstream().get_last_msg(prefix.upper(), f"{prefix}.wire.created")
    finally:
        await client.close()
    assert message.subject == f"{prefix}.wire.created"
    assert message.seq == 1
    assert message.headers == {"Nats-Msg-Id": "golden-1", "asyncbus-meta": META_ASCII.decode()}
    assert message.data == BODY


async def _read_rabbit(url: str, prefix: str) -> None:
    import aio_pika

    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        queue = await channel.get_queue(f"{prefix}.wire.+2A@golden", ensure=False)
        message = await queue.get(no_ack=True, timeout=5)
    finally:
        await connection.close()
    assert (message.exchange, message.routing_key) == (prefix, TOPIC)
    assert message.body == BODY
    properties = message.properties
    headers = dict(properties.headers)
    # The broker's own count of returns (a quorum queue adds it; 0 on a first delivery).
    assert headers.pop("x-delivery-count", 0) == 0
    queued = headers.pop("asyncbus-queued")
    assert type(queued) is int and abs(queued - time.time() * 1000) < 60_000
    assert headers == {"asyncbus-meta": META.decode()}
    # Not set by asyncbus: RabbitMQ shows 0 where no priority was sent.
    assert properties.priority in (None, 0)
    assert {
        name: getattr(properties, name)
        for name in (
            "content_type",
            "content_encoding",
            "delivery_mode",
            "correlation_id",
            "reply_to",
            "expiration",
            "message_id",
            "timestamp",
            "message_type",
            "user_id",
            "app_id",
        )
    } == {
        "content_type": "application/json",
        "content_encoding": None,
        "delivery_mode": 2,
        "correlation_id": None,
        "reply_to": None,
        "expiration": None,
        "message_id": "golden-1",
        "timestamp": None,
        "message_type": None,
        "user_id": None,
        "app_id": None,
    }


async def _read_postgres(url: str, prefix: str) -> None:
    import asyncpg

    schema = prefix.replace("-", "_")
    connection = await asyncpg.connect(url, timeout=5)
    try:
        [group] = await connection.fetch(f"SELECT id, pattern, grp, regex FROM {schema}.groups")
        [row] = await connection.fetch(
            f"SELECT group_id, envelope_id, meta, body, attempt, deliveries, queued_at, "
            f"available_at <= now() AS available, claimed_by, claimed_until "
            f"FROM {schema}.messages"
        )
    finally:
        await connection.close()
    assert dict(group) == {
        "id": group["id"],
        "pattern": "wire.*",
        "grp": "golden",
        "regex": r"^wire\.[^.]+$",
    }
    found = dict(row)
    assert abs(found.pop("queued_at") - time.time()) < 60
    assert found == {
        "group_id": group["id"],
        "envelope_id": "golden-1",
        "meta": META,
        "body": BODY,
        "attempt": 2,
        "deliveries": 0,
        "available": True,
        "claimed_by": None,
        "claimed_until": None,
    }


READERS: dict[str, Callable[[str, str], Awaitable[None]]] = {
    "redis": _read_redis,
    "nats": _read_nats,
    "rabbit": _read_rabbit,
    "postgres": _read_postgres,
}


@pytest.mark.anyio
async def test_a_published_envelope_is_the_golden_message(
    kind: str, url: str, unique_prefix: str
) -> None:
    with anyio.fail_after(30):
        async with _make(kind, url, unique_prefix) as transport:
            # The group exists (and outlives this subscription), so the broker keeps
            # what is published for it; nothing consumes it.
            async with transport.subscribe(PATTERN, group=GROUP, prefetch=1):
                pass
            await transport.publish(TOPIC, [ENVELOPE])
        await READERS[kind](url, unique_prefix)


# -- what a foreign producer writes ------------------------------------------------------

#: A foreign producer's meta: as the guide documents it (UTF-8 JSON; NATS: ASCII).
FOREIGN_FIELDS = {
    "v": 1,
    "id": "foreign-1",
    "topic": TOPIC,
    "timestamp": 1700000000.5,
    "attempt": 3,
    "headers": {"trace": "xyz", "note": "ü ☃"},
    "ttl": 4000000000.0,  # the timestamp is fixed: the envelope must not have expired
    "slip": ["wire.shipped"],
    "correlation_id": "conv-2",
    "causation_id": "cause-1",
    "reply_to": "orders.replies",
    "sender": "foreign ✓",
}
FOREIGN_PAYLOAD = {"order": 8, "note": "crème ☃"}

#: The attempt a first delivery of it has: Redis, RabbitMQ and PostgreSQL count from
#: the attempt written (PostgreSQL: its ``attempt`` column), NATS from JetStream's
#: delivery count alone.
FOREIGN_ATTEMPT = {"redis": 3, "nats": 1, "rabbit": 3, "postgres": 3}
#: The id of the stand-in for a message whose meta is unreadable (what it is made from).
STAND_IN_ID = {
    "redis": r"redis:\d+-\d+",  # the stream entry's id
    "nats": r"foreign-3",  # its Nats-Msg-Id
    "rabbit": r"foreign-3",  # its message_id
    "postgres": r"postgres:\d+:\d+",  # the group's id and the row's seq
}


def _meta(fields: dict[str, Any], *, ascii_only: bool = False) -> bytes:
    return json.dumps(fields, separators=(",", ":"), ensure_ascii=ascii_only).encode()


Writer = Callable[[str, str, str, bytes | None, bytes, str], Awaitable[None]]


async def _write_redis(
    url: str, prefix: str, pattern: str, meta: bytes | None, body: bytes, message_id: str
) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    fields = {"body": body} if meta is None else {"meta": meta, "body": body}
    try:
        await client.xadd(f"{prefix}:stage:{pattern}@golden", fields)  # type: ignore[arg-type]
    finally:
        await client.aclose()


async def _write_nats(
    url: str, prefix: str, pattern: str, meta: bytes | None, body: bytes, message_id: str
) -> None:
    import nats

    headers = {"Nats-Msg-Id": message_id}
    if meta is not None:
        headers["asyncbus-meta"] = meta.decode()
    client = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
    try:
        await client.jetstream().publish(f"{prefix}.{TOPIC}", body, headers=headers)
    finally:
        await client.close()


async def _write_rabbit(
    url: str, prefix: str, pattern: str, meta: bytes | None, body: bytes, message_id: str
) -> None:
    import aio_pika
    from _foreign import publish_amqp  # type: ignore[import-not-found]

    message = aio_pika.Message(
        body,
        headers={} if meta is None else {"asyncbus-meta": meta.decode()},
        content_type="application/json",
        message_id=message_id,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )
    await publish_amqp(url, prefix, TOPIC, message)


async def _write_postgres(
    url: str, prefix: str, pattern: str, meta: bytes | None, body: bytes, message_id: str
) -> None:
    from _foreign import insert_row  # type: ignore[import-not-found]

    attempt = 1 if meta is None else json.loads(meta).get("attempt", 1)
    await insert_row(url, prefix, pattern, "golden", message_id, meta or b"", body, attempt)


WRITERS: dict[str, Writer] = {
    "redis": _write_redis,
    "nats": _write_nats,
    "rabbit": _write_rabbit,
    "postgres": _write_postgres,
}


@pytest.mark.anyio
async def test_a_message_written_as_documented_reaches_a_subscriber_intact(
    kind: str, url: str, unique_prefix: str
) -> None:
    received: list[Envelope] = []
    hops: list[Envelope] = []
    hopped = anyio.Event()
    bus = Bus(transport=_make(kind, url, unique_prefix))

    @bus.subscribe(TOPIC, group=GROUP)
    async def created(envelope: Envelope) -> dict[str, int]:
        received.append(envelope)
        return {"shipped": 8}

    @bus.subscribe("wire.shipped", group=GROUP)
    async def shipped(envelope: Envelope) -> None:
        hops.append(envelope)
        hopped.set()

    with anyio.fail_after(30):
        async with bus:
            await bus.subscribed()
            meta = _meta(FOREIGN_FIELDS, ascii_only=kind == "nats")
            body = json.dumps(FOREIGN_PAYLOAD, ensure_ascii=False).encode()  # spaces too
            await WRITERS[kind](url, unique_prefix, TOPIC, meta, body, "foreign-1")
            await hopped.wait()
            await bus.drain()
    assert [_fields(envelope) for envelope in received] == [
        {
            **{k: v for k, v in FOREIGN_FIELDS.items() if k != "v"},
            "payload": FOREIGN_PAYLOAD,
            "slip": ("wire.shipped",),
            "attempt": FOREIGN_ATTEMPT[kind],
        }
    ]
    # The bus writes the next hop itself, and reads it back: the conversation goes on.
    [hop] = hops
    assert _fields(hop) == {
        **_fields(received[0]),
        "id": hop.id,
        "topic": "wire.shipped",
        "payload": {"shipped": 8},
        "attempt": 1,
        "slip": (),
        "causation_id": "foreign-1",
    }
    assert hop.id != "foreign-1"
    assert bus.dead_letters.list() == []


@pytest.mark.anyio
async def test_what_the_bus_cannot_read_is_dead_lettered_rejected_with_its_body(
    kind: str, url: str, unique_prefix: str
) -> None:
    bus = Bus(transport=_make(kind, url, unique_prefix))
    handled: list[Envelope] = []

    @bus.subscribe(TOPIC, group=GROUP)
    async def created(envelope: Envelope) -> None:
        handled.append(envelope)

    fields = {"v": 1, "id": "foreign-2", "topic": TOPIC, "timestamp": 1700000000.5}
    with anyio.fail_after(30):
        async with bus:
            await bus.subscribed()
            write = WRITERS[kind]
            # A body the codec cannot decode, then meta that says nothing of an envelope
            # (a message with no meta at all is a plain one: test_plain_messages.py).
            await write(url, unique_prefix, TOPIC, _meta(fields), b"not json \xe2\x98", "foreign-2")
            await write(url, unique_prefix, TOPIC, b'{"v":1}', b'{"order":9}', "foreign-3")
            while len(bus.dead_letters.list()) < 2:
                await anyio.sleep(0.02)
            await bus.drain()
    assert handled == []
    undecodable, unreadable = sorted(bus.dead_letters.list(), key=lambda e: e.envelope.id)
    assert (undecodable.reason, unreadable.reason) == (DeadLetterReason.REJECTED,) * 2
    assert _fields(undecodable.envelope) == {
        **_fields(Envelope(id="foreign-2", topic=TOPIC, timestamp=1700000000.5)),
        "payload": b"not json \xe2\x98",
    }
    assert undecodable.error is not None and "body is not valid JSON" in undecodable.error
    assert re.fullmatch(STAND_IN_ID[kind], unreadable.envelope.id), unreadable.envelope.id
    assert unreadable.envelope.payload == b'{"order":9}'
    assert unreadable.error is not None
