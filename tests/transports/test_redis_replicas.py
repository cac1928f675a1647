"""RedisTransport(wait_replicas=N): a publish returns once N replicas have it, and
raises ``TransportError`` in time when they do not. A private server and a private
replica of it on loopback ports (``_private_brokers``)."""

from __future__ import annotations

import time
from pathlib import Path

import anyio
import pytest
from _private_brokers import private_redis, private_redis_replica  # type: ignore[import-not-found]

from asyncbus import Bus, ConfigurationError, Envelope, TransportError
from asyncbus.transports.redis import RedisTransport

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]


async def _added_on(url: str, key: str) -> int:
    """How many entries were ever added to stream ``key`` on the server at ``url``
    (settling deletes entries, not this count)."""
    import redis.asyncio as aioredis

    client = aioredis.Redis.from_url(url)
    try:
        return int((await client.xinfo_stream(key))["entries-added"])
    finally:
        await client.aclose()


async def test_a_publish_returns_once_the_replica_has_it_and_fails_in_time_without_one(
    tmp_path: Path,
) -> None:
    async with (
        private_redis(tmp_path) as master,
        private_redis_replica(tmp_path, master) as replica,
    ):
        transport = RedisTransport(master.url, prefix="w", wait_replicas=1, publish_timeout=1.0)
        bus = Bus(transport=transport)
        handled: list[int] = []
        stream = transport.stream_key("jobs", "workers")

        @bus.subscribe("jobs", group="workers", concurrency=1, capacity=64)
        async def work(n: int) -> None:
            handled.append(n)

        with anyio.fail_after(30):
            async with bus:
                for n in range(3):
                    await bus.publish("jobs", n)
                    # Returned: the replica has it already.
                    assert await _added_on(replica.url, stream) == n + 1
                await bus.drain()
                assert sorted(handled) == [0, 1, 2]
                await replica.kill()
                began = time.monotonic()
                with pytest.raises(TransportError, match="on 0 of the 1 replicas"):
                    await bus.publish("jobs", 3)
                took = time.monotonic() - began
                await bus.drain()
        assert took <= 1.0 + 0.5, f"the publish took {took:.2f} s to fail"
        assert sorted(handled) == [0, 1, 2, 3]  # on the server all the same


async def test_a_write_to_one_group_waits_for_the_replica_on_its_own_connection(
    tmp_path: Path,
) -> None:
    """A write to one group (a replay's) is followed by ``WAIT`` on the connection that
    wrote it: with the replica stopped (connected, silent) it raises in time."""
    async with (
        private_redis(tmp_path) as master,
        private_redis_replica(tmp_path, master) as replica,
    ):
        transport = RedisTransport(master.url, prefix="w", wait_replicas=1, publish_timeout=1.0)
        stream = transport.stream_key("jobs", "workers")
        with anyio.fail_after(30):
            async with transport:
                await transport.publish_to_group("jobs", "workers", [Envelope(topic="jobs")])
                assert await _added_on(replica.url, stream) == 1
                replica.pause()
                try:
                    began = time.monotonic()
                    with pytest.raises(TransportError, match="on 0 of the 1 replicas"):
                        await transport.publish_to_group(
                            "jobs", "workers", [Envelope(topic="jobs")]
                        )
                    took = time.monotonic() - began
                finally:
                    replica.pause(False)
                assert await _added_on(master.url, stream) == 2  # on the master all the same
        assert took <= 1.0 + 0.5, f"the write took {took:.2f} s to fail"


def test_wait_replicas_is_checked() -> None:
    with pytest.raises(ConfigurationError, match="wait_replicas"):
        RedisTransport("redis://127.0.0.1:6379", wait_replicas=-1)
    with pytest.raises(ConfigurationError, match="wait_replicas"):
        RedisTransport("redis://127.0.0.1:6379", wait_replicas=True)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="wait_replicas"):
        RedisTransport("redis://127.0.0.1:7000", cluster=True, wait_replicas=1.5)  # type: ignore[arg-type]
