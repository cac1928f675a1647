"""Broker state that vanishes under a running bus: the bus makes it again and goes on.

Redis: a stream deleted (``DEL``, a flush of the test's keys, a server restarted
without persistence) while its consumer waits in ``XREADGROUP``. NATS: a server
restarted with its JetStream store lost, a consumer or the stream deleted by another
client. Restarts use private servers on other ports (``_private_brokers``); on the
shared servers only the keys and streams of the test's own prefix are deleted.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import pytest
from _private_brokers import private_nats, private_rabbit, private_redis

from asyncbus import Bus, Envelope, TransportError
from asyncbus.transports import Transport
from asyncbus.transports.nats import NatsTransport, consumer_name
from asyncbus.transports.rabbit import RabbitTransport
from asyncbus.transports.redis import RedisTransport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(90)]

ROUNDS = 3
PER_ROUND = 20


async def _publish_until_confirmed(bus: Bus, topic: str, payload: Any, timeout: float) -> None:
    """Publish once the broker is back (a publish refused while it is away is retried)."""
    with anyio.fail_after(timeout):
        while True:
            try:
                await bus.publish(topic, payload)
                return
            except TransportError:
                await anyio.sleep(0.1)


async def _survives(
    transport: Transport, vanish: Callable[[], Awaitable[None]], *, timeout: float = 20.0
) -> None:
    """A bus consumes ``work``; before each round its state vanishes (``vanish``); every
    envelope published after that is handled exactly once and the bus stays up."""
    bus = Bus(transport=transport)
    handled: list[int] = []

    @bus.subscribe("work", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    async with bus:
        sent: list[int] = []
        for round in range(ROUNDS):
            await vanish()
            for n in range(round * PER_ROUND, (round + 1) * PER_ROUND):
                await _publish_until_confirmed(bus, "work", n, timeout)
                sent.append(n)
            with anyio.fail_after(timeout):
                await bus.drain()
            assert sorted(handled) == sent
        stage = bus.statistics().stage("work@g")
        assert (stage.published, stage.acked, stage.dead_lettered) == (len(sent),) * 2 + (0,)


# -- Redis ------------------------------------------------------------------------------


async def _redis_client(url: str) -> Any:
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(url)


async def test_redis_stream_deleted_while_its_consumer_waits_is_made_again(
    redis_url: str, redis_prefix: str
) -> None:
    transport = RedisTransport(redis_url, prefix=redis_prefix, block_ms=2000)
    client = await _redis_client(redis_url)

    async def delete_the_stream() -> None:
        # The consumer waits in XREADGROUP (2 s blocks): DEL unblocks it with
        # "UNBLOCKED the stream key no longer exists".
        await anyio.sleep(0.3)
        assert await client.delete(transport.stream_key("work", "g")) == 1

    try:
        await _survives(transport, delete_the_stream)
    finally:
        await client.aclose()


async def test_redis_keys_flushed_under_a_running_bus_are_made_again(
    redis_url: str, redis_prefix: str
) -> None:
    transport = RedisTransport(redis_url, prefix=redis_prefix, block_ms=2000)
    client = await _redis_client(redis_url)

    async def flush_the_prefix() -> None:
        await anyio.sleep(0.3)  # the consumer waits in XREADGROUP
        keys = [key async for key in client.scan_iter(match=f"{redis_prefix}:*")]
        assert keys
        await client.delete(*keys)

    try:
        await _survives(transport, flush_the_prefix)
    finally:
        await client.aclose()


async def test_redis_restarted_without_persistence_under_a_running_bus(tmp_path: Path) -> None:
    async with private_redis(tmp_path) as server:

        async def restart_empty() -> None:
            await server.restart(fresh=True)

        await _survives(RedisTransport(server.url, prefix="restart"), restart_empty)


# -- NATS -------------------------------------------------------------------------------


async def test_nats_server_restarted_with_its_store_lost_under_a_running_bus(
    tmp_path: Path,
) -> None:
    async with private_nats(tmp_path) as server:

        async def restart_empty() -> None:
            await server.restart(fresh=True)

        transport = NatsTransport(server.url, prefix="restart", request_timeout=2.0)
        await _survives(transport, restart_empty, timeout=30.0)


async def _nats_js(url: str) -> Any:
    import nats

    return await nats.connect(url, allow_reconnect=False)


async def test_nats_consumer_deleted_by_another_client_is_made_again(
    nats_url: str, nats_prefix: str
) -> None:
    transport = NatsTransport(nats_url, prefix=nats_prefix)
    nc = await _nats_js(nats_url)

    async def delete_the_consumer() -> None:
        await anyio.sleep(0.3)  # the consumer's pull request waits on the server
        name = consumer_name("work", "g")
        await nc.jetstream().delete_consumer(transport.stream, name)
        # Until it exists again nothing is interested in ``work``: an interest stream
        # keeps nothing published meanwhile (no consumer, no delivery).
        with anyio.fail_after(10):
            while not await transport._consumer_exists(name):
                await anyio.sleep(0.05)

    try:
        await _survives(transport, delete_the_consumer)
    finally:
        await nc.close()


async def test_nats_stream_deleted_by_another_client_is_made_again(
    nats_url: str, nats_prefix: str
) -> None:
    transport = NatsTransport(nats_url, prefix=nats_prefix)
    nc = await _nats_js(nats_url)

    async def delete_the_streams() -> None:
        await anyio.sleep(0.3)  # the consumer's pull request waits on the server
        await nc.jetstream().delete_stream(transport.stream)
        await nc.jetstream().delete_stream(transport.dead_letter_stream)

    try:
        await _survives(transport, delete_the_streams)
    finally:
        await nc.close()


async def test_nats_dedup_bucket_lost_with_the_servers_state_is_made_again(
    tmp_path: Path,
) -> None:
    """deduplicate()'s KV bucket goes with the JetStream store: made again at next use,
    and claims are kept in it again."""
    from asyncbus.middleware import Claim, deduplicate

    async with private_nats(tmp_path) as server:
        transport = NatsTransport(server.url, prefix="dedup", request_timeout=2.0)
        bus = Bus(transport=transport)
        handled: list[str] = []

        @bus.subscribe("work", group="g", middleware=[deduplicate()])
        async def handle(n: str) -> None:
            handled.append(n)

        with anyio.fail_after(60):
            async with bus:
                for envelope_id in ("a", "a"):
                    await bus.publish("work", envelope_id, id=envelope_id)
                await bus.drain()
                assert handled == ["a"]
                await server.restart(fresh=True)
                with anyio.fail_after(30):
                    while True:  # until the server is back (the bucket is made again)
                        try:
                            await bus.publish("work", "b", id="b")
                            break
                        except TransportError:
                            await anyio.sleep(0.1)
                await bus.drain()
                assert handled == ["a", "b"]
                assert bus.dead_letters.list() == []
                # The store made again keeps claims as before.
                store = transport.dedup_store(300.0)
                assert await store.claim("work@g/x", "one", 30.0) is Claim.CLAIMED
                assert await store.claim("work@g/x", "two", 30.0) is Claim.BUSY
                await store.done("work@g/x", "one", 300.0)
                assert await store.claim("work@g/x", "two", 30.0) is Claim.DONE


async def test_redis_bindings_lost_are_all_made_again_when_one_came_back_first(
    redis_url: str, redis_prefix: str
) -> None:
    """After the server lost every binding (a flush, a restart without persistence), one
    subscription that read first registers its own again, which moves the bindings'
    version: a publish then reading the bindings must still find the others of this
    process (made again before routing), not dead-letter them ``no_subscribers``."""
    transport = RedisTransport(redis_url, prefix=redis_prefix)
    client = await _redis_client(redis_url)
    try:
        with anyio.fail_after(30):
            async with (
                transport,
                transport.subscribe("first", group="g", prefetch=1),
                transport.subscribe("work", group="g", prefetch=1),
            ):
                assert await transport.publish_routed("work", [Envelope(topic="work")]) == (
                    "work@g",
                )
                keys = [key async for key in client.scan_iter(match=f"{redis_prefix}:*")]
                await client.delete(*keys)
                await transport._bindings.bind_raw("first", "g")  # its consumer came back
                reached = await transport.publish_routed("work", [Envelope(topic="work")])
                assert reached == ("work@g",)
    finally:
        await client.aclose()


@pytest.mark.parametrize("loss", ["flushdb", "restart"])
async def test_redis_bindings_lost_under_busy_consumers_are_registered_again(
    tmp_path: Path, loss: str
) -> None:
    """The bindings hash goes with the server's data; a consumer busy with a long
    handler does not read (so it does not find its stream gone), yet its group must be
    known again to a process that only publishes, instead of its publishes being dead
    letters ``no_subscribers``."""
    async with private_redis(tmp_path) as server:
        worker = Bus(transport=RedisTransport(server.url, prefix="lost", claim_interval=0.2))
        handled: list[int] = []
        busy, release = anyio.Event(), anyio.Event()

        @worker.subscribe("work", group="g", capacity=1, concurrency=1)
        async def handle(n: int) -> None:
            if n == 0:
                busy.set()
                await release.wait()
            handled.append(n)

        publisher = Bus(transport=RedisTransport(server.url, prefix="lost"))
        with anyio.fail_after(30):
            async with worker, publisher:
                assert (await publisher.publish("work", 0)).accepted == ("work@g",)
                await busy.wait()
                if loss == "restart":
                    await server.restart(fresh=True)
                else:
                    client = await _redis_client(server.url)
                    try:
                        await client.flushdb()
                    finally:
                        await client.aclose()
                # Once the worker registered its group again, publishes reach it.
                receipt = None
                while receipt is None or receipt.accepted != ("work@g",):
                    await anyio.sleep(0.05)
                    try:
                        receipt = await publisher.publish("work", 1, id=f"one-{len(handled)}")
                    except TransportError:
                        continue  # the server is not back yet
                    assert handled == []  # the worker is still busy all along
                release.set()
                await worker.drain()
        assert handled[0] == 0 and 1 in handled


# -- RabbitMQ ---------------------------------------------------------------------------


@pytest.mark.timeout(150)
async def test_rabbit_groups_are_announced_again_after_the_broker_lost_its_state(
    tmp_path: Path,
) -> None:
    """A broker restarted with its state lost has lost the group register too: each
    process announces its groups again when it declares their queues on the new
    connection, so a process that connects afterwards knows them."""
    async with private_rabbit(tmp_path) as server:
        worker = Bus(transport=RabbitTransport(server.url, prefix="lost", max_backoff=0.5))
        handled: list[int] = []

        @worker.subscribe("work", group="g")
        async def handle(n: int) -> None:
            handled.append(n)

        async with worker:
            await server.restart(fresh=True)
            with anyio.fail_after(60):
                while True:  # until the worker declared and announced its group again
                    try:
                        async with Bus(
                            transport=RabbitTransport(server.url, prefix="lost")
                        ) as publisher:
                            receipt = await publisher.publish("work", 1)
                    except TransportError:  # the broker is not back yet
                        receipt = None
                    if receipt is not None and receipt.accepted == ("work@g",):
                        break
                    await anyio.sleep(0.2)
                await worker.drain()
        assert 1 in handled
