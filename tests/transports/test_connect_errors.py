"""An unreachable broker fails ``async with bus`` with a ConnectError that names it."""

from __future__ import annotations

import anyio
import pytest

from asyncbus import Bus, ConnectError
from asyncbus.transports import NatsTransport, RabbitTransport, RedisTransport, Transport

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # the broker clients are asyncio libraries


@pytest.mark.parametrize(
    "make",
    [
        lambda: RedisTransport("redis://app:s3cret@127.0.0.1:1/0"),
        lambda: NatsTransport("nats://app:s3cret@127.0.0.1:1"),
        lambda: RabbitTransport("amqp://app:s3cret@127.0.0.1:1/"),
    ],
    ids=["redis", "nats", "rabbit"],
)
async def test_an_unreachable_broker_fails_async_with_bus_naming_host_and_port(make) -> None:  # type: ignore[no-untyped-def]
    transport: Transport = make()
    with anyio.fail_after(20), pytest.raises(ConnectError) as caught:
        async with Bus(transport=transport):
            pytest.fail("the bus started without its broker")
    message = str(caught.value)
    assert "127.0.0.1:1" in message
    assert "s3cret" not in message
