"""An unreachable broker fails ``async with bus`` with a ConnectError that names it."""

from __future__ import annotations

import anyio
import anyio.abc
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


async def _hold(stream: anyio.abc.SocketStream) -> None:
    """A server that accepts and never says a word (a black-holed broker)."""
    async with stream:
        await anyio.sleep_forever()


@pytest.mark.parametrize("silent", [True, False], ids=["black-holed", "refused"])
async def test_nats_connect_fails_within_connect_timeout(silent: bool) -> None:
    """nats-py gives each of its attempts connect_timeout: the transport bounds them all."""
    connect_timeout = 1.0
    listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
    port = listener.extra(anyio.abc.SocketAttribute.local_port)
    transport = NatsTransport(
        f"nats://127.0.0.1:{port}", connect_timeout=connect_timeout, reconnect_wait=0.5
    )
    async with listener, anyio.create_task_group() as task_group:
        if silent:
            task_group.start_soon(listener.serve, _hold)
        else:
            await listener.aclose()  # nothing listens there any more: refused
        started = anyio.current_time()
        with anyio.fail_after(10), pytest.raises(ConnectError) as caught:
            await transport.connect()
        took = anyio.current_time() - started
        task_group.cancel_scope.cancel()
    assert took < connect_timeout + 0.3, took
    assert f"127.0.0.1:{port}" in str(caught.value)
    if silent:
        assert "connect_timeout=1" in str(caught.value)
