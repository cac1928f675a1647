"""Plain messages in: what a client that knows nothing of asyncbus writes into each
broker (raw redis-py ``XADD``, nats-py ``js.publish``, aio-pika, asyncpg), without the
bus's meta, is handled with its body as the payload and the broker's own fields as the
envelope's, and goes through retry, dead letters and the ledger as the bus's own
messages do. A body the codec cannot decode is dead-lettered ``rejected``, its bytes
kept.
"""

from __future__ import annotations

import datetime
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import pytest

from asyncbus import Bus, DeadLetterReason, Envelope, Retry

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

TOPIC = "plain.orders"
PATTERN, GROUP = "plain.*", "audit"
STAGE = f"{PATTERN}@{GROUP}"
#: When the foreign producers say they wrote their messages (where the broker keeps it).
WRITTEN_AT = datetime.datetime(2026, 12, 1, 12, 0, 0, tzinfo=datetime.UTC)

#: A plain message's id on each broker: its own id where the producer gave one (NATS
#: ``Nats-Msg-Id``, AMQP ``message_id``), else what the broker names it by.
IDS = {
    "redis": r"redis:\d+-\d+",  # the stream entry's id
    "nats": r"{name}",
    "rabbit": r"{name}",
    "postgres": r"postgres:\d+:\d+",  # the group's id and the row's seq
}
#: The topic a plain message arrives with: the subject or routing key it was published
#: on where the broker keeps it, else the subscription's pattern.
TOPICS = {"redis": PATTERN, "nats": TOPIC, "rabbit": TOPIC, "postgres": PATTERN}

Writer = Callable[[str, str, str, bytes], Awaitable[None]]


async def _write_redis(url: str, prefix: str, name: str, body: bytes) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        await client.xadd(f"{prefix}:stage:{PATTERN}@{GROUP}", {"body": body})
    finally:
        await client.aclose()


async def _write_nats(url: str, prefix: str, name: str, body: bytes) -> None:
    import nats

    client = await nats.connect(url, allow_reconnect=False, connect_timeout=2)
    try:
        headers = {"Nats-Msg-Id": name, "trace": f"t-{name}"}
        await client.jetstream().publish(f"{prefix}.{TOPIC}", body, headers=headers)
    finally:
        await client.close()


async def _write_rabbit(url: str, prefix: str, name: str, body: bytes) -> None:
    import aio_pika
    from _foreign import publish_amqp  # type: ignore[import-not-found]

    message = aio_pika.Message(
        body,
        headers={"trace": f"t-{name}", "x-foreign": "kept out"},
        content_type="application/json",
        message_id=name,
        correlation_id=f"conv-{name}",
        timestamp=WRITTEN_AT,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
    )
    await publish_amqp(url, prefix, TOPIC, message)


async def _write_postgres(url: str, prefix: str, name: str, body: bytes) -> None:
    from _foreign import insert_row  # type: ignore[import-not-found]

    await insert_row(url, prefix, PATTERN, GROUP, name, b"", body)  # (no meta: a plain row)


WRITERS: dict[str, Writer] = {
    "redis": _write_redis,
    "nats": _write_nats,
    "rabbit": _write_rabbit,
    "postgres": _write_postgres,
}


def _make(kind: str, url: str, prefix: str) -> Any:
    from _brokers import make_transport  # type: ignore[import-not-found]

    return make_transport(kind, url, prefix)


