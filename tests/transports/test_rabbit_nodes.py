"""RabbitMQ given several nodes: the first that answers is used, from the one used last;
``replicas`` is the quorum queues' initial group size, and a queue declared with
another is the broker's refusal, said at ``subscribe``."""

from __future__ import annotations

from pathlib import Path

import anyio
import pytest
from _private_brokers import free_port, private_rabbit  # type: ignore[import-not-found]

from asyncbus import Bus, ConfigurationError, TransportError
from asyncbus.transports.rabbit import RabbitTransport

pytestmark = [pytest.mark.anyio, pytest.mark.cluster, pytest.mark.timeout(60)]


async def test_a_node_that_does_not_answer_is_skipped(rabbit_url: str, rabbit_prefix: str) -> None:
    dead = f"amqp://guest:secret@127.0.0.1:{free_port()}/"
    transport = RabbitTransport([dead, rabbit_url], prefix=rabbit_prefix, connect_timeout=2.0)
    assert "secret" not in repr(transport)
    bus = Bus(transport=transport)
    handled: list[int] = []

    @bus.subscribe("orders", group="g")
    async def handle(n: int) -> None:
        handled.append(n)

    with anyio.fail_after(30):
        async with bus:
            assert transport.url == rabbit_url  # (the one that answered)
            await bus.publish_many("orders", range(5))
            await bus.drain()
    assert handled == list(range(5))


async def test_replicas_is_the_quorum_queues_initial_group_size(
    rabbit_url: str, rabbit_prefix: str
) -> None:
    import aiormq

    transport = RabbitTransport(rabbit_url, prefix=rabbit_prefix, replicas=1)
    queue = transport.queue_name("orders", "g")
    with anyio.fail_after(30):
        async with transport, transport.subscribe("orders", group="g", prefetch=1):
            pass
        connection = await aiormq.connect(rabbit_url)
        try:
            channel = await connection.channel()
            # Declared again with the same arguments: equivalent; without the size: not.
            await channel.queue_declare(
                queue,
                durable=True,
                arguments={"x-queue-type": "quorum", "x-quorum-initial-group-size": 1},
            )
            with pytest.raises(aiormq.exceptions.ChannelPreconditionFailed):
                await channel.queue_declare(
                    queue, durable=True, arguments={"x-queue-type": "quorum"}
                )
        finally:
            await connection.close()


async def test_a_queue_with_another_group_size_is_refused_at_subscribe(
    rabbit_url: str, rabbit_prefix: str
) -> None:
    first = RabbitTransport(rabbit_url, prefix=rabbit_prefix)
    async with first, first.subscribe("orders", group="g", prefetch=1):
        pass
    bus = Bus(transport=RabbitTransport(rabbit_url, prefix=rabbit_prefix, replicas=1))

    @bus.subscribe("orders", group="g")
    async def handle(n: int) -> None:
        pass

    with (
        anyio.fail_after(30),
        pytest.raises(ConfigurationError, match="initial-group-size"),
    ):
        async with bus:
            pass


def test_replicas_are_checked_when_the_transport_is_made() -> None:
    for wrong in (0, 100, True, 1.5, "3"):
        with pytest.raises(
            ConfigurationError,
            match=r"RabbitTransport: replicas must be an int >= 1 \(at most 99\)",
        ):
            RabbitTransport(replicas=wrong)  # type: ignore[arg-type]
    assert RabbitTransport(f"amqp://a/,amqp://b:{5673}/").servers == ["amqp://a/", "amqp://b:5673/"]


@pytest.mark.timeout(180)
async def test_a_lost_node_is_left_for_the_next_that_answers(tmp_path: Path) -> None:
    # Two nodes of their own (not one cluster: what the second holds is its own), so
    # this shows the client's move, not the cluster's replication.
    async with private_rabbit(tmp_path / "a") as first, private_rabbit(tmp_path / "b") as second:
        transport = RabbitTransport([first.url, second.url], prefix="move", max_backoff=0.5)
        bus = Bus(transport=transport)
        handled: list[int] = []

        @bus.subscribe("orders", group="g")
        async def handle(n: int) -> None:
            handled.append(n)

        with anyio.fail_after(120):
            async with bus:
                await bus.publish("orders", 1)
                await bus.drain()
                assert transport.url == first.url
                await first.kill()
                # Publishes fail until the transport is on the second node, and find no
                # group there until the stage's queue is declared on it again.
                accepted: list[int] = []
                for n in range(2, 10_000):
                    try:
                        receipt = await bus.publish("orders", n)
                    except TransportError:
                        await anyio.sleep(0.2)
                        continue
                    if receipt.accepted:
                        accepted.append(n)
                        break
                    await anyio.sleep(0.2)
                while accepted[0] not in handled:
                    await anyio.sleep(0.05)
                assert transport.url == second.url
    assert handled == [1, *accepted]
