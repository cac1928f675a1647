"""RabbitMQ as a cluster: a transport given every node's URL, its durable queues quorum
queues, and a node killed under a running bus without losing what the cluster confirmed.

The module's cluster is three private nodes joined on loopback
(:func:`private_rabbit_cluster`: about 15 s to start); a test that kills a node starts it
again before it ends (it rejoins in about 5 s). A quorum queue's leader is the node of
the client that declared it: a transport given the nodes' URLs from node ``k`` on
connects to node ``k`` and declares there. The last test runs on the shared broker: the
durable queues an older version declared as classic queues are kept as they are.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable

import anyio
import pytest
from _brokers import publish_verbatim  # type: ignore[import-not-found]
from _failover import LoadThroughAFault  # type: ignore[import-not-found]
from _private_brokers import (  # type: ignore[import-not-found]
    RabbitCluster,
    private_rabbit_cluster,
)

from asyncbus import Bus, Envelope, Reject, TransportError
from asyncbus.testing.transport_suite import TransportSuite
from asyncbus.transports import Transport
from asyncbus.transports.base import Delivery
from asyncbus.transports.rabbit import RabbitTransport, delay_bucket_ms

pytestmark = [pytest.mark.anyio, pytest.mark.cluster, pytest.mark.timeout(180)]

ACK_TIMEOUT = 2.0
PUBLISH_TIMEOUT = 3.0


@pytest.fixture(scope="module")
async def cluster(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[RabbitCluster]:
    """The module's three-node RabbitMQ cluster."""
    pytest.importorskip("aio_pika")
    async with private_rabbit_cluster(tmp_path_factory.mktemp("rabbit-cluster")) as nodes:
        yield nodes


def _from(cluster: RabbitCluster, first: int) -> list[str]:
    """Every node's URL, node ``first``'s first (the node a transport connects to)."""
    urls = cluster.urls
    return urls[first:] + urls[:first]


async def _forget(url: str, prefix: str) -> None:
    with anyio.CancelScope(shield=True), anyio.fail_after(30):
        await RabbitTransport(url, prefix=prefix).delete_everything()


@pytest.fixture
async def prefix(cluster: RabbitCluster) -> AsyncIterator[str]:
    """A prefix of the test's own, everything under it deleted after it."""
    name = f"c{uuid.uuid4().hex[:10]}"
    yield name
    await _forget(cluster.urls[0], name)


class TestRabbitCluster(TransportSuite):
    """RabbitTransport on a three-node cluster passes the conformance suite."""

    ack_timeout = ACK_TIMEOUT

    @pytest.fixture
    async def transport(self, cluster: RabbitCluster, prefix: str) -> AsyncIterator[Transport]:
        async with RabbitTransport(
            cluster.urls, prefix=prefix, ack_timeout=self.ack_timeout
        ) as transport:
            yield transport

    async def publish_raw(self, transport: Transport, topic: str, body: bytes) -> None:
        await publish_verbatim(transport, topic, body)


async def _ready_count(url: str, queue: str) -> int:
    """Ready messages in ``queue``, from a connection of its own."""
    import aiormq

    connection = await aiormq.connect(url)
    try:
        channel = await connection.channel()
        declared = await channel.queue_declare(queue, passive=True)
        return int(declared.message_count or 0)
    finally:
        await connection.close()


async def _until(check: Callable[[], Awaitable[bool]]) -> None:
    """Look again every 50 ms until ``check()`` holds (bounded by the caller)."""
    while not await check():
        await anyio.sleep(0.05)