async def test_plain_messages_are_handled_retried_and_dead_lettered_with_an_exact_ledger(
    kind: str, url: str, unique_prefix: str
) -> None:
    """Four plain messages: one handled at once, one failing once and retried, one
    failing every time (dead-lettered ``failed`` after its two attempts), one whose body
    is not JSON (dead-lettered ``rejected`` unhandled, its bytes kept)."""
    bus = Bus(transport=_make(kind, url, unique_prefix))
    attempts: dict[int, list[int]] = {}
    handled: list[Envelope] = []

    @bus.subscribe(PATTERN, group=GROUP, retry=Retry(max_attempts=2, backoff=0.01, jitter=False))
    async def audit(envelope: Envelope) -> None:
        order = envelope.payload["order"]
        attempts.setdefault(order, []).append(envelope.attempt)
        if order == 3 or (order == 2 and envelope.attempt == 1):
            raise RuntimeError(f"order {order} refused")
        handled.append(envelope)

    write = WRITERS[kind]
    with anyio.fail_after(45):
        async with bus:
            await bus.subscribed()
            for n in (1, 2, 3):
                await write(url, unique_prefix, f"plain-{n}", json.dumps({"order": n}).encode())
            await write(url, unique_prefix, "plain-4", b"not json \xe2\x98")
            while len(handled) < 2 or len(bus.dead_letters.list()) < 2:
                await anyio.sleep(0.02)
            await bus.drain()
            stage = bus.statistics().stage(STAGE)
            assert (stage.acked, stage.dead_lettered, stage.depth, stage.in_flight) == (2, 2, 0, 0)
            assert await bus.transport.backlog(PATTERN, GROUP) == 0
    assert attempts == {1: [1], 2: [1, 2], 3: [1, 2]}
    first, second = sorted(handled, key=lambda envelope: envelope.payload["order"])
    assert re.fullmatch(IDS[kind].format(name="plain-1"), first.id), first.id
    assert re.fullmatch(IDS[kind].format(name="plain-2"), second.id), second.id
    assert first.id != second.id
    assert (first.topic, first.payload, first.attempt, first.slip) == (
        TOPICS[kind],
        {"order": 1},
        1,
        (),
    )
    assert first.ttl is None and first.causation_id is None and first.sender is None
    if kind == "rabbit":  # the AMQP properties are the envelope's
        assert dict(first.headers) == {"trace": "t-plain-1"}
        assert first.correlation_id == "conv-plain-1"
        assert first.timestamp == WRITTEN_AT.timestamp()
    elif kind == "nats":  # its headers but the server's
        assert dict(first.headers) == {"trace": "t-plain-1"}
        assert first.correlation_id == first.id
    else:
        assert dict(first.headers) == {} and first.correlation_id == first.id
    # The retry is the same message (same id), written again in the bus's own format.
    assert second.attempt == 2
    failed, rejected = sorted(bus.dead_letters.list(), key=lambda entry: entry.reason.value)
    assert (failed.reason, rejected.reason) == (
        DeadLetterReason.HANDLER_FAILED,
        DeadLetterReason.REJECTED,
    )
    assert failed.envelope.payload == {"order": 3} and failed.attempts == 2
    assert re.fullmatch(IDS[kind].format(name="plain-3"), failed.envelope.id)
    assert rejected.envelope.payload == b"not json \xe2\x98"
    assert rejected.error is not None and "body is not valid JSON" in rejected.error
    assert re.fullmatch(IDS[kind].format(name="plain-4"), rejected.envelope.id)


async def test_a_plain_message_replayed_from_the_dead_letters_is_handled_as_the_bus_own(
    kind: str, url: str, unique_prefix: str
) -> None:
    """A plain message dead-lettered (its handler failed) and replayed once the handler
    works: it comes back with the same payload and id, now in the bus's own format."""
    bus = Bus(transport=_make(kind, url, unique_prefix))
    broken = True
    handled: list[Envelope] = []

    @bus.subscribe(PATTERN, group=GROUP)
    async def audit(envelope: Envelope) -> None:
        if broken:
            raise RuntimeError("not yet")
        handled.append(envelope)

    with anyio.fail_after(45):
        async with bus:
            await bus.subscribed()
            await WRITERS[kind](url, unique_prefix, "plain-9", b'{"order": 9}')
            while not bus.dead_letters.list():
                await anyio.sleep(0.02)
            await bus.drain()  # (the broker has stored it once its reject is written)
            [entry] = bus.dead_letters.list()
            broken = False
            assert len(await bus.dead_letters.replay(entry)) == 1
            while not handled:
                await anyio.sleep(0.02)
            await bus.drain()
    [again] = handled
    assert (again.id, again.payload) == (entry.envelope.id, {"order": 9})


async def test_a_redis_entry_of_fields_is_its_own_payload(
    redis_url: str, redis_prefix: str
) -> None:
    """A Redis entry without meta: its ``body`` field is the payload; its only field,
    whatever its name, is too; several fields and no ``body`` are the payload, a dict of
    them as text; fields that are not UTF-8 cannot be that, and are dead-lettered."""
    import redis.asyncio as aioredis

    from asyncbus.transports.redis import RedisTransport

    bus = Bus(transport=RedisTransport(redis_url, prefix=redis_prefix))
    handled: list[Any] = []

    @bus.subscribe(PATTERN, group=GROUP)
    async def audit(payload: Any) -> None:
        handled.append(payload)

    client = aioredis.Redis.from_url(redis_url)
    stream = f"{redis_prefix}:stage:{PATTERN}@{GROUP}"
    try:
        with anyio.fail_after(30):
            async with bus:
                await bus.subscribed()
                await client.xadd(stream, {"data": b'{"order": 5}'})
                await client.xadd(stream, {"order": "6", "note": "crème ☃"})
                await client.xadd(stream, {"order": b"7", "note": b"\xff\xfe"})
                while len(handled) < 2 or not bus.dead_letters.list():
                    await anyio.sleep(0.02)
                await bus.drain()
    finally:
        await client.aclose()
    assert handled == [{"order": 5}, {"order": "6", "note": "crème ☃"}]
    [entry] = bus.dead_letters.list()
    assert entry.reason is DeadLetterReason.REJECTED
    assert entry.error is not None and "fields are not text" in entry.error


