"""What another client writes into a bus's broker-side registries and stores is never
fatal: an entry that cannot be read (not JSON, JSON nested deeper than any parser
recurses, the wrong shape) is ignored with a warning, and the bus goes on.

Covered here: the group registries (Redis's bindings hash, NATS consumer
descriptions, RabbitMQ's group register and its news), the ``deduplicate()`` stores
(Redis keys, the NATS KV bucket).
"""

from __future__ import annotations

import logging
from typing import Any

import anyio
import pytest

from asyncbus import Bus, DeadLetterReason
from asyncbus.middleware import deduplicate
from asyncbus.transports.nats import NatsTransport
from asyncbus.transports.rabbit import RabbitTransport
from asyncbus.transports.redis import RedisTransport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

#: Nested far deeper than Python's recursion limit.
DEEP = "[" * 100_000 + "]" * 100_000
#: Deep enough to hit the recursion limit, short enough for a NATS description (4 KiB).
DEEP_SHORT = "[" * 2000 + "]" * 2000
JUNK: list[str | bytes] = [DEEP, "{not json", b"\xff\xfe\x00", "[1, 2]", '["a..b", "g"]', "[]"]


def _warned(caplog: pytest.LogCaptureFixture, text: str) -> int:
    return sum(
        text in record.getMessage()
        for record in caplog.records
        if record.levelno >= logging.WARNING
    )


async def _publish_reaches_the_group(bus: Bus, handled: list[Any]) -> None:
    receipt = await bus.publish("deep.one", 1)
    assert receipt.accepted == ("deep.*@g",)
    receipt = await bus.publish("nobody.listens", 2, id="unrouted")
    assert receipt.accepted == ()
    await bus.drain()
    assert handled == [1]
    [entry] = bus.dead_letters.list()
    assert (entry.envelope.id, entry.reason) == ("unrouted", DeadLetterReason.NO_SUBSCRIBERS)