async def test_the_queue_leader_killed_under_load_loses_no_confirmed_publish(
    cluster: RabbitCluster, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Publishers running (100 in flight) when the node leading the group's quorum queue
    (the node the bus is connected to) is killed: publishes fail with ``TransportError``
    in time (never hang) while the bus moves to another node and the queue elects a
    leader, the same bus goes on, every confirmed publish is handled, and once the killed
    node is back each new publish is handled once."""
    transport = RabbitTransport(
        _from(cluster, 0),
        prefix=prefix,
        ack_timeout=ACK_TIMEOUT,
        publish_timeout=PUBLISH_TIMEOUT,
        max_backoff=0.5,
    )
    bus = Bus(transport=transport)
    load = LoadThroughAFault(bus)
    killed: list[int] = []

    async def kill_the_leader() -> None:
        await cluster.nodes[killed[0]].kill()

    try:
        with anyio.fail_after(150):
            async with bus:
                queue = transport.queue_name("jobs", "workers")
                killed.append(await cluster.leader_of(queue))
                assert killed == [0]
                assert transport.url == cluster.urls[0]
                await load.run(kill_the_leader)
                marker_in = await load.handled_again(anyio.current_time())
                await bus.drain(30)
                assert transport.url != cluster.urls[0]
                await cluster.restart(killed[0])  # it comes back and rejoins
                assert await load.after_return() == [1] * 100
    finally:
        if killed and not cluster.nodes[killed[0]].running:
            await cluster.restart(killed[0])
    with capsys.disabled():
        print(load.summary("RabbitMQ quorum, the queue leader killed", marker_in))
    assert len(load.confirmed) + len(load.failed) == load.total
    assert set(load.confirmed) - load.delivered == set()  # nothing confirmed was lost
    assert load.delivered - set(load.confirmed) <= load.failed
    assert max(load.took) <= PUBLISH_TIMEOUT * 2 + 1.0  # a publish fails in time
    assert load.resumed_in() <= ACK_TIMEOUT + 10.0
    assert marker_in <= PUBLISH_TIMEOUT + 10.0


async def _next(deliveries: AsyncIterator[Delivery], timeout: float) -> Delivery:
    with anyio.fail_after(timeout):
        return await anext(deliveries)


async def test_a_retry_and_a_dead_letter_outlive_the_node_that_declared_their_queues(
    cluster: RabbitCluster, prefix: str
) -> None:
    """The retry queue and the dead-letter queue are quorum queues: killing the node that
    declared them (and leads them) loses neither, and the transport, reconnected to
    another node, declares them again there (a classic queue would be ``NOT_FOUND``,
    its home node down, and the reconnection would fail for good)."""
    node = 1
    transport = RabbitTransport(
        _from(cluster, node), prefix=prefix, publish_timeout=PUBLISH_TIMEOUT, max_backoff=0.5
    )
    bus = Bus(transport=transport)
    handled: list[int] = []
    arrived = anyio.Event()
    rejected: set[int] = set()

    @bus.subscribe("jobs", group="g")
    async def work(n: int) -> None:
        if n == 2 and n not in rejected:
            rejected.add(n)
            raise Reject("not now")
        handled.append(n)
        arrived.set()

    delay = 4.0
    try:
        with anyio.fail_after(120):
            async with bus, transport.subscribe("later", group="raw", prefetch=1) as deliveries:
                queue = transport.queue_name("later", "raw")
                sent = Envelope(topic="later", payload="again")
                await transport.publish("later", [sent])
                await (await _next(deliveries, 10)).nack(delay=delay)
                retry = f"{queue}.retry.{delay_bucket_ms(delay)}"
                assert await _ready_count(cluster.urls[node], retry) == 1
                await bus.publish("jobs", 2)
                await _until(lambda: _listed(transport, 1))
                dead_letters = transport.dead_letter_queue
                for declared in (retry, dead_letters):  # led by the node about to die
                    assert await cluster.leader_of(declared) == node
                # Every ack written (a backlog count writes them first): the broker has
                # nothing of ours to deliver again.
                assert await transport.backlog("later", "raw") == 1  # (the retry)
                await bus.drain(10)
                assert await transport.backlog("jobs", "g") == 0

                await cluster.nodes[node].kill()
                again = await _next(deliveries, delay + 30)
                assert (again.envelope.id, again.envelope.attempt) == (sent.id, 2)
                await again.ack()
                assert transport.url != cluster.urls[node]

                await _publish_until_confirmed(bus, 3)
                await arrived.wait()
                assert handled == [3]
                [entry] = await transport.dead_letters()
                assert (entry.envelope.payload, entry.reason) == (2, "rejected")
                arrived = anyio.Event()
                await bus.dead_letters.replay(entry.envelope.id)
                await arrived.wait()
                await bus.drain(10)
                assert handled == [3, 2]
                assert await transport.dead_letters() == []
    finally:
        if not cluster.nodes[node].running:
            await cluster.restart(node)


async def _listed(transport: RabbitTransport, count: int) -> bool:
    """Whether the broker lists ``count`` dead letters."""
    return len(await transport.dead_letters()) == count


async def _publish_until_confirmed(bus: Bus, payload: int) -> None:
    """Publish until the broker confirms (the bus moving to another node meanwhile)."""
    while True:
        try:
            await bus.publish("jobs", payload)
            return
        except TransportError:
            await anyio.sleep(0.2)


async def _declare_classic(url: str, queues: dict[str, dict[str, object]]) -> None:
    """Declare ``queues`` (name -> arguments) as an older version did: classic queues."""
    import aiormq

    connection = await aiormq.connect(url)
    try:
        channel = await connection.channel()
        for name, arguments in queues.items():
            await channel.queue_declare(name, durable=True, arguments=arguments)  # type: ignore[arg-type]
    finally:
        await connection.close()


async def test_classic_queues_of_an_older_version_are_kept_and_used(
    rabbit_url: str, rabbit_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """The dead-letter queue, the catalog, the group register and a retry queue declared
    as classic queues (an older version's): a bus uses them as they are, saying so once
    per queue, and a second bus on them runs as well."""
    prefix = rabbit_prefix
    delay = 0.2
    ms = delay_bucket_ms(delay)
    raw_queue = RabbitTransport(rabbit_url, prefix=prefix).queue_name("later", "raw")
    old: dict[str, dict[str, object]] = {
        f"{prefix}.deadletters": {"x-message-ttl": 7 * 24 * 3600 * 1000, "x-max-length": 100_000},
        f"{prefix}.catalog": {"x-max-length": 100_000},
        f"{prefix}.groups": {},
        f"{raw_queue}.retry.{ms}": {
            "x-message-ttl": ms,
            "x-dead-letter-exchange": "",
            "x-dead-letter-routing-key": raw_queue,
            "x-expires": 2 * ms + 10 * 60 * 1000,
        },
    }
    with anyio.fail_after(60):
        await _declare_classic(rabbit_url, old)
        for _ in range(2):  # a second bus (and transport) on the same queues
            caplog.clear()
            with caplog.at_level(logging.WARNING, "asyncbus.transport.rabbit"):
                await _run_a_bus_on(rabbit_url, prefix, delay)
            warned = [r.getMessage() for r in caplog.records if "exists with other" in r.message]
            assert sorted(line.split()[1] for line in warned) == sorted(old)
        await _declare_classic(rabbit_url, old)  # still the classic queues: equivalent


async def _run_a_bus_on(url: str, prefix: str, delay: float) -> None:
    """A bus that rejects 2 (its dead letter listed, then taken out), and a delivery of
    its transport retried after ``delay`` through the retry queue."""
    transport = RabbitTransport(url, prefix=prefix)
    bus = Bus(transport=transport)

    @bus.subscribe("jobs", group="g")
    async def work(n: int) -> None:
        raise Reject(f"no {n}")

    async with bus:
        async with transport.subscribe("later", group="raw", prefetch=1) as deliveries:
            sent = Envelope(topic="later", payload=1)
            await transport.publish("later", [sent])
            await (await _next(deliveries, 10)).nack(delay=delay)
            again = await _next(deliveries, delay + 10)
            assert (again.envelope.id, again.envelope.attempt) == (sent.id, 2)
            await again.ack()
        await bus.publish("jobs", 2)
        await bus.drain(10)
        [entry] = await transport.dead_letters()
        assert (entry.envelope.payload, entry.reason) == (2, "rejected")
        assert await transport.take_dead_letters([entry.envelope.id]) == [entry]
        assert await transport.dead_letters() == []