def test_plain_headers_keep_text_pairs_but_the_broker_own() -> None:
    from asyncbus.transports._kit.plain import plain_headers

    pairs = [
        ("trace", "t-1"),
        ("X-Death", "kept out"),
        ("Nats-Expected-Stream", "kept out"),
        ("count", 3),
        (b"raw", "kept out"),
        ("lone", "\ud800"),
        ("note", "é ☃"),
    ]
    kept = plain_headers(pairs, skip=("x-", "nats-"))
    assert dict(kept) == {"trace": "t-1", "note": "é ☃"}
    assert dict(plain_headers([], skip=())) == {}


async def test_text_and_bytes_bodies_reach_handlers_through_the_text_and_bytes_codecs(
    kind: str, url: str, unique_prefix: str
) -> None:
    """Bodies that are not JSON: a bus whose transport has ``TextCodec`` hands UTF-8
    text to its handler as ``str`` (and dead-letters a body that is not UTF-8), one with
    ``BytesCodec`` hands over the bytes as they came."""
    from _brokers import make_transport  # type: ignore[import-not-found]

    from asyncbus.transports import BytesCodec, TextCodec

    texts: list[str] = []
    text_bus = Bus(transport=make_transport(kind, url, unique_prefix, codec=TextCodec()))

    @text_bus.subscribe(PATTERN, group=GROUP)
    async def read_text(line: str) -> None:
        texts.append(line)

    write = WRITERS[kind]
    with anyio.fail_after(30):
        async with text_bus:
            await text_bus.subscribed()
            await write(url, unique_prefix, "text-1", "héllo, plain wörld".encode())
            await write(url, unique_prefix, "text-2", b"\xff\xfe not utf-8")
            while not texts or not text_bus.dead_letters.list():
                await anyio.sleep(0.02)
            await text_bus.drain()
            [entry] = text_bus.dead_letters.list()
            assert entry.reason is DeadLetterReason.REJECTED
            assert entry.error is not None and "not UTF-8 text" in entry.error
            assert entry.envelope.payload == b"\xff\xfe not utf-8"
            assert text_bus.dead_letters.purge() == 1
            await text_bus.drain()  # (the broker's entry removed too)
    assert texts == ["héllo, plain wörld"]

    chunks: list[bytes] = []
    bytes_bus = Bus(transport=make_transport(kind, url, unique_prefix, codec=BytesCodec()))

    @bytes_bus.subscribe(PATTERN, group=GROUP)
    async def read_bytes(chunk: bytes) -> None:
        chunks.append(chunk)

    with anyio.fail_after(30):
        async with bytes_bus:
            await bytes_bus.subscribed()
            await write(url, unique_prefix, "bytes-1", b"\x00\x01\xff binary")
            while not chunks:
                await anyio.sleep(0.02)
            await bytes_bus.drain()
            assert bytes_bus.dead_letters.list() == []
    assert chunks == [b"\x00\x01\xff binary"]


def test_the_text_and_bytes_codecs_take_what_they_say_and_refuse_the_rest() -> None:
    from asyncbus import DecodeError, EncodeError
    from asyncbus.transports import BytesCodec, TextCodec

    text, raw = TextCodec(), BytesCodec()
    assert (text.encode("é"), text.decode(b"\xc3\xa9"), text.content_type) == (
        b"\xc3\xa9",
        "é",
        "text/plain; charset=utf-8",
    )
    assert (raw.encode(bytearray(b"\x00")), raw.decode(b"\xff")) == (b"\x00", b"\xff")
    assert raw.encode(memoryview(b"ab")) == b"ab"
    for codec, value in ((text, b"bytes"), (text, 1), (text, "\ud800"), (raw, "text"), (raw, 1)):
        with pytest.raises(EncodeError):
            codec.encode(value)
    with pytest.raises(DecodeError, match="not UTF-8"):
        text.decode(b"\xff")