def _bus(transport: Any, handled: list[Any]) -> Bus:
    bus = Bus(transport=transport)

    @bus.subscribe("deep.*", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    return bus


# -- group registries -------------------------------------------------------------------


async def test_redis_unreadable_bindings_are_skipped(
    redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(redis_url)
    try:
        await client.hset(
            f"{redis_prefix}:bindings",
            mapping={f"{redis_prefix}:junk:{n}": value for n, value in enumerate(JUNK)},
        )
        await client.set(f"{redis_prefix}:bindings:version", "someone-else")
    finally:
        await client.aclose()
    handled: list[Any] = []
    with caplog.at_level(logging.WARNING), anyio.fail_after(30):
        async with _bus(RedisTransport(redis_url, prefix=redis_prefix), handled) as bus:
            await _publish_reaches_the_group(bus, handled)
    assert _warned(caplog, "unreadable binding") >= len(JUNK)


async def test_nats_unreadable_group_descriptions_are_ignored(
    nats_url: str, nats_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig

    handled: list[Any] = []
    transport = NatsTransport(nats_url, prefix=nats_prefix)
    with caplog.at_level(logging.WARNING), anyio.fail_after(30):
        async with _bus(transport, handled) as bus:
            nc = await nats.connect(nats_url, allow_reconnect=False)
            try:
                for n, description in enumerate([DEEP_SHORT, "{not json", "[1, 2]"]):
                    name = f"foreign-{n}"
                    await nc.jetstream().add_consumer(
                        transport.stream,
                        ConsumerConfig(
                            name=name,
                            durable_name=name,
                            description="asyncbus group " + description,
                            filter_subject=f"{nats_prefix}.foreign.{n}",
                            ack_policy=AckPolicy.EXPLICIT,
                        ),
                    )
            finally:
                await nc.close()
            transport._groups.forget()  # as the advisories of the creations would
            await _publish_reaches_the_group(bus, handled)
            # A consumer whose description names no group still takes envelopes: it
            # counts under its own name.
            receipt = await bus.publish("foreign.0", 3)
            assert receipt.accepted == ("foreign.0@foreign-0",)
    assert _warned(caplog, "unreadable group description") >= 3


async def test_rabbit_unreadable_group_announcements_are_ignored(
    rabbit_url: str, rabbit_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    import aiormq

    async def announce(junk: list[str | bytes]) -> None:
        connection = await aiormq.connect(rabbit_url)
        try:
            channel = await connection.channel()
            for body in junk:
                await channel.basic_publish(
                    body.encode() if isinstance(body, str) else body,
                    exchange=f"{rabbit_prefix}.groups",
                )
        finally:
            await connection.close()

    # The register exists once a transport connected: junk in it is read at connect.
    async with RabbitTransport(rabbit_url, prefix=rabbit_prefix):
        pass
    await announce(JUNK)
    handled: list[Any] = []
    with caplog.at_level(logging.WARNING), anyio.fail_after(30):
        async with _bus(RabbitTransport(rabbit_url, prefix=rabbit_prefix), handled) as bus:
            await announce(JUNK)  # the news of a running transport too
            await _publish_reaches_the_group(bus, handled)
            # The news were read: the junk came before this announcement of a group.
            async with Bus(transport=RabbitTransport(rabbit_url, prefix=rabbit_prefix)) as other:
                other.subscribe("late.*", lambda n: None, group="late")
                await other.subscribed()
            with anyio.fail_after(10):
                while (await bus.publish("late.one", 4)).accepted != ("late.*@late",):
                    await anyio.sleep(0.05)
    assert _warned(caplog, "unreadable group announcement") >= 2 * len(JUNK)


# -- deduplicate() stores ---------------------------------------------------------------


async def _dedup_over_junk(bus: Bus, write_junk: Any, handled: list[str]) -> None:
    ids = [f"id-{n}" for n in range(3)]
    await write_junk(ids)
    for envelope_id in ids:
        await bus.publish("dedup.one", envelope_id, id=envelope_id)
    await bus.drain()
    assert sorted(handled) == ids
    for envelope_id in ids:  # now handled: a second delivery is dropped
        await bus.publish("dedup.one", envelope_id, id=envelope_id)
    await bus.drain()
    assert sorted(handled) == ids
    assert bus.dead_letters.list() == []


def _dedup_bus(transport: Any, handled: list[str]) -> Bus:
    bus = Bus(transport=transport)

    @bus.subscribe("dedup.*", group="d", middleware=[deduplicate()])
    async def handle(envelope_id: str) -> None:
        handled.append(envelope_id)

    return bus


async def test_redis_dedup_keys_written_by_another_client_count_as_absent(
    redis_url: str, redis_prefix: str
) -> None:
    import redis.asyncio as aioredis

    async def write_junk(ids: list[str]) -> None:
        client = aioredis.Redis.from_url(redis_url)
        prefix = f"{redis_prefix}:dedup:dedup.*@d/"
        try:
            await client.set(prefix + ids[0], DEEP)
            await client.hset(prefix + ids[1], "not", "a string")
            await client.set(prefix + ids[2], b"\xff\xfe")
        finally:
            await client.aclose()

    handled: list[str] = []
    with anyio.fail_after(30):
        async with _dedup_bus(RedisTransport(redis_url, prefix=redis_prefix), handled) as bus:
            await _dedup_over_junk(bus, write_junk, handled)


async def test_nats_dedup_entries_written_by_another_client_count_as_absent(
    nats_url: str, nats_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:

    transport = NatsTransport(nats_url, prefix=nats_prefix)

    async def write_junk(ids: list[str]) -> None:
        from asyncbus.transports._nats_dedup import _key

        kv = await transport.dedup_store(300.0)._bucket()  # deduplicate()'s default window
        junk = [DEEP.encode(), b'{"owner": "x", "until": "never"}', b'{"owner": 1}']
        for envelope_id, value in zip(ids, junk, strict=True):
            await kv.put(_key(f"dedup.*@d/{envelope_id}"), value)

    handled: list[str] = []
    try:
        with caplog.at_level(logging.WARNING), anyio.fail_after(30):
            async with _dedup_bus(transport, handled) as bus:
                await _dedup_over_junk(bus, write_junk, handled)
        assert _warned(caplog, "unreadable claim") >= 3
    finally:
        await _delete_buckets(nats_url, transport.stream)


async def _delete_buckets(url: str, stream: str) -> None:
    import contextlib

    import nats
    from nats.js.errors import NotFoundError

    with anyio.CancelScope(shield=True):
        nc = await nats.connect(url, allow_reconnect=False)
        try:
            js = nc.jetstream()
            for info in await js.streams_info():
                if info.config.name.startswith(f"KV_{stream}_DEDUP_"):
                    with contextlib.suppress(NotFoundError):
                        await js.delete_stream(info.config.name)
        finally:
            await nc.close()


# -- counters ---------------------------------------------------------------------------


@pytest.mark.parametrize("garbled", [b"not a number", b"1.5", DEEP.encode()])
async def test_redis_a_garbled_count_of_delayed_retries_is_ignored(
    redis_url: str, redis_prefix: str, caplog: pytest.LogCaptureFixture, garbled: bytes
) -> None:
    import redis.asyncio as aioredis

    from asyncbus import Envelope

    counts = f"{redis_prefix}:delayed:counts"
    client = aioredis.Redis.from_url(redis_url)
    try:
        async with (
            RedisTransport(redis_url, prefix=redis_prefix) as transport,
            transport.subscribe("delay.*", group="g", prefetch=4) as deliveries,
        ):
            stream = transport.stream_key("delay.*", "g")
            await client.hset(counts, stream, garbled)
            with caplog.at_level(logging.WARNING):
                assert await transport.backlog("delay.*", "g") == 0
            assert _warned(caplog, "unreadable count") == 1
            await transport.publish("delay.one", [Envelope(topic="delay.one", payload=1)])
            assert await transport.backlog("delay.*", "g") == 1
            with anyio.fail_after(10):
                delivery = await anext(deliveries)
                await delivery.nack(delay=0.2)
                # Counted again from zero: the retry waiting in the sorted set.
                assert await client.hget(counts, stream) == b"1"
                assert await transport.backlog("delay.*", "g") == 1
                retry = await anext(deliveries)
            assert (retry.envelope.payload, retry.envelope.attempt) == (1, 2)
            assert await client.hget(counts, stream) is None  # moved: none waits
            await retry.ack()
    finally:
        await client.aclose()
